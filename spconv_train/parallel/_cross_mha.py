"""``nn.MultiheadAttention`` (``F.multi_head_attention_forward``, sequence-first) with
whole queries: cross attention to keys / values whose sequence is split over the spatial
ranks (the route of ``_cross_attention.py``: projections local, the partial outputs summed
over the ranks), and attention among whole queries (torch's own on the local tensors).
Masks (``attn_mask`` ``(Q, L)`` or ``(N * heads, Q, L)``, ``key_padding_mask`` ``(N, L)``,
bool or float) are cut to the rank's keys and batch (``local_mask``)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from ._cross_attention import Seq, _refuse, attend, local_mask, local_query, out_placements
from ._dims import wrap
from ._halo import sum_grad_over
from ._ring_mask import mha_mask
from ._sharding import grad_groups
from ._token_ring import token_ring
from ._tokens import split_layouts


def unsupported_mha(kw: dict, causal_with_mask: bool) -> str | None:
    """What the spatial routes of ``F.multi_head_attention_forward`` (arguments ``kw``) do
    not take, or None; ``causal_with_mask``: ``is_causal`` is taken next to an
    ``attn_mask`` (the ring's route: the mask alone gives the result; torch refuses it
    without one), else refused (the cross route)."""
    for name, why in (
        ("bias_k", "bias_k / bias_v (add_bias_kv=True)"),
        ("add_zero_attn", "add_zero_attn=True"),
        ("static_k", "static_k / static_v"),
    ):
        if kw.get(name) is not None and kw.get(name) is not False:
            return why
    if kw["is_causal"] and not causal_with_mask:
        return "is_causal=True"
    if kw["is_causal"] and kw["attn_mask"] is None:
        return "is_causal=True without an attn_mask"
    if kw["training"] and kw["dropout_p"] > 0:  # replicas would draw different masks
        return f"attention dropout (dropout={kw['dropout_p']}) in training"
    return None


def _whole_mha(kw: dict, what: str):
    """``F.multi_head_attention_forward`` with no sequence split (self-attention among
    whole queries): torch's own on the local tensors, every parameter's gradient summed
    over the batch split alone (the same on every spatial rank)."""
    q, k, v = kw["query"], kw["key"], kw["value"]
    groups, args = grad_groups(q), dict(kw)
    same = all(isinstance(t, DTensor) and t.placements == q.placements for t in (k, v))
    if not same or q.ndim != 3 or any(lay.dim != 1 for lay in split_layouts(q)):
        raise _refuse(what, f"queries, keys, values split as {[t.placements for t in (q, k, v)]}")
    for name, t in kw.items():
        if name.endswith("mask") and t is not None and (groups or isinstance(t, DTensor)):
            raise _refuse(what, f"{name} with queries split as {q.placements}")
        if isinstance(t, Tensor) and name not in ("query", "key", "value"):
            args[name] = sum_grad_over(t, groups)
    out, weights = F.multi_head_attention_forward(
        **{**args, "query": q.to_local(), "key": k.to_local(), "value": v.to_local()}
    )
    if weights is not None:  # (N, [heads,] Q, S): the batch first
        batch = tuple(Shard(0) if p == Shard(1) else p for p in q.placements)
        weights = wrap(weights, q, batch, (q.shape[1], *weights.shape[1:]))
    return wrap(out, q, q.placements, q.shape), weights


def project_attend(kw: dict, xs: tuple, groups: tuple, out_groups: tuple, attend) -> Tensor:
    """The sequence-first local queries, keys and values ``xs`` (``(L, N, E)``) through
    ``nn.MultiheadAttention``'s input projections (arguments ``kw``, gradients summed over
    ``groups``), split into heads ``(N, heads, L, E / heads)``, ``attend(qh, kh, vh,
    scale)``, and the output projection (gradients summed over ``out_groups``)."""
    heads = kw["num_heads"]
    if kw["use_separate_proj_weight"]:
        ws = [sum_grad_over(kw[f"{n}_proj_weight"], groups) for n in "qkv"]
    else:
        ws = list(sum_grad_over(kw["in_proj_weight"], groups).chunk(3))
    bias = sum_grad_over(kw["in_proj_bias"], groups)
    bs = list(bias.chunk(3)) if bias is not None else [None] * 3
    qh, kh, vh = (
        F.linear(x, w, b).reshape(*x.shape[:2], heads, -1).permute(1, 2, 0, 3)
        for x, w, b in zip(xs, ws, bs, strict=True)
    )
    out = attend(qh, kh, vh, 1.0 / math.sqrt(xs[0].shape[-1] // heads))
    w, b = (sum_grad_over(kw[f"out_proj_{n}"], out_groups) for n in ("weight", "bias"))
    return F.linear(out.permute(2, 0, 1, 3).flatten(2), w, b)  # (L, N, E)


def cross_mha(kw: dict, kseq: Seq, what: str = "nn.MultiheadAttention"):
    """``F.multi_head_attention_forward`` (sequence-first ``(Q, N, E)`` whole queries,
    ``(L, N, E)`` keys / values with ``L`` split): projections local, the attention of
    ``attend``, the output whole on every spatial rank. The q / k / v projections' weight
    gradients are partial sums per rank, the output projection's is whole. The averaged
    attention weights (``Q x L``) are not formed: the second output is ``None``."""
    why = unsupported_mha(kw, causal_with_mask=False)
    if why:
        raise _refuse(what, why)
    if not kseq:
        return _whole_mha(kw, what)
    q, k, v = kw["query"], kw["key"], kw["value"]
    if not isinstance(v, DTensor) or v.placements != k.placements or q.ndim != 3:
        raise _refuse(what, f"queries {tuple(q.shape)}, values split unlike the keys")
    xs = (local_query(q, k, kseq, 1, what), k.to_local(), v.to_local())
    group = token_ring(k.device_mesh, kseq).group

    def attend_heads(qh: Tensor, kh: Tensor, vh: Tensor, scale: float) -> Tensor:
        masks, heads = (kw["attn_mask"], kw["key_padding_mask"]), kw["num_heads"]
        mask = mha_mask(
            *masks, heads, qh.dtype, lambda m, _, per: local_mask(m, k, kseq, per, what)
        )
        return attend(qh, kh, vh, mask, scale, group, kw["need_weights"])

    # the input side: every rank's share of the keys; the output side: the batch alone
    out = project_attend(kw, xs, grad_groups(k), grad_groups(k, kseq), attend_heads)
    return wrap(out, k, out_placements(k, kseq), q.shape), None
