"""Window partition and reverse of a sharded map (Swin), and the ops that run per window.

A reshape that factorises a split dim into ``(n // ws, ws)`` (window partition, patch
merging) re-chunks the map to window-aligned owners point to point when the chunks do not
fall on window boundaries, and the reverse merge re-chunks back; the window batch is a
token layout (``_StridedShard(0, B * H // ws)``, nested on tiles), a split dim before the
innermost window index merges by a re-chunk (``_window_moves.py``), and a ``dp`` dim counts
only this rank's images (``_local_outer``). Per-window matmuls and SDPA with a mask sliced
to the rank's windows run locally. docs/attention.md, "Window attention (Swin)".
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from . import _attention, _tokens  # noqa: F401  (their handlers are wrapped below)
from ._dims import is_dp, mesh_group, wrap
from ._geometry import ExchangePlan, all_shard_bounds, shard_bounds
from ._halo import gather_columns
from ._prefix_shard import placement, prefix_of
from ._ring_mask import sdpa_bias
from ._tokens import MATMULS, TokenLayout, _target, chain, chain_each, split_layouts
from ._window_moves import SINGLE_WINDOWS, Move, remember_single, window_move


def _batch_of_one_rank(lay: TokenLayout, x: DTensor) -> bool:
    """The batch split over a ``dp`` mesh dim of one rank: kept on dim 0 (with size-1
    dims around, the shape alone could place it on any of them)."""
    return lay.parts == 1 and lay.dim == 0 and is_dp(x, lay.mesh_dim)


@functools.lru_cache(maxsize=256)
def window_plan(size: int, parts: int, k: int, to_windows: bool) -> ExchangePlan | None:
    """The exchange between the map's own chunks of a ``size``-long dim and the chunks
    aligned on ``k``-long windows (``to_windows``: map -> windows), ``None`` when they
    are the same."""
    own = tuple(all_shard_bounds(size, parts))
    aligned = tuple((a * k, b * k) for a, b in all_shard_bounds(size // k, parts))
    if own == aligned:
        return None
    owned, needed = (own, aligned) if to_windows else (aligned, own)
    return ExchangePlan(size, owned, tuple((n,) for n in needed))


def _local_outer(
    x: DTensor, lays: list[TokenLayout], move: Move, out_shape: tuple[int, ...]
) -> int:
    """``move.outer`` on this rank: a ``dp`` mesh dim leaves it part of the images, where
    the batch is among the whole entries in front of the chunked run (the factorised dim
    itself, the batch of windows, when ``move`` splits; an input dim merged in front of
    the split one into the output dim when it merges). A batch on a dim of its own (a map
    split along W, H or D) leaves the run's entries whole. ``lays``: ``split_layouts(x)``."""
    outer = move.outer
    lead = math.prod(out_shape[: move.dim])  # entries of the output dims before the merge
    for lay in lays:
        if not is_dp(x, lay.mesh_dim):
            continue
        if move.split:
            front = lay.dim == move.lay.dim
        else:
            front = lay.dim < move.lay.dim and math.prod(x.shape[: lay.dim + 1]) > lead
        if front:
            outer = outer * lay.sizes()[lay.rank] // x.shape[lay.dim]
    return outer


def _rechunk(
    local: Tensor,
    x: DTensor,
    lays: list[TokenLayout],
    move: Move,
    d: int,
    out_shape: tuple[int, ...],
) -> Tensor:
    """``local``'s dim ``d`` (of ``x`` when ``move`` splits, of the reshape's
    ``out_shape`` when it merges: ``move.outer`` whole entries, each a chunked run) moved
    between the map's own chunks and the window-aligned ones, point to point."""
    size = x.shape[d] if move.split else out_shape[d]
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


def _single_window_dims(
    x: DTensor, lays: list[TokenLayout], out_shape: tuple[int, ...]
) -> dict[int, int]:
    """``{mesh dim: output dim}`` of the size-1 factors (single windows: nothing chunked,
    the first rank holds it all) of the batch of windows that a reshape puts back: on
    tiles (a dim split over several mesh dims, ``_token_layout._nest``) the size-1 output dims
    that fit them, outer to inner in mesh dim order (``sp_h``'s window row before
    ``sp_w``'s window column); on one mesh dim the window index it came from
    (``SINGLE_WINDOWS``). ``_target`` would pick the dim of the factor after them (same
    runs), or the innermost one. ``lays``: ``split_layouts(x)``."""
    shape, groups = tuple(x.shape), {}
    for lay in lays:
        if not is_dp(x, lay.mesh_dim):
            groups.setdefault(lay.dim, []).append(lay)
    out = {}
    for d, group in groups.items():
        ones = [lay for lay in group if lay.inner <= 1]
        if not ones or len({(o.split_factor, o.unit) for o in ones}) > 1:
            continue
        head = math.prod(shape[:d]) * ones[0].split_factor
        tail = math.prod(shape[d + 1 :]) * ones[0].unit
        fits = [
            e
            for e, n in enumerate(out_shape)
            if n == 1 and math.prod(out_shape[:e]) == head and math.prod(out_shape[e:]) == tail
        ]
        at = SINGLE_WINDOWS.get(("batch", tuple(out_shape), ones[0].mesh_dim))
        if len(group) == 1 and at in fits and len(out_shape) > len(shape):  # a reverse view
            out[ones[0].mesh_dim] = at
        elif len(group) > 1 and len(fits) >= len(ones):
            out.update(zip([o.mesh_dim for o in ones], fits[len(fits) - len(ones) :], strict=True))
    return out


def window_reshape(x: DTensor, out_shape: tuple[int, ...], moves: list[Move], fn=None) -> DTensor:
    """``x`` reshaped to the global ``out_shape`` on the local tensor (``fn(local, shape)``,
    ``reshape`` by default): the dims in ``moves`` factorised / merged around window
    boundaries (re-chunked where the chunks do not fall on them), every other split dim
    kept whole (``_tokens.local_reshape``)."""
    shape = tuple(x.shape)
    placements = list(x.placements)
    local = x.to_local()
    lays = split_layouts(x)  # read once: every step below reads the input's layouts
    for m in moves:
        if m.split:
            local = _rechunk(local, x, lays, m, m.lay.dim, out_shape)
    # each split dim's share of the output dim it lands on (several can land on one: the
    # batch over dp and the windows over sp both split the batch of windows)
    share = {e: (1, 1) for e in range(len(out_shape))}
    by_mesh = {m.lay.mesh_dim: m for m in moves}
    single = _single_window_dims(x, lays, out_shape)
    for lay in lays:
        m = by_mesh.get(lay.mesh_dim)
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
            own, total = lay.sizes()[lay.rank], shape[lay.dim]
        else:
            # a size-1 split factor fits several output dims: the window index, innermost
            e, sf, _ = _target(shape, lay, out_shape, last=True)  # _moves checked it fits
            if lay.inner <= 1 and e == 0 and lay.dim > 0 and not is_dp(x, lay.mesh_dim):
                # the reverse view puts it back (``_target`` would pick the innermost dim)
                remember_single(("batch", shape, lay.mesh_dim), lay.dim)
            placements[lay.mesh_dim] = placement(e, sf)
            own, total = lay.sizes()[lay.rank], shape[lay.dim]
        share[e] = (share[e][0] * own, share[e][1] * total)
    local_shape = [
        n * own // total for n, (own, total) in zip(out_shape, share.values(), strict=True)
    ]
    out = fn(local, tuple(local_shape)) if fn else local.reshape(local_shape)
    for m in moves:
        if not m.split:
            out = _rechunk(out, x, lays, m, m.dim, out_shape)
    return wrap(out, x, placements, out_shape)


def _spatial_dims(x: DTensor, lays: list[TokenLayout], lay: TokenLayout) -> frozenset[int]:
    """The other dims split by a spatial mesh dim when ``lay`` is spatial too (H and W of a
    tile: their merge is the tiles' token layout, ``_tokens.py``, not a window move)."""
    if is_dp(x, lay.mesh_dim):
        return frozenset()
    return frozenset(o.dim for o in lays if not is_dp(x, o.mesh_dim)) - {lay.dim}


def _moves(x: DTensor, out_shape: tuple[int, ...]) -> list[Move] | None:
    """The window moves of a reshape of ``x`` to ``out_shape`` (an empty list: none, but
    the reshape runs locally here), ``None`` when this module has nothing to do or a split
    dim cannot stay whole (the reshape handlers before this one decide then)."""
    shape = tuple(x.shape)
    lays = split_layouts(x)
    # two layouts on one dim (dp and sp on the batch of windows): their shares compose here
    moves, local = [], len({lay.dim for lay in lays}) < len(lays)
    for lay in lays:
        if _batch_of_one_rank(lay, x):  # kept on dim 0 here: DTensor / _tokens would not
            local = local or len(lays) > 1
            continue
        nested = sum(o.dim == lay.dim and not is_dp(x, o.mesh_dim) for o in lays) > 1
        m = window_move(lay, shape, out_shape, _spatial_dims(x, lays, lay), nested)
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


def _reshaping(fn, prev):
    """Window moves for the reshape-like ``fn``, before the token / DTensor rules."""

    def handler(x, *args, **kwargs):
        # tokens behind a prefix (class token) are never windows: _tokens.py keeps the prefix
        if isinstance(x, DTensor) and not any(map(prefix_of, x.placements)):
            shape, f = _tokens.reshape_of(fn, x, args, kwargs)
            moves = None if shape is None else _moves(x, shape)
            if moves is not None:
                return window_reshape(x, shape, moves, f)
        return prev(x, *args, **kwargs)

    return handler


chain_each(_tokens.RESHAPES, _reshaping, "window")


def batch_split(t) -> bool:
    """True for a DTensor split (by any layout) only along dims before its last two: a
    batch of windows (or of images), every matrix whole on one rank."""
    if not isinstance(t, DTensor) or any(p.is_partial() for p in t.placements):
        return False
    lays = split_layouts(t)
    return bool(lays) and all(lay.dim < t.ndim - 2 for lay in lays)


def _alike(a: DTensor, b) -> bool:
    return (
        isinstance(b, DTensor)
        and a.ndim == b.ndim
        and a.placements == b.placements
        and a.shape[:-2] == b.shape[:-2]
    )


@chain(*MATMULS, prefix="window")
def window_matmul(prev, a, b, *args, **kwargs):
    """``a @ b`` of two batches split alike along their batch dims (attention scores per
    window, ``q @ k.transpose(-2, -1)``, and ``attn @ v``): every matrix product local."""
    if args or kwargs or not (batch_split(a) and _alike(a, b)):
        return prev(a, b, *args, **kwargs)
    out = torch.matmul(a.to_local(), b.to_local())
    return wrap(out, a, a.placements, (*a.shape[:-1], b.shape[-1]))


@chain(F.scaled_dot_product_attention, prefix="window")
def window_sdpa(prev, query, key, value, attn_mask=None, *args, **kwargs):
    """``F.scaled_dot_product_attention`` on queries, keys and values split alike along
    their batch dims only (windows): local attention per window, the mask (a relative
    position bias, the shifted-window mask) sliced to the rank's windows."""
    if not (batch_split(query) and _alike(query, key) and _alike(query, value)):
        return prev(query, key, value, attn_mask, *args, **kwargs)
    mask = sdpa_bias(attn_mask, query, "F.scaled_dot_product_attention")  # the rank's windows
    out = F.scaled_dot_product_attention(
        query.to_local(), key.to_local(), value.to_local(), mask, *args, **kwargs
    )
    if out.numel() == 0 and isinstance(mask, torch.Tensor) and mask.requires_grad:
        # A rank holding no windows (fewer windows than ranks): torch answers an empty
        # batch without reading the mask, so the mask's gradient would skip its sum over
        # the ranks (``sdpa_bias``) and the other ranks would wait in it. A zero term keeps
        # this rank in that sum (its share: zeros).
        out = out + mask.sum() * 0
    return wrap(out, query, query.placements, (*query.shape[:-1], value.shape[-1]))
