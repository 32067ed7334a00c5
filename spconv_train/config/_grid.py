"""The automatic spatial layout of ``parallel.sp: 0``: the most square tile (cubic block).

Pure arithmetic on extents and rank counts (no config, no torch), so it can be tested
on its own and reused by the mesh checks in ``_mesh.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["choose_grid", "empty_ranks", "factorisations"]


def factorisations(ranks: int, dims: int) -> Iterator[tuple[int, ...]]:
    """Every ``dims``-tuple of positive integers whose product is ``ranks``, in
    lexicographic order (so the first ones split the leading dims least)."""
    if dims == 1:
        yield (ranks,)
        return
    for first in range(1, ranks + 1):
        if ranks % first == 0:
            for rest in factorisations(ranks // first, dims - 1):
                yield (first, *rest)


def empty_ranks(size: int, parts: int, levels: int = 0) -> tuple[int, int]:
    """``(level, empty)``: the first of ``levels + 1`` extents (``size``, then halved
    ``levels`` times with flooring, as ``MaxPool(2)`` does) that, chunked like DTensor's
    ``Shard`` (``torch.chunk``: pieces of ``ceil(n / parts)``), leaves ``empty`` ranks
    without data; ``(0, 0)`` when every level fills every rank."""
    for level in range(levels + 1):
        n = size // 2**level
        filled = math.ceil(n / math.ceil(n / parts)) if n > 0 else 0
        if filled < parts:
            return level, parts - filled
    return 0, 0


def choose_grid(shape: Sequence[int], ranks: int, levels: int = 0) -> tuple[int, ...] | None:
    """The split of ``ranks`` over the dims of ``shape`` (ranks along each dim, product
    ``ranks``) whose block (``ceil(n / parts)`` per dim) is the most square, or cubic:
    the smallest ``log(longest side / shortest side)``. Ties go to the split with fewer
    ranks along the leading dims (H for images, D then H for volumes), i.e. strips of the
    last dim. Splits that leave a rank empty (at any of ``levels`` halvings, see
    ``empty_ranks``) are skipped; None when every split does."""
    best: tuple[float, tuple[int, ...]] | None = None
    for parts in factorisations(ranks, len(shape)):
        if any(empty_ranks(n, p, levels)[1] for n, p in zip(shape, parts, strict=True)):
            continue
        logs = [math.log(math.ceil(n / p)) for n, p in zip(shape, parts, strict=True)]
        # rounded: a tie must stay a tie whatever the order of the float operations
        score = (round(max(logs) - min(logs), 9), parts)
        if best is None or score < best:
            best = score
    return None if best is None else best[1]
