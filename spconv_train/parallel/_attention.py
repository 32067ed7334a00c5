"""SDPA and ``nn.MultiheadAttention`` over sharded tokens: split queries by the ring
(``_ring.py``); whole queries (DETR, Mask2Former, SAM) to sharded keys where they lie, the
ranks' parts combined by one row maximum and one query-sized sum (``attend``)."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._dims import wrap
from ._errors import module_path
from ._halo import sum_grad_over
from ._mode import register_handler
from ._reduce import _global_extreme
from ._ring import ring_attention
from ._ring_mask import (
    RingMask,
    batch_rows,
    mha_bias,
    mha_mask,
    refuse,
    sdpa_bias,
    select_rows,
    summed,
)
from ._sharding import grad_groups
from ._small_sum import sum_replicated
from ._token_layout import dim_layouts, held_indices
from ._token_ring import Seq, partial_local, token_ring
from ._tokens import is_dp, split_layouts


def split_keys(q, k, seq_dim: int) -> Seq | None:
    """``k``'s spatial layouts of dim ``seq_dim`` where the queries' is whole (the cross
    route; empty: neither split); ``None``: the queries' is split (the ring), or plain ``k``."""

    def on_seq(x: DTensor) -> Seq:
        d = seq_dim % x.ndim
        return tuple(m for m in split_layouts(x) if m.dim == d and not is_dp(x, m.mesh_dim))

    if not isinstance(k, DTensor) or (isinstance(q, DTensor) and on_seq(q)):
        return None
    return on_seq(k)


def out_placements(k: DTensor, kseq: Seq) -> tuple:
    """The output's placements: whole over ``kseq``'s mesh dims, like ``k`` elsewhere."""
    dims = {lay.mesh_dim for lay in kseq}
    return tuple(Replicate() if i in dims else p for i, p in enumerate(k.placements))


def local_query(q, k: DTensor, kseq: Seq, batch_dim: int, what: str) -> Tensor:
    """The whole queries (placed as the output, or plain), their gradient a partial sum."""
    if isinstance(q, DTensor):
        if tuple(q.placements) != out_placements(k, kseq):
            why = f"queries split as {q.placements} next to keys split as {k.placements}"
            raise refuse(what, why)
        return partial_local(q, kseq)
    return batch_rows(sum_grad_over(q, grad_groups(k)), k, kseq, batch_dim, 1)


def local_mask(mask, k: DTensor, kseq: Seq, rows: int | None, what: str) -> Tensor | None:
    """The columns of ``mask`` ``(..., Q, L)`` split like the keys, or picked from a whole
    one, and its batch (``rows`` entries of dim 0 per sample; ``None``: no batch dim)."""
    if mask is None:
        return None
    if not isinstance(mask, DTensor):
        part = select_rows(mask, -1, kseq, grad_groups(k))  # the columns of this rank's keys
        return part if rows is None else batch_rows(part, k, kseq, 0, rows)
    lays, dims, last = split_layouts(mask), sorted(lay.mesh_dim for lay in kseq), mask.ndim - 1
    on_last = dim_layouts(lays, last)  # split like the keys, or whole
    bad = any(p.is_partial() for p in mask.placements) or any(
        lay.dim != 0 or rows is None or lay.mesh_dim in dims for lay in lays if lay.dim != last
    )
    if on_last and not bad:
        alike = sorted(lay.mesh_dim for lay in on_last) == dims
        bad = not (alike and torch.equal(held_indices(on_last), held_indices(kseq)))
    if bad:
        fix = "split its last dim like the keys, or pass it whole"
        split = f"a mask {tuple(mask.shape)} split as {mask.placements}"
        raise refuse(what, f"{split} unlike the keys {k.placements} ({fix})")
    return mask.to_local() if on_last else select_rows(partial_local(mask, kseq), -1, kseq, ())


def attend(q: Tensor, k: Tensor, v: Tensor, mask, scale: float, group, empty_nan: bool) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` of whole queries over every rank's keys in
    ``group`` (a bool ``mask`` True attends), by autograd; a query that sees no key gives
    NaN with ``empty_nan`` (``nn.MultiheadAttention`` with ``need_weights``), else 0 (SDPA)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    # the row maximum (-inf: no key seen, 0 then) cancels in num / den: no gradient
    m = _global_extreme(s, (-1,), (group,), "max")
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    total = sum_replicated(torch.cat([p @ v, p.sum(-1, keepdim=True)], -1), (group,))
    num, den = total[..., :-1], total[..., -1:]
    if not empty_nan:
        den = torch.where(den > 0, den, 1.0)
    return num / den


def _whole_mha(kw: dict, what: str):
    """MHA among whole queries: torch's own on the local tensors (gradients over the batch)."""
    q, k, v = kw["query"], kw["key"], kw["value"]
    groups, args = grad_groups(q), dict(kw)
    same = all(isinstance(t, DTensor) and t.placements == q.placements for t in (k, v))
    if not same or q.ndim != 3 or any(lay.dim != 1 for lay in split_layouts(q)):
        raise refuse(what, f"queries, keys, values split as {[t.placements for t in (q, k, v)]}")
    for name, t in kw.items():
        if name.endswith("mask") and t is not None and (groups or isinstance(t, DTensor)):
            raise refuse(what, f"{name} with queries split as {q.placements}")
        if isinstance(t, Tensor) and name not in ("query", "key", "value"):
            args[name] = sum_grad_over(t, groups)
    args.update(query=q.to_local(), key=k.to_local(), value=v.to_local())
    out, weights = F.multi_head_attention_forward(**args)
    if weights is not None:  # (N, [heads,] Q, S): the batch first
        batch = tuple(Shard(0) if p == Shard(1) else p for p in q.placements)
        weights = wrap(weights, q, batch, (q.shape[1], *weights.shape[1:]))
    return wrap(out, q, q.placements, q.shape), weights


def project_attend(kw: dict, xs: tuple, groups: tuple, out_groups: tuple, attend) -> Tensor:
    """MHA's input projections of the local ``(L, N, E)`` ``xs`` into heads (gradients over
    ``groups``), ``attend(qh, kh, vh, scale)``, the output projection (over ``out_groups``)."""
    heads = kw["num_heads"]
    if kw["use_separate_proj_weight"]:
        ws = [sum_grad_over(kw[f"{n}_proj_weight"], groups) for n in "qkv"]
    else:
        ws = list(sum_grad_over(kw["in_proj_weight"], groups).chunk(3))
    bias = sum_grad_over(kw["in_proj_bias"], groups)
    bs = list(bias.chunk(3)) if bias is not None else [None] * 3
    qh, kh, vh = (
        F.linear(x, w, b).unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
        for x, w, b in zip(xs, ws, bs, strict=True)
    )
    out = attend(qh, kh, vh, 1.0 / math.sqrt(xs[0].shape[-1] // heads))
    w, b = (sum_grad_over(kw[f"out_proj_{n}"], out_groups) for n in ("weight", "bias"))
    return F.linear(out.permute(2, 0, 1, 3).flatten(2), w, b)  # (L, N, E)


log = logging.getLogger("spconv_train.parallel")

_ring_refuse = functools.partial(refuse, where=" on a sharded token sequence")


def _sequence_layout(q: DTensor, seq_dim: int, batch_dim: int, what: str) -> Seq:
    """The layouts splitting ``q``'s ``seq_dim``; refuses any other but a plain batch split."""
    lays = split_layouts(q)
    for lay in lays:
        if lay.dim != seq_dim and (lay.dim != batch_dim or lay.split_factor != 1):
            raise _ring_refuse(what, f"a split of dim {lay.dim} ({q.placements})")
    return dim_layouts(lays, seq_dim)


def _keys(q: DTensor, k, v, seq: Seq, what: str) -> tuple[Tensor, Tensor, Callable]:
    """``(k, v, attend)``, local: split like ``q``'s sequence (with their own counts) they go
    around the ring; whole there, a ring of one rank, their gradient a partial sum."""
    if not (isinstance(k, DTensor) and isinstance(v, DTensor)):
        raise _ring_refuse(what, "plain-tensor keys / values next to sharded queries")
    k, v = summed(k), summed(v)
    dims, lays = {m.mesh_dim for m in seq}, split_layouts(k)
    kseq = tuple(m for m in lays if m.mesh_dim in dims)
    rest = [(m.mesh_dim, m.dim) for m in lays if m.mesh_dim not in dims]
    others = [(m.mesh_dim, m.dim) for m in split_layouts(q) if m.mesh_dim not in dims]
    ring = {m.mesh_dim for m in kseq} == dims and all(m.dim == seq[0].dim for m in kseq)
    if k.placements != v.placements or rest != others or not (ring or not kseq):
        split = f"{k.placements}, {v.placements} unlike the queries {q.placements}"
        raise _ring_refuse(what, f"keys / values split as {split}")
    if ring:
        kl, vl = k.to_local(), v.to_local()
        group, sizes, cols = token_ring(q.device_mesh, kseq).spec(q.device)
    else:  # every key here, in global order
        n = k.shape[seq[0].dim - q.ndim]  # (k's own batch dims may broadcast)
        kl, vl, group, sizes = partial_local(k, seq), partial_local(v, seq), None, (n,)
        cols = (torch.arange(n, device=q.device),)

    def attend(ql, kl, vl, scale, bias=None, causal=False, kbias=None) -> Tensor:
        """Local queries ``(..., L_r, E)`` attending; ``bias``: the rank's rows of an
        additive mask, ``kbias``: the keys' own, travelling."""
        rows = held_indices(seq).to(ql.device) if causal else None
        masked = bias is not None or causal or kbias is not None
        mask = RingMask(cols, rows, ql.dtype) if masked else None
        return ring_attention(ql, kl, vl, group, sizes, scale, bias=bias, mask=mask, kbias=kbias)

    return kl, vl, attend


@register_handler(F.scaled_dot_product_attention)  # torch._C._nn's is the same object
def spatial_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention``, the sequence (dim -2) split: the ring; whole
    queries to keys split along dim -2 (``kseq``): the cross route, whole output."""
    what = "F.scaled_dot_product_attention"
    kseq = split_keys(query, key, -2)
    if not kseq and not isinstance(query, DTensor):
        raise _ring_refuse(what, "plain-tensor queries next to sharded keys / values")
    tail = f" {tuple(key.shape)} {key.placements}" if kseq else ""  # (whole queries)
    vsplit = not isinstance(value, DTensor) or value.placements != key.placements
    for bad, why in (
        (is_causal and kseq, "is_causal=True"),
        (attn_mask is not None and is_causal and not kseq, "an attention mask with is_causal=True"),
        (dropout_p > 0, f"attention dropout (dropout_p={dropout_p})"),
        (enable_gqa, "enable_gqa=True"),
        (kseq and vsplit, "values split"),
        (kseq and query.shape[:-2] != key.shape[:-2], f"queries {tuple(query.shape)} for keys"),
    ):
        if bad:
            raise (refuse if kseq else _ring_refuse)(what, why + tail)
    if kseq:
        ql = local_query(query, key, kseq, 0, what)
        rows = 1 if attn_mask is not None and attn_mask.ndim == key.ndim else None
        mask = local_mask(attn_mask, key, kseq, rows, what)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        group = token_ring(key.device_mesh, kseq).group
        out = attend(ql, key.to_local(), value.to_local(), mask, scale, group, False)
        return wrap(out, key, out_placements(key, kseq), (*query.shape[:-1], value.shape[-1]))
    seq = _sequence_layout(query, query.ndim - 2, 0, what)
    if not seq:
        if attn_mask is not None or is_causal:
            raise _ring_refuse(what, "an attention mask on queries whose sequence is whole")
        return F.scaled_dot_product_attention(query, key, value, scale=scale)  # DTensor's
    kl, vl, attend_ring = _keys(query, key, value, seq, what)
    bias = sdpa_bias(attn_mask, query, what)
    out = attend_ring(query.to_local(), kl, vl, scale, bias, is_causal)
    return wrap(out, query, query.placements, (*query.shape[:-1], value.shape[-1]))


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@register_handler(F.multi_head_attention_forward)
def spatial_multi_head_attention(*args, **kwargs):
    """MHA's functional form, ``(L, N, E)``: ``L`` split, the ring; whole queries to split
    keys, the cross route. The attention weights are not formed (``None``)."""
    what = "nn.MultiheadAttention"
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = bound.arguments
    q, k, v = kw["query"], kw["key"], kw["value"]
    kseq = split_keys(q, k, 0)
    cross = kseq is not None  # whole queries (keys split, or whole too)
    if not kseq and not isinstance(q, DTensor):
        raise _ring_refuse(what, "plain-tensor queries next to sharded keys / values")
    dropout = f"attention dropout (dropout={kw['dropout_p']}) in training"
    for bad, why in (
        (kw["bias_k"] is not None, "bias_k / bias_v (add_bias_kv=True)"),
        (kw["add_zero_attn"], "add_zero_attn=True"),
        (kw["static_k"] is not None, "static_k / static_v"),
        # the ring takes is_causal next to attn_mask (a hint that it is causal) as torch does
        (kw["is_causal"] and cross, "is_causal=True"),
        (kw["is_causal"] and kw["attn_mask"] is None, "is_causal=True without an attn_mask"),
        (kw["training"] and kw["dropout_p"] > 0, dropout),  # replicas would draw other masks
    ):
        if bad:
            raise (refuse if cross else _ring_refuse)(what, why)
    if cross and not kseq:
        return _whole_mha(kw, what)
    if cross:
        if not isinstance(v, DTensor) or v.placements != k.placements or q.ndim != 3:
            raise refuse(what, f"queries {tuple(q.shape)}, values split unlike the keys")
        xs = (local_query(q, k, kseq, 1, what), k.to_local(), v.to_local())
        group = token_ring(k.device_mesh, kseq).group

        def attend_heads(qh: Tensor, kh: Tensor, vh: Tensor, scale: float) -> Tensor:
            mask = mha_mask(kw, qh.dtype, lambda m, _, per: local_mask(m, k, kseq, per, what))
            return attend(qh, kh, vh, mask, scale, group, kw["need_weights"])

        # the input side: every rank's share of the keys; the output side: the batch alone
        out = project_attend(kw, xs, grad_groups(k), grad_groups(k, kseq), attend_heads)
        return wrap(out, k, out_placements(k, kseq), q.shape), None
    seq = _sequence_layout(q, 0, 1, what)
    if not seq or q.ndim != 3:
        queries = f"queries {tuple(q.shape)} {q.placements}"
        raise _ring_refuse(what, f"{queries} without a split sequence (dim 0 of (L, N, E))")
    kl, vl, attend_ring = _keys(q, k, v, seq, what)
    # as torch: is_causal alone (attn_mask dropped) without a key_padding_mask or weights
    hint = kw["is_causal"] and kw["key_padding_mask"] is None and not kw["need_weights"]
    bias, kbias = mha_bias({**kw, "attn_mask": None} if hint else kw, q, k, seq, what)
    groups = grad_groups(q)  # every weight gradient is a partial sum: each rank's queries
    attend_ring = functools.partial(attend_ring, bias=bias, causal=hint, kbias=kbias)
    out = project_attend(kw, (q.to_local(), kl, vl), groups, groups, attend_ring)
    if kw["need_weights"]:
        log.debug("nn.MultiheadAttention in '%s': attention weights not formed", module_path())
    return wrap(out, q, q.placements, q.shape), None
