"""Exact global attention over sharded pixel tokens: ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention`` (``F.multi_head_attention_forward``).

K / V split like the queries go around the ring (``_ring.py``, exact, memory O(L / P) per
rank); whole K / V are attended locally, their gradient summed over the ranks; masks and
biases meet the rank's query rows and each piece's key columns (``_ring_mask.py``).
Attention dropout and ``bias_k`` / ``add_zero_attn`` are refused by name.
docs/attention.md.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._cross_attention import _refuse as refuse
from ._cross_attention import cross_sdpa, split_keys
from ._cross_mha import cross_mha, in_heads, unsupported_mha
from ._dims import wrap
from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._mode import register_handler
from ._ring import ring_attention
from ._ring_mask import RingMask, mha_bias, sdpa_bias
from ._sharding import grad_groups
from ._token_layout import held_indices
from ._token_ring import Seq, partial_local, token_ring
from ._tokens import split_layouts

log = logging.getLogger("spconv_train.parallel")


def _refuse(what: str, why: str) -> SpatialShardingError:
    return refuse(what, why, "on a sharded token sequence")


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


def _kv_mode(q: DTensor, k, v, seq: Seq, what: str) -> tuple[str, Seq]:
    """``("ring", layouts of k's sequence)``: k, v split over the same mesh dims as q's
    sequence (their own token counts: e.g. keys from a strided conv of the map, as in
    spatial-reduction attention); ``("local", seq)``: k, v whole on those ranks, split
    like q elsewhere (the batch)."""
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
            return "ring", kseq
        if rest == others and not kseq:
            return "local", seq
    raise _refuse(
        what,
        f"keys / values split as {k.placements}, {v.placements} unlike the queries {q.placements}",
    )


def _attend(
    ql: Tensor,
    kl: Tensor,
    vl: Tensor,
    mode: str,
    kseq: Seq,
    q: DTensor,
    scale: float | None,
    bias: Tensor | None = None,
    causal: Seq = (),
    kbias: Tensor | None = None,
) -> Tensor:
    """Attention of local queries ``(..., L_r, E)`` to all keys (ring or local); ``bias``:
    the rank's rows of an additive mask; ``causal``: the queries' sequence layouts when
    ``is_causal`` (a key after the query by global token index is masked); ``kbias``: an
    additive mask of the rank's keys (ring only), which travels with them."""
    rows = held_indices(causal).to(ql.device) if causal else None
    masked = bias is not None or rows is not None or kbias is not None
    if mode == "local":  # every key here, in global order: a ring of one rank
        group, sizes, cols = None, (kl.shape[-2],), (torch.arange(kl.shape[-2], device=ql.device),)
    else:
        ring = token_ring(q.device_mesh, kseq)
        group, sizes, cols = ring.group, ring.sizes(), ring.columns(ql.device)
    mask = RingMask(cols, rows, ql.dtype) if masked else None
    return ring_attention(ql, kl, vl, group, sizes, scale, bias=bias, mask=mask, kbias=kbias)


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
    mode, kseq = _kv_mode(query, key, value, seq, what)
    if mode == "ring":
        kl, vl = key.to_local(), value.to_local()
    else:
        kl, vl = partial_local(key, seq), partial_local(value, seq)
    bias = sdpa_bias(attn_mask, query, what)
    causal = seq if is_causal else ()
    out = _attend(query.to_local(), kl, vl, mode, kseq, query, scale, bias, causal)
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
    if kseq is not None:  # whole queries (keys split, or whole too): _cross_mha.py
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
    mode, kseq = _kv_mode(q, k, v, seq, what)
    groups = grad_groups(q)
    heads, e = kw["num_heads"], q.shape[-1]
    kv = [k.to_local(), v.to_local()] if mode == "ring" else [partial_local(t, seq) for t in (k, v)]
    # every weight gradient is a partial sum: each rank's queries (and, on the ring, keys)
    qh, kh, vh = in_heads(kw, (q.to_local(), *kv), groups)
    # is_causal is a hint that attn_mask is causal: the mask alone gives the same result
    bias, kbias = mha_bias(kw["attn_mask"], kw["key_padding_mask"], q, k, heads, what)
    out = _attend(qh, kh, vh, mode, kseq, q, 1.0 / math.sqrt(e // heads), bias, (), kbias)
    out = out.permute(2, 0, 1, 3).flatten(2)  # (L_r, N, E)
    out = F.linear(
        out,
        sum_grad_over(kw["out_proj_weight"], groups),
        sum_grad_over(kw["out_proj_bias"], groups),
    )
    if kw["need_weights"]:
        log.debug("nn.MultiheadAttention in '%s': attention weights not formed", module_path())
    return wrap(out, q, q.placements, q.shape), None
