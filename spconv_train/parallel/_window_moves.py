"""Which reshapes of a sharded map are window cuts (``_windows.py``): a split dim factorised
into ``(windows, ws)`` with the window factor split, such a factorisation merged back, or
the split window index merged with the dims around it into the batch of windows. Shape
arithmetic only (``_windows.window_reshape`` runs the moves); a split window index before
whole ones merges as a ``Move`` with an ``outer`` factor (re-chunked to even chunks of the
merged run). docs/attention.md, "Window attention (Swin)".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._tokens import TokenLayout


def _prefix(shape: tuple[int, ...]) -> list[int]:
    out = [1]
    for n in shape:
        out.append(out[-1] * n)
    return out


def _runs(shape: tuple[int, ...], out: tuple[int, ...], d: int, past_units: bool):
    """The smallest run of input dims ``[d0, d1)`` holding ``d`` that a reshape to ``out``
    turns into whole output dims, and the output run ``[e0, e1)`` it becomes (leading
    size-1 output dims included); ``past_units``: the run goes on past size-1 dims after
    ``d``. ``None`` for empty tensors."""
    pin, pout = _prefix(shape), _prefix(out)
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
    """How a reshape moves the split of input dim ``lay.dim`` whose (chunked) size it
    factorises (``split``: into output dims starting at ``dim``, the split factor outermost,
    ``k`` elements of the dim per outer entry) or merges (``split`` False: with the ``k``
    entries of the input dims right after it, into output dim ``dim``). ``outer``: whole
    entries in front of the chunked part (the split factor of a ``_StridedShard``; 1 for a
    plain ``Shard``), on the input dim (split) or on the output dim (merge)."""

    lay: TokenLayout
    split: bool
    dim: int
    k: int
    outer: int = 1


#: Single windows (a split dim of size 1, e.g. Swin's last stage, one 7 x 7 window: the
#: first rank holds it all) that the shapes alone cannot place, by window-factorised shape.
#: ``("cut", shape, dim) -> 1``: a reshape that merges that size-1 split dim is the window
#: reverse (into the dims after it), not a merge into the batch of windows (the dims before
#: it). ``("batch", shape, mesh dim) -> dim``: the split dim that merged into the batch of
#: windows (``_windows.py``), where the reverse view to that shape puts the split back.
SINGLE_WINDOWS: dict[tuple, int] = {}


def remember_single(key: tuple, value: int) -> None:
    """Record ``key`` in ``SINGLE_WINDOWS`` (cleared past 1024 entries)."""
    if len(SINGLE_WINDOWS) > 1024:
        SINGLE_WINDOWS.clear()
    SINGLE_WINDOWS[key] = value


def _split_strided(lay: TokenLayout, out: tuple[int, ...], e0: int, e1: int) -> Move | None:
    """A ``_StridedShard`` dim (``split_factor`` whole entries, each a chunked run) cut
    into output dims ``[e0, e1)``: the outer factor into whole dims, the chunked run into
    ``(windows, ...)`` with the windows split (the batch of windows back to ``(B, nD, nH,
    nW, ...)`` when ``nH`` is split)."""
    cuts = [e for e in range(e0, e1 + 1) if math.prod(out[e0:e]) == lay.split_factor]
    if not cuts:
        return None
    big = [j for j in range(cuts[-1], e1) if out[j] > 1]
    if len(big) < 2:
        return None
    return Move(lay, True, big[0], math.prod(out[big[0] + 1 : e1]), lay.split_factor)


def _split(lay: TokenLayout, shape: tuple[int, ...], out: tuple[int, ...]) -> Move | None:
    runs = _runs(shape, out, lay.dim, False)
    if runs is None or runs[1] - runs[0] != 1:
        return None
    _, _, e0, e1 = runs
    if lay.split_factor != 1:
        return _split_strided(lay, out, e0, e1)
    big = [j for j in range(e0, e1) if out[j] > 1]
    if len(big) >= 2:  # (windows, ws): the split goes to the windows factor
        return Move(lay, True, big[0], math.prod(out[big[0] + 1 : e1]))
    # (1, W) of a map dim (not the batch): one window along it when the reshape cuts two
    # dims into windows (a partition of H and W); otherwise a size-1 dim added next to it
    # (the dim stays split). A split dim that becomes three or more dims is no window cut
    # either and stays split: a token dim unflattened to a grid with leading size-1 dims
    # ((N, L, C) -> (N, 1, 1, W, C): a 3-D ViT's patches of a thin volume), a map one
    # window high and one row deep ((B, 1, W, C) -> (B, 1, 1, 1, W, C)).
    one = big == [e1 - 1] and e1 - e0 == 2 and lay.dim > 0
    if one and len(out) >= len(shape) + 2:
        remember_single(("cut", tuple(out), e1 - 2), 1)
        return Move(lay, True, e1 - 2, out[e1 - 1])
    return None


def _merge(
    lay: TokenLayout, shape: tuple[int, ...], out: tuple[int, ...], split_dims=frozenset()
) -> Move | None:
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


def window_move(
    lay: TokenLayout,
    shape: tuple[int, ...],
    out: tuple[int, ...],
    split_dims=frozenset(),
    nested: bool = False,
) -> Move | None:
    """The factorisation (or merge) of a split dim around window boundaries, or ``None``:
    the reshape keeps the dim whole, mixes it otherwise, or the layout is a token layout
    (``nested``: the dim is split over several spatial mesh dims, H x W tiles' tokens or
    windows). ``split_dims``: the other dims split by spatial mesh dims."""
    if lay.unit != 1 or (nested and lay.split_factor != 1):
        return None
    m = _split(lay, shape, out)
    if m is not None or lay.split_factor != 1:
        return m
    return _merge(lay, shape, out, split_dims)
