"""Halo arithmetic in *global* column indices (docs/halo.md): who owns and who needs which
columns, computed by every rank for every rank (no metadata round trip).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

Interval = tuple[int, int]


class SpatialShardingError(ValueError):
    """A layer or tensor cannot run width-sharded as configured (the message says why and how
    to fix it). Raised instead of silently gathering or silently computing a wrong answer."""


def shard_bounds(size: int, parts: int, index: int) -> Interval:
    """Columns ``[start, stop)`` that DTensor's ``Shard`` gives to ``index`` of ``parts``
    (as ``torch.chunk``: ``ceil(size / parts)`` per rank, the last ones fewer or none)."""
    chunk = -(-size // parts) if parts > 0 else 0
    return min(index * chunk, size), min((index + 1) * chunk, size)


def all_shard_bounds(size: int, parts: int) -> list[Interval]:
    """``shard_bounds`` for every rank."""
    return [shard_bounds(size, parts, r) for r in range(parts)]


def window_out_size(
    size: int, kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int, ceil_mode=False
) -> int:
    """Output length of a sliding window op (conv, pooling) along one dimension."""
    span = size + pad_lo + pad_hi - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1  # PyTorch: the last window starts inside the input or its left pad
    return out - 1 if (out - 1) * stride >= size + pad_lo else out


@dataclass(frozen=True)
class ExchangePlan:
    """Which global columns every rank of a spatial group owns and which it needs: rank ``r``
    receives the columns of the intervals ``needed[r]``, in order. ``wrap``: the first and
    last rank may talk too (circular padding)."""

    width: int
    owned: tuple[Interval, ...]
    needed: tuple[tuple[Interval, ...], ...]
    wrap: bool = False

    @functools.cached_property
    def _routes(self) -> tuple[list, list]:
        """Every rank's pieces and sends, computed once (plans are cached, reused every step)."""
        ranks = range(len(self.owned))
        pieces = [
            [(q, max(lo, a), min(hi, b)) for lo, hi in self.needed[r]
             for q, (a, b) in enumerate(self.owned) if max(lo, a) < min(hi, b)]
            for r in ranks
        ]  # fmt: skip
        sends = [
            [(q, s, e) for q in ranks if q != r for o, s, e in pieces[q] if o == r] for r in ranks
        ]
        return pieces, sends

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(owner, start, stop)`` pieces that make up ``rank``'s needed columns, in order."""
        return list(self._routes[0][rank])

    def sends(self, rank: int) -> list[tuple[int, int, int]]:
        """``(receiver, start, stop)`` pieces ``rank`` gives, in the receivers' (P2P) order."""
        return list(self._routes[1][rank])

    def check_neighbours(self, what: str) -> None:
        """Raise unless every piece comes from the rank itself or a neighbouring rank."""
        n = len(self.owned)
        for r in range(n):
            for owner, s, e in self.pieces(r):
                if abs(owner - r) > 1 and not (self.wrap and {owner, r} == {0, n - 1}):
                    widths = [b - a for a, b in self.owned]
                    raise SpatialShardingError(
                        f"{what}: rank {r} needs columns [{s}, {e}) held by rank {owner}, but "
                        f"halos are only exchanged between neighbouring strips. The input "
                        f"width {self.width} is split over {n} ranks into strips of {widths} "
                        f"columns, narrower than the halo this layer needs. Use a wider image "
                        f"or fewer spatial ranks (parallel.sp)."
                    )


def check_strips(what: str, width: int, parts: int, kind: str = "input") -> list[Interval]:
    """Shard bounds of ``width`` over ``parts`` ranks; raise if any rank gets no column."""
    bounds = all_shard_bounds(width, parts)
    empty = [r for r, (a, b) in enumerate(bounds) if a == b]
    if empty:
        per = shard_bounds(width, parts, 0)[1]  # the first (widest) strip
        raise SpatialShardingError(
            f"{what}: the {kind} width {width} split over {parts} spatial ranks "
            f"({per} columns per strip, DTensor chunking) leaves rank(s) {empty} with an empty "
            f"strip. Every rank needs at least one column: use a wider image (a multiple of "
            f"{parts} always works) or fewer spatial ranks (parallel.sp)."
        )
    return bounds


def ntuple(v, n: int) -> tuple[int, ...]:
    """``v`` (an int or an ``n``-sequence) as ``n`` ints, one per spatial dim."""
    return (int(v),) * n if isinstance(v, int) else tuple(int(a) for a in v)
