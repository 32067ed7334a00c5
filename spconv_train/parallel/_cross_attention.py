"""Cross attention of whole queries to sharded keys (DETR, Mask2Former, SAM's
token-to-image attention) through ``F.scaled_dot_product_attention``.

Every rank attends all the queries to its own keys; a row maximum (all-reduce max) and one
query-sized sum of ``exp(s - m) @ v`` and ``sum exp(s - m)`` combine the parts exactly, no
key or value moving; the backward is autograd through the same terms. A query that sees no
key at all gives what torch gives on one device (SDPA: zeros; ``nn.MultiheadAttention``
with ``need_weights``: NaN). docs/attention.md, "Learned queries attending to sharded
keys".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ._dims import wrap
from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._prefix_shard import placement
from ._reduce import _global_extreme
from ._ring_mask import batch_rows, select_rows
from ._sharding import grad_groups
from ._small_sum import sum_replicated
from ._token_layout import held_indices
from ._token_ring import Seq, partial_local, token_ring
from ._tokens import is_dp, split_layouts


def _refuse(
    what: str, why: str, where: str = "with whole queries and keys split over the spatial ranks"
) -> SpatialShardingError:
    """The error of an attention op ``what`` that does not take ``why`` ``where``."""
    return SpatialShardingError(
        f"{what} in module '{module_path()}' {where}: {why} is not supported. Drop it, or "
        f"gather explicitly (x.full_tensor())."
    )


def split_keys(q, k, seq_dim: int) -> Seq | None:
    """The layouts splitting ``k``'s sequence dim ``seq_dim`` over spatial mesh dims when
    the queries' sequence is whole (the cross route; empty: neither is split), ``None``
    when the queries' sequence is split (the ring) or ``k`` is no DTensor."""
    if not isinstance(k, DTensor):
        return None
    if isinstance(q, DTensor) and any(
        lay.dim == seq_dim % q.ndim and not is_dp(q, lay.mesh_dim) for lay in split_layouts(q)
    ):
        return None
    seq_dim %= k.ndim
    return tuple(
        lay for lay in split_layouts(k) if lay.dim == seq_dim and not is_dp(k, lay.mesh_dim)
    )


def out_placements(k: DTensor, kseq: Seq) -> tuple:
    """The output's placements: whole over the spatial mesh dims, split like ``k`` (its
    batch) elsewhere."""
    dims = {lay.mesh_dim for lay in kseq}
    return tuple(Replicate() if i in dims else p for i, p in enumerate(k.placements))


def local_query(q, k: DTensor, kseq: Seq, batch_dim: int, what: str) -> Tensor:
    """The queries every rank attends to its keys: a DTensor's local tensor (it must be
    whole on the spatial ranks and split like ``k`` elsewhere) or a plain tensor's batch
    of this rank, with a partial gradient per rank."""
    if isinstance(q, DTensor):
        if tuple(q.placements) != out_placements(k, kseq):
            raise _refuse(
                what, f"queries split as {q.placements} next to keys split as {k.placements}"
            )
        return partial_local(q, kseq)
    return batch_rows(sum_grad_over(q, grad_groups(k)), k, kseq, batch_dim, 1)


def local_mask(mask, k: DTensor, kseq: Seq, rows: int | None, what: str) -> Tensor | None:
    """The columns of ``mask`` (``(..., Q, L)``) that meet this rank's keys, and its batch
    (``rows`` entries of dim 0 per sample; ``None``: no batch dim). A DTensor split like
    the keys along its last dim gives its local tensor; a whole one (plain or replicated)
    is indexed with the rank's token indices, its gradient summed over the ranks."""
    if mask is None:
        return None
    if not isinstance(mask, DTensor):
        part = select_rows(mask, {-1: kseq}, grad_groups(k))  # the columns of this rank's keys
        return part if rows is None else batch_rows(part, k, kseq, 0, rows)
    last = mask.ndim - 1
    lays = split_layouts(mask)
    on_last = tuple(lay for lay in lays if lay.dim == last)
    dims = sorted(lay.mesh_dim for lay in kseq)
    bad = any(p.is_partial() for p in mask.placements) or any(
        lay.dim != 0 or rows is None or lay.mesh_dim in dims for lay in lays if lay.dim != last
    )
    if on_last:
        bad = bad or sorted(lay.mesh_dim for lay in on_last) != dims
        bad = bad or not torch.equal(held_indices(on_last), held_indices(kseq))
    if bad:
        raise _refuse(
            what,
            f"a mask {tuple(mask.shape)} split as {mask.placements} unlike the keys "
            f"{k.placements} (split its last dim like the keys, or pass it whole)",
        )
    if on_last:
        return mask.to_local()
    return select_rows(partial_local(mask, kseq), {-1: kseq}, ())


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, kseq_group, empty_nan
) -> Tensor:
    """``softmax(q k^T * scale + mask) v`` of whole queries over the keys of every rank of
    ``kseq_group`` (each holds its own ``k``, ``v``, ``mask`` columns), differentiable.
    A bool ``mask`` is True where a query may attend (SDPA's meaning), a float one is
    added. A query that sees no key at all gives NaN with ``empty_nan``, else zeros."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    # the row maximum over every rank's keys (-inf where a query sees no key; 0 then:
    # every term is 0): the shift cancels in num / den, so it needs no gradient
    m = _global_extreme(s, (-1,), (kseq_group,), "max")
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    part = torch.cat([p @ v, p.sum(-1, keepdim=True)], -1)
    total = sum_replicated(part, (kseq_group,))
    num, den = total[..., :-1], total[..., -1:]
    if not empty_nan:  # zeros where no key is seen, as torch's SDPA gives
        den = torch.where(den > 0, den, 1.0)
    return num / den


def cross_sdpa(kseq: Seq, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``F.scaled_dot_product_attention`` with whole queries ``(..., Q, E)`` and the keys /
    values' sequence (dim -2) split over the spatial ranks (``kseq``: ``split_keys``'s
    layouts): whole output on every rank."""
    what = "F.scaled_dot_product_attention"
    for bad, why in (
        (is_causal, "is_causal=True"),
        (dropout_p > 0, f"attention dropout (dropout_p={dropout_p})"),
        (enable_gqa, "enable_gqa=True"),
        (not isinstance(value, DTensor) or value.placements != key.placements, "values split"),
        (query.shape[:-2] != key.shape[:-2], f"queries {tuple(query.shape)} for keys"),
    ):
        if bad:
            raise _refuse(what, f"{why} {tuple(key.shape)} {key.placements}")
    ql = local_query(query, key, kseq, 0, what)
    rows = 1 if attn_mask is not None and attn_mask.ndim == key.ndim else None
    mask = local_mask(attn_mask, key, kseq, rows, what)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    group = token_ring(key.device_mesh, kseq).group
    out = attend(ql, key.to_local(), value.to_local(), mask, scale, group, False)
    return wrap(out, key, out_placements(key, kseq), (*query.shape[:-1], value.shape[-1]))


def einsum_terms(equation: str) -> tuple[str, str, str] | None:
    """``(a, b, out)``: the index strings of a two-operand ``torch.einsum`` equation with an
    explicit output, no ellipsis and no index twice in a term; ``None`` for any other."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        return None
    (sa, sb), out = eq.split("->")[0].split(","), eq.split("->")[1]
    return None if any(len(set(s)) != len(s) for s in (sa, sb, out)) else (sa, sb, out)


def whole_operand_einsum(terms: tuple[str, str, str], a, b) -> DTensor | None:
    """``torch.einsum`` (``einsum_terms``) of two DTensors where one is whole on every mesh
    dim that splits the other along an index kept in the output and absent from it
    (Mask2Former's mask prediction ``"bqc,bchw->bqhw"``: whole queries times the sharded
    map): local, the output split like that operand, the whole one's gradient a partial sum
    per rank. ``None`` for any other product (both split alike, e.g. a ``dp`` batch, is
    local too)."""
    sa, sb, out = terms
    if (len(sa), len(sb)) != (a.ndim, b.ndim):
        return None
    if a.device_mesh != b.device_mesh or any(
        p.is_partial() for p in (*a.placements, *b.placements)
    ):
        return None
    la, lb = ({m.mesh_dim: m for m in split_layouts(t)} for t in (a, b))
    placements, partial = list(a.placements), [[], []]
    for i in range(a.device_mesh.ndim):
        x, y = la.get(i), lb.get(i)
        lay, side, names = (x, 0, sa) if x is not None else (y, 1, sb)
        if lay is None:
            continue
        ch = names[lay.dim]
        if x is not None and y is not None:  # split alike on both (a batch index)
            if sb.find(ch) != y.dim or (x.split_factor, x.inner) != (y.split_factor, y.inner):
                return None
        elif ch in (sb if side == 0 else sa):
            return None  # contracted or shared with the whole operand: not local
        if ch not in out:
            return None
        placements[i] = placement(out.index(ch), lay.split_factor, lay.prefix)
        if x is None or y is None:
            partial[1 - side].append(lay)  # the whole operand meets this rank's part
    ops = [
        partial_local(t, tuple(p)) if p else t.to_local()
        for t, p in zip((a, b), partial, strict=True)
    ]
    sizes: dict[str, int] = {}
    for names, t in ((sa, a), (sb, b)):
        for ch, n in zip(names, t.shape, strict=True):
            sizes[ch] = max(sizes.get(ch, 1), n)  # a size-1 dim broadcasts
    shape = tuple(sizes[ch] for ch in out)
    return wrap(torch.einsum(f"{sa},{sb}->{out}", *ops), a, placements, shape)
