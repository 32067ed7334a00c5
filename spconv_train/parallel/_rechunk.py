"""Re-chunk a sharded dim: a new sharded tensor whose every element along that dim is a copy
of some input element (or a fill value), with point-to-point traffic only.

Padding, cropping, slicing (``x[..., a:b:s]``), ``flip`` and ``roll`` along any sharded dim
of any layout (one dim at a time over its own mesh dim) all change
which global column each output column reads and, since DTensor chunks the *new* width
afresh, which rank owns it. A map is given as a few ``Segment``s (runs of output columns:
a fill, or input columns ``start, start + step, ...``; step 0 repeats one column, step -1
mirrors). Every rank computes every rank's needs from the map (no metadata exchange),
receives from each owner the hull of the columns it needs (one message per owner pair,
``gather_columns``), and picks its columns locally (``index_select``, whose backward adds
duplicated reads, e.g. reflect padding, back up). Flip pairs rank r with rank n-1-r: P2P
with the owner, never a gather. The backward returns every gradient column to its owner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._geometry import ExchangePlan, all_shard_bounds
from ._halo import gather_columns
from ._sharding import enter, leave, spatial_layout
from ._tiles import axis_of


@dataclass(frozen=True)
class Segment:
    """``length`` output columns reading input columns ``start + i * step``, or the fill
    value when ``start`` is None."""

    length: int
    start: int | None = None
    step: int = 1


def fill(length: int) -> Segment:
    """``length`` columns of the fill value."""
    return Segment(length)


def cols(start: int, length: int, step: int = 1) -> Segment:
    """``length`` input columns from ``start`` by ``step`` (0: repeated, -1: mirrored)."""
    return Segment(length, start, step)


def _sources(segments: tuple[Segment, ...], lo: int, hi: int) -> list[int]:
    """Input column (-1: fill) of every output column in ``[lo, hi)``."""
    out, pos = [], 0
    for seg in segments:
        a, b = max(lo, pos), min(hi, pos + seg.length)
        for j in range(a, b):
            out.append(-1 if seg.start is None else seg.start + (j - pos) * seg.step)
        pos += seg.length
    return out


@dataclass(frozen=True)
class RemapPlan:
    """The exchange (hulls per owner) and, per rank, where each output column sits in the
    received buffer (the last buffer column holds the fill value when ``fills[rank]``)."""

    exchange: ExchangePlan
    out_width: int
    index: tuple[tuple[int, ...], ...]
    fills: tuple[bool, ...]
    identity: tuple[bool, ...]


@functools.lru_cache(maxsize=1024)
def plan_remap(width: int, parts: int, segments: tuple[Segment, ...]) -> RemapPlan:
    """Plan the re-chunk of a ``width``-column input over ``parts`` ranks into the columns
    ``segments`` describe (their total length is the output width)."""
    out_width = sum(s.length for s in segments)
    owned = all_shard_bounds(width, parts)
    needed, index, fills, identity = [], [], [], []
    for o0, o1 in all_shard_bounds(out_width, parts):
        src = _sources(segments, o0, o1)
        for c in src:
            if not -1 <= c < width:
                raise ValueError(f"re-chunk map reads column {c} of a {width}-column input")
        hulls, offsets, total = [], [], 0
        for a, b in owned:
            mine = [c for c in src if a <= c < b]
            if mine:
                hulls.append((min(mine), max(mine) + 1))
                offsets.append(total)
                total += max(mine) + 1 - min(mine)
        where = []
        for c in src:
            if c < 0:
                where.append(total)
                continue
            k = next(i for i, (a, b) in enumerate(hulls) if a <= c < b)
            where.append(offsets[k] + c - hulls[k][0])
        needed.append(tuple(hulls))
        index.append(tuple(where))
        fills.append(any(c < 0 for c in src))
        identity.append(where == list(range(total)))
    plan = ExchangePlan(width, tuple(owned), tuple(needed))
    return RemapPlan(plan, out_width, tuple(index), tuple(fills), tuple(identity))


def remap_axis(local: Tensor, d: int, size: int, segments, axis, value: float = 0.0) -> Tensor:
    """Re-chunk dim ``d`` (global ``size``) of a local block into the elements ``segments``
    describe, over ``axis`` (``(parts, rank, group)`` of the mesh dim sharding ``d``, or
    None: ``d`` is whole on every rank and is remapped locally)."""
    parts, rank, group = axis or (1, 0, None)
    plan = plan_remap(size, parts, tuple(segments))
    g = gather_columns(
        local.movedim(d, -1), plan.exchange, rank, group, 0, int(plan.fills[rank]), value
    )
    if not plan.identity[rank] or plan.fills[rank]:
        g = g.index_select(-1, torch.tensor(plan.index[rank], dtype=torch.long, device=g.device))
    return g.movedim(-1, d)


def remap_dims(x: DTensor, maps: dict, what: str, value: float = 0.0) -> DTensor:
    """The DTensor whose dim ``d`` holds the elements ``maps[d]`` describe (``Segment``s),
    for every ``d`` in ``maps``: each sharded spatial dim of any layout (strips, tiles,
    volumes, blocks) re-chunked over its own mesh dim in turn, the others locally."""
    x, layout = spatial_layout(x, what, x.ndim, tiles=True)
    local, shape = enter(x), list(x.shape)
    for d, segments in maps.items():
        local = remap_axis(local, d, x.shape[d], segments, axis_of(layout, d), value)
        shape[d] = sum(s.length for s in segments)
    return leave(local, layout, tuple(shape))
