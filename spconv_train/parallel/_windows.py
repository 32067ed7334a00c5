"""Window partition and reverse of a sharded map (Swin): a reshape cutting a split dim at
window boundaries (``_moves``) re-chunks it to window-aligned owners (the reverse back), the
batch of windows a token layout; per-window matmuls and SDPA run locally. docs/attention.md."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from . import _attention, _tokens  # noqa: F401  (their handlers are wrapped below)
from ._dims import is_dp, mesh_group, result_shape, wrap
from ._geometry import ExchangePlan, all_shard_bounds, shard_bounds
from ._halo import gather_columns
from ._prefix_shard import placement
from ._ring_mask import sdpa_bias
from ._runtime import function_name
from ._token_layout import TokenLayout, split_layouts
from ._tokens import MATMULS, _target, chain, chain_each, fits, local_reshape


def _runs(shape: tuple[int, ...], out: tuple[int, ...], d: int, past_units: bool):
    """The smallest run of input dims ``[d0, d1)`` holding ``d`` that a reshape to ``out``
    turns into whole output dims ``[e0, e1)``; ``past_units``: past size-1 dims after ``d``.
    ``None`` for empty tensors."""
    pin, pout = (list(accumulate(s, mul, initial=1)) for s in (shape, out))
    if 0 in shape or pin[-1] != pout[-1]:
        return None
    d0 = max(i for i in range(d + 1) if pin[i] in pout)
    later = [i for i in range(d + 1, len(shape) + 1) if pin[i] in pout]
    if past_units:
        later = [i for i in later if pin[i] > pin[d]] or later
    d1 = min(later)
    e0 = min(j for j, p in enumerate(pout) if p == pin[d0])
    # size-1 output dims at the start of the run go first to the size-1 input dims right
    # before ``d0`` (a batch of one: (1, L, C) -> (1, L, 2, heads, e) keeps its 1 in front)
    units_in = sum(1 for i in range(d0) if pin[i] == pin[d0])
    units_out = sum(1 for j in range(e0 + 1, len(pout)) if pout[j] == pin[d0])
    e0 += min(units_in, units_out)
    e1 = min(j for j, p in enumerate(pout) if p == pin[d1])
    return d0, d1, e0, e1


@dataclass(frozen=True)
class Move:
    """How a reshape moves the split of input dim ``lay.dim``: factorised (``split``) into
    output dims from ``dim`` on, ``k`` elements per window, or merged with the ``k`` entries
    of the dims after it into output dim ``dim``; ``outer``: the split factor."""

    lay: TokenLayout
    split: bool
    dim: int
    k: int
    outer: int = 1


#: Single windows (a split dim of size 1, on the first rank) shapes cannot place: ``("cut",
#: shape, dim) -> 1``: a merge of that dim is the window reverse; ``("batch", shape, mesh
#: dim) -> dim``: the split dim merged into the batch of windows, put back by the reverse.
SINGLE_WINDOWS: dict[tuple, int] = {}


def remember_single(key: tuple, value: int) -> None:
    """Record ``key`` in ``SINGLE_WINDOWS`` (cleared past 1024 entries)."""
    if len(SINGLE_WINDOWS) > 1024:
        SINGLE_WINDOWS.clear()
    SINGLE_WINDOWS[key] = value


def _split(lay: TokenLayout, shape: tuple, out: tuple) -> Move | None:
    """A split dim cut into output dims ``[e0, e1)``: the split factor into whole dims in
    front, the chunked run into ``(windows, ...)``, the windows split."""
    runs = _runs(shape, out, lay.dim, False)
    if runs is None or runs[1] - runs[0] != 1:
        return None
    _, _, e0, e1 = runs
    cuts = [e for e in range(e0, e1 + 1) if math.prod(out[e0:e]) == lay.split_factor]
    big = [j for j in range(cuts[-1], e1) if out[j] > 1] if cuts else []
    if len(big) >= 2:  # (windows, ws): the split goes to the windows factor
        return Move(lay, True, big[0], math.prod(out[big[0] + 1 : e1]), lay.split_factor)
    if lay.split_factor != 1:
        return None
    # (1, W) of a map dim: one window along it when the reshape cuts two dims into windows
    # (H and W); a size-1 dim added next to it, or three or more dims (docs/attention.md: a
    # thin volume's patches, a Swin stage one row deep) keep the dim split
    one = big == [e1 - 1] and e1 - e0 == 2 and lay.dim > 0
    if one and len(out) >= len(shape) + 2:
        remember_single(("cut", tuple(out), e1 - 2), 1)
        return Move(lay, True, e1 - 2, out[e1 - 1])
    return None


def _merge(lay: TokenLayout, shape: tuple, out: tuple, split_dims) -> Move | None:
    single = shape[lay.dim] == 1
    if single and ("cut", tuple(shape), lay.dim) not in SINGLE_WINDOWS:
        return None
    runs = _runs(shape, out, lay.dim, single)
    if runs is None:
        return None
    d0, d1, e0, e1 = runs
    big = [j for j in range(e0, e1) if out[j] > 1] or [e1 - 1]
    if d1 - lay.dim < 2 or len(big) != 1 or big[0] != e1 - 1:
        return None
    if d0 != lay.dim and (single or lay.split_factor != 1):
        return None
    if split_dims.intersection(range(d0, d1)):  # H and W of a tile: tokens (_tokens.py)
        return None
    # dims before the split one (the batch, the D windows before split H windows) stay
    # whole in front of the re-chunked run: the output's split factor
    outer = math.prod(shape[: lay.dim]) // math.prod(out[: e1 - 1])
    return Move(lay, False, e1 - 1, math.prod(shape[lay.dim + 1 : d1]), outer)


def _batch_of_one_rank(lay: TokenLayout, x: DTensor) -> bool:
    """The batch split over a ``dp`` mesh dim of one rank: kept on dim 0."""
    return lay.parts == 1 and lay.dim == 0 and is_dp(x, lay.mesh_dim)


@functools.lru_cache(maxsize=256)
def window_plan(size: int, parts: int, k: int, to_windows: bool) -> ExchangePlan | None:
    """The exchange from the map's own chunks of a ``size``-long dim to the chunks aligned on
    ``k``-long windows (or back), ``None`` when they are the same."""
    own = tuple(all_shard_bounds(size, parts))
    aligned = tuple((a * k, b * k) for a, b in all_shard_bounds(size // k, parts))
    if own == aligned:
        return None
    owned, needed = (own, aligned) if to_windows else (aligned, own)
    return ExchangePlan(size, owned, tuple((n,) for n in needed))


def _local_outer(x: DTensor, lays: list, move: Move, out_shape: tuple) -> int:
    """``move.outer`` on this rank: a ``dp`` mesh dim leaves it part of the images where the
    batch is among the whole entries in front of the chunked run."""
    outer, lead = move.outer, math.prod(out_shape[: move.dim])  # entries before the merge
    for lay in lays:
        merged = lay.dim < move.lay.dim and math.prod(x.shape[: lay.dim + 1]) > lead
        if is_dp(x, lay.mesh_dim) and (lay.dim == move.lay.dim if move.split else merged):
            outer = outer * lay.held() // x.shape[lay.dim]
    return outer


def _rechunk(local: Tensor, x: DTensor, lays: list, move: Move, out_shape: tuple) -> Tensor:
    """``local``'s dim that ``move`` cuts (of ``x``) or merges into (of ``out_shape``) moved
    between the map's own chunks and the window-aligned ones, point to point."""
    d = move.lay.dim if move.split else move.dim
    size = (x.shape if move.split else out_shape)[d]
    plan = window_plan(size // move.outer, move.lay.parts, move.k, move.split)
    if plan is None:
        return local
    outer = _local_outer(x, lays, move, out_shape)
    a, b = plan.owned[move.lay.rank]
    t = local.unflatten(d, (outer, b - a)).movedim(d + 1, -1)
    group = mesh_group(x.device_mesh, move.lay.mesh_dim)
    out = gather_columns(t, plan, move.lay.rank, group).movedim(-1, d + 1).flatten(d, d + 1)
    # contiguous: DTensor takes the wrapped local tensor to be (its view ops rely on it)
    return out.contiguous()


def _single_window_dims(x: DTensor, lays: list, out_shape: tuple) -> dict[int, int]:
    """``{mesh dim: output dim}`` of the single windows of a batch of windows a reshape puts
    back: on tiles the size-1 output dims that fit, in mesh dim order; on one mesh dim the
    window index it came from (``SINGLE_WINDOWS``). ``_target`` would pick another dim."""
    groups, out = {}, {}
    for lay in lays:
        if not is_dp(x, lay.mesh_dim):
            groups.setdefault(lay.dim, []).append(lay)
    for group in groups.values():
        ones = [lay for lay in group if lay.inner <= 1]
        if not ones or len({(o.split_factor, o.unit) for o in ones}) > 1:
            continue
        found = [e for e, _, _ in fits(tuple(x.shape), ones[0], out_shape) if out_shape[e] == 1]
        at = SINGLE_WINDOWS.get(("batch", tuple(out_shape), ones[0].mesh_dim))
        if len(group) == 1 and at in found and len(out_shape) > x.ndim:  # a reverse view
            out[ones[0].mesh_dim] = at
        elif len(group) > 1 and len(found) >= len(ones):
            out.update(zip([o.mesh_dim for o in ones], found[-len(ones) :], strict=True))
    return out


def window_reshape(x: DTensor, out_shape: tuple, moves: list[Move], fn, lays: list) -> DTensor:
    """``x`` reshaped to ``out_shape`` locally (``fn(local, shape)``, else ``reshape``): the
    dims of ``moves`` re-chunked at window boundaries, every other split dim kept whole."""
    shape, placements, local = tuple(x.shape), list(x.placements), x.to_local()
    for m in moves:
        if m.split:
            local = _rechunk(local, x, lays, m, out_shape)
    # each split dim's share of the output dim it lands on (dp and sp: the batch of windows)
    share = {e: (1, 1) for e in range(len(out_shape))}
    by_mesh = {m.lay.mesh_dim: m for m in moves}
    single = _single_window_dims(x, lays, out_shape)
    for lay in lays:
        m, own, total = by_mesh.get(lay.mesh_dim), lay.held(), shape[lay.dim]
        if m is not None:
            total = shape[lay.dim] // m.outer // m.k if m.split else shape[lay.dim]
            a, b = shard_bounds(total, lay.parts, lay.rank)  # windows (split) or rows (merge)
            e, own = m.dim, b - a
            placements[lay.mesh_dim] = Shard(e) if m.split else placement(e, m.outer)
        elif _batch_of_one_rank(lay, x):
            placements[lay.mesh_dim] = Shard(0)
            continue
        elif lay.mesh_dim in single:
            e = single[lay.mesh_dim]
            placements[lay.mesh_dim] = Shard(e)
        else:
            # a size-1 split factor fits several output dims: the window index, innermost
            e, sf, _ = _target(shape, lay, out_shape, last=True)  # _moves checked it fits
            if lay.inner <= 1 and e == 0 and lay.dim > 0 and not is_dp(x, lay.mesh_dim):
                # the reverse view puts it back (``_target`` would pick the innermost dim)
                remember_single(("batch", shape, lay.mesh_dim), lay.dim)
            placements[lay.mesh_dim] = placement(e, sf)
        share[e] = (share[e][0] * own, share[e][1] * total)
    local_shape = [n * o // t for n, (o, t) in zip(out_shape, share.values(), strict=True)]
    out = fn(local, tuple(local_shape)) if fn else local.reshape(local_shape)
    for m in moves:
        if not m.split:
            out = _rechunk(out, x, lays, m, out_shape)
    return wrap(out, x, placements, out_shape)


def _moves(x: DTensor, out_shape: tuple[int, ...], lays: list) -> list[Move] | None:
    """The window moves of a reshape of ``x`` to ``out_shape`` (empty: none, but local),
    ``None`` when it is not a window reshape."""
    shape = tuple(x.shape)
    spatial = [o.dim for o in lays if not is_dp(x, o.mesh_dim)]
    # two layouts on one dim (dp and sp on the batch of windows): their shares compose here
    moves, local = [], len({lay.dim for lay in lays}) < len(lays)
    for lay in lays:
        if _batch_of_one_rank(lay, x):  # kept on dim 0 here: DTensor / _tokens would not
            local = local or len(lays) > 1
            continue
        m = None  # no window cut of a token layout (nested over several spatial mesh dims)
        if lay.unit == 1 and not (spatial.count(lay.dim) > 1 and lay.split_factor != 1):
            m = _split(lay, shape, out_shape)
        if m is None and lay.unit == 1 and lay.split_factor == 1:
            # a spatial one's merge with the other spatially split dims: tiles' tokens
            others = frozenset() if is_dp(x, lay.mesh_dim) else frozenset(spatial) - {lay.dim}
            m = _merge(lay, shape, out_shape, others)
        if m is not None:
            moves.append(m)
            continue
        found = _target(shape, lay, out_shape)
        if found is None:
            return None
        # a size-1 split dim (one window), or a plain Shard merged into the batch of
        # windows as its inner factor: local (DTensor refuses, or gathers, some of them)
        local = local or lay.inner == 1 or (lay.split_factor == 1 and found[1] > 1)
    if not moves and _tokens.is_nested(x):  # tiles' tokens: _tokens.py nests the splits
        return None
    return moves if moves or local else None


#: the reshape-like ops
RESHAPES = (torch.reshape, Tensor.reshape, torch.flatten, Tensor.flatten, torch.unflatten)
RESHAPES += (Tensor.unflatten, Tensor.view)


def _reshaping(fn, prev):
    """Handler for ``fn``: window moves, else ``local_reshape`` of tokens, else ``prev``."""
    what, view = function_name(fn), (lambda t, s: t.view(s)) if fn is Tensor.view else None

    def handler(x, *args, **kwargs):
        if not isinstance(x, DTensor) or "dtype" in kwargs or torch.dtype in map(type, args):
            return prev(x, *args, **kwargs)
        shape = result_shape(fn, x.shape, *args, **kwargs)
        # tokens behind a prefix (class token) are never windows: local_reshape keeps it
        lays = split_layouts(x)
        moves = None if any(lay.prefix for lay in lays) else _moves(x, shape, lays)
        if moves is not None:
            return window_reshape(x, shape, moves, view, lays)
        if _tokens.is_tokens(x) or _tokens.is_nested(x):
            return local_reshape(x, shape, what, view)
        return prev(x, *args, **kwargs)

    return handler


chain_each(RESHAPES, _reshaping, "window")


def _batches_alike(a, *others) -> bool:
    """True for ``a`` split only along dims before its last two (a batch of windows) and
    ``others`` split alike."""
    if not isinstance(a, DTensor) or any(p.is_partial() for p in a.placements):
        return False
    lays = split_layouts(a)
    return (
        bool(lays)
        and all(lay.dim < a.ndim - 2 for lay in lays)
        and all(
            isinstance(b, DTensor) and b.placements == a.placements and b.shape[:-2] == a.shape[:-2]
            for b in others
        )
    )


@chain(*MATMULS, prefix="window")
def window_matmul(prev, a, b, *args, **kwargs):
    """``a @ b`` of two batches split alike along their batch dims (per window): local."""
    if args or kwargs or not _batches_alike(a, b):
        return prev(a, b, *args, **kwargs)
    out = torch.matmul(a.to_local(), b.to_local())
    return wrap(out, a, a.placements, (*a.shape[:-1], b.shape[-1]))


@chain(F.scaled_dot_product_attention, prefix="window")
def window_sdpa(prev, query, key, value, attn_mask=None, *args, **kwargs):
    """SDPA of q, k, v split alike along their batch dims only (windows): local, the mask
    sliced to the rank's windows."""
    if not _batches_alike(query, key, value):
        return prev(query, key, value, attn_mask, *args, **kwargs)
    mask = sdpa_bias(attn_mask, query, "F.scaled_dot_product_attention")  # the rank's windows
    q, k, v = (t.to_local() for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, mask, *args, **kwargs)
    if out.numel() == 0 and isinstance(mask, torch.Tensor) and mask.requires_grad:
        # a rank holding no windows: torch answers an empty batch without reading the mask,
        # whose gradient would skip its sum over the ranks (the others would wait in it)
        out = out + mask.sum() * 0
    return wrap(out, query, query.placements, (*query.shape[:-1], value.shape[-1]))
