"""Exact global attention over sharded pixel tokens: ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention`` (``F.multi_head_attention_forward``). K / V split like the
queries go around the ring (``_ring.py``); whole K / V are attended locally, their gradient
summed over the ranks; masks meet the rank's query rows and each piece's key columns
(``_ring_mask.py``). docs/attention.md.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._cross_attention import _refuse as refuse
from ._cross_attention import cross_mha, cross_sdpa, project_attend, split_keys, unsupported_mha
from ._dims import wrap
from ._errors import module_path
from ._mode import register_handler
from ._ring import ring_attention
from ._ring_mask import RingMask, mha_bias, sdpa_bias
from ._sharding import grad_groups
from ._token_layout import held_indices
from ._token_ring import Seq, partial_local, token_ring
from ._tokens import split_layouts

log = logging.getLogger("spconv_train.parallel")

_refuse = functools.partial(refuse, where="on a sharded token sequence")

#: the keys and values of one attention call: their local tensors and the ring they go
#: around (``group``, every member's token count, every member's global key indices)
Keys = tuple[Tensor, Tensor, object, tuple[int, ...], tuple[Tensor, ...]]


def _sequence_layout(q: DTensor, seq_dim: int, batch_dim: int, what: str) -> Seq:
    """The layouts that split ``q``'s sequence dim (empty: not split); refuses any other
    split but a plain one of the batch dim."""
    found = []
    for lay in split_layouts(q):
        if lay.dim == seq_dim:
            found.append(lay)
        elif lay.dim != batch_dim or lay.split_factor != 1:
            raise _refuse(what, f"a split of dim {lay.dim} ({q.placements})")
    return tuple(found)


def _keys(q: DTensor, k, v, seq: Seq, what: str) -> Keys:
    """``k``, ``v`` split over the same mesh dims as ``q``'s sequence (their own token
    counts: e.g. keys from a strided conv of the map, spatial-reduction attention) go
    around those ranks; whole there and split like ``q`` elsewhere (the batch) they are a
    ring of one rank, their gradient a partial sum."""
    if not (isinstance(k, DTensor) and isinstance(v, DTensor)):
        raise _refuse(what, "plain-tensor keys / values next to sharded queries")
    dims = {m.mesh_dim for m in seq}
    others = [(m.mesh_dim, m.dim) for m in split_layouts(q) if m.mesh_dim not in dims]
    if k.placements == v.placements:
        lays = split_layouts(k)
        rest = [(m.mesh_dim, m.dim) for m in lays if m.mesh_dim not in dims]
        kseq = tuple(m for m in lays if m.mesh_dim in dims)
        on_seq = all(m.dim == seq[0].dim for m in kseq)
        if rest == others and {m.mesh_dim for m in kseq} == dims and on_seq:
            return k.to_local(), v.to_local(), *token_ring(q.device_mesh, kseq).spec(q.device)
        if rest == others and not kseq:  # every key here, in global order
            n = k.shape[seq[0].dim - q.ndim]  # (k's own batch dims may broadcast)
            cols = (torch.arange(n, device=q.device),)
            return partial_local(k, seq), partial_local(v, seq), None, (n,), cols
    raise _refuse(
        what,
        f"keys / values split as {k.placements}, {v.placements} unlike the queries {q.placements}",
    )


def _attend(ql, kl, vl, scale, keys: Keys, bias=None, rows=None, kbias=None) -> Tensor:
    """Attention of local queries ``(..., L_r, E)`` to the keys of ``keys``; ``bias``: the
    rank's rows of an additive mask; ``rows``: the queries' global indices when causal;
    ``kbias``: an additive mask of the rank's keys (ring only), which travels with them."""
    masked = bias is not None or rows is not None or kbias is not None
    mask = RingMask(keys[4], rows, ql.dtype) if masked else None
    return ring_attention(ql, kl, vl, *keys[2:4], scale, bias=bias, mask=mask, kbias=kbias)


@register_handler(F.scaled_dot_product_attention)  # torch._C._nn's is the same object
def spatial_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` with the sequence (dim -2) split over the spatial
    ranks: the ring, or local attention to whole keys / values."""
    what = "F.scaled_dot_product_attention"
    kseq = split_keys(query, key, -2)
    if kseq:  # whole queries, keys split: _cross_attention.py
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return cross_sdpa(kseq, *args)
    if not isinstance(query, DTensor):
        raise _refuse(what, "plain-tensor queries next to sharded keys / values")
    for bad, why in (
        (attn_mask is not None and is_causal, "an attention mask with is_causal=True"),
        (dropout_p > 0, f"attention dropout (dropout_p={dropout_p})"),
        (enable_gqa, "enable_gqa=True"),
    ):
        if bad:
            raise _refuse(what, why)
    seq = _sequence_layout(query, query.ndim - 2, 0, what)
    if not seq:
        if attn_mask is not None or is_causal:
            raise _refuse(what, "an attention mask on queries whose sequence is whole")
        return F.scaled_dot_product_attention(query, key, value, scale=scale)  # DTensor's
    keys = _keys(query, key, value, seq, what)
    bias = sdpa_bias(attn_mask, query, what)
    rows = held_indices(seq).to(query.device) if is_causal else None
    out = _attend(query.to_local(), *keys[:2], scale, keys, bias, rows)
    return wrap(out, query, query.placements, (*query.shape[:-1], value.shape[-1]))


#: ``F.multi_head_attention_forward``'s parameters and their defaults
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@register_handler(F.multi_head_attention_forward)
def spatial_multi_head_attention(*args, **kwargs):
    """``nn.MultiheadAttention``'s functional form, sequence-first ``(L, N, E)`` with ``L``
    split: projections local, attention by the ring (or local to whole keys / values).
    The averaged attention weights (``need_weights``, an ``L x L`` map) are not formed:
    the second output is ``None``."""
    what = "nn.MultiheadAttention"
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = bound.arguments
    q, k, v = kw["query"], kw["key"], kw["value"]
    kseq = split_keys(q, k, 0)
    if kseq is not None:  # whole queries (keys split, or whole too): _cross_attention.py
        return cross_mha(kw, kseq)
    if not isinstance(q, DTensor):
        raise _refuse(what, "plain-tensor queries next to sharded keys / values")
    why = unsupported_mha(kw, causal_with_mask=True)
    if why:
        raise _refuse(what, why)
    seq = _sequence_layout(q, 0, 1, what)
    if not seq or q.ndim != 3:
        raise _refuse(
            what,
            f"queries {tuple(q.shape)} {q.placements} without a split "
            "sequence (dim 0 of (L, N, E))",
        )
    keys = _keys(q, k, v, seq, what)
    # is_causal is a hint that attn_mask is causal: the mask alone gives the same result
    masks = (kw["attn_mask"], kw["key_padding_mask"])
    bias, kbias = mha_bias(*masks, q, k, seq, kw["num_heads"], what)
    groups = grad_groups(q)  # every weight gradient is a partial sum: each rank's queries
    attend = functools.partial(_attend, keys=keys, bias=bias, kbias=kbias)
    out = project_attend(kw, (q.to_local(), *keys[:2]), groups, groups, attend)
    if kw["need_weights"]:
        log.debug("nn.MultiheadAttention in '%s': attention weights not formed", module_path())
    return wrap(out, q, q.placements, q.shape), None
