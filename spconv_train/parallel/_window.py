"""A window op's halo along one sharded dim (the last), and windows saved by reference.

``plan_window`` turns a layer's geometry along the dim into an ``ExchangePlan`` plus, per
rank, the padding to add at the image edges and the positions to crop afterwards.
``gather_window`` runs it: the unchanged local op then runs with padding 0 along the dim
and produces exactly this rank's outputs (DTensor chunking). ``_tiles.tile_window`` chains
it over every sharded dim of a layout. ``saving_steps_by_reference``: below.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._geometry import (
    ExchangePlan,
    Interval,
    SpatialShardingError,
    check_strips,
    window_input_range,
    window_out_size,
)
from ._halo import gather_columns
from ._runtime import current_runtime

PAD_MODES = ("zeros", "constant", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class WindowPlan:
    """Everything every rank needs to run one window op on its strip."""

    exchange: ExchangePlan
    out_width: int
    out_bounds: tuple[Interval, ...]
    #: per rank: (pad_left, pad_right, crop_left, crop_right) applied to the gathered columns
    edges: tuple[tuple[int, int, int, int], ...]


def _sources(lo: int, hi: int, width: int, mode: str) -> list[Interval]:
    """Global columns inside ``[0, width)`` needed to build window ``[lo, hi)`` in ``mode``."""
    if mode == "circular":
        if lo < -width or hi > 2 * width:
            raise SpatialShardingError("circular padding wider than the image")
        parts = []
        if lo < 0:
            parts.append((width + lo, width))
        if max(lo, 0) < min(hi, width):
            parts.append((max(lo, 0), min(hi, width)))
        if hi > width:
            parts.append((0, hi - width))
        return parts
    src_lo, src_hi = min(max(lo, 0), width), max(min(hi, width), min(max(lo, 0), width))
    if mode == "reflect":
        # Column -i mirrors column i (and W-1+i mirrors W-1-i): the edge rank needs them too.
        if lo < 0:
            src_lo, src_hi = 0, max(src_hi, 1 - lo)
        if hi > width:
            src_lo, src_hi = min(src_lo, 2 * width - 1 - hi), width
    elif mode == "replicate":
        if lo < 0:
            src_lo, src_hi = 0, max(src_hi, 1)
        if hi > width:
            src_lo, src_hi = min(src_lo, width - 1), width
    return [(src_lo, src_hi)] if src_lo < src_hi else []


@functools.lru_cache(maxsize=4096)
def plan_window(
    what: str,
    width: int,
    parts: int,
    kernel: int,
    stride: int,
    dilation: int,
    pad_lo: int,
    pad_hi: int,
    mode: str = "zeros",
) -> WindowPlan:
    """Plan a window op of the given width geometry over ``parts`` spatial ranks (a pool's
    ``ceil_mode``: as extra ``pad_hi``, ``_tiles.ceil_geom``).

    Raises ``SpatialShardingError`` (naming ``what``) when a strip is empty or narrower than
    the halo it must give to its neighbour."""
    if mode not in PAD_MODES:
        raise SpatialShardingError(f"{what}: padding mode {mode!r} is not supported")
    owned = check_strips(what, width, parts, "input")
    out_width = window_out_size(width, kernel, stride, dilation, pad_lo, pad_hi)
    if out_width < 1:
        raise SpatialShardingError(f"{what}: input width {width} is too small for this window")
    out_bounds = check_strips(what, out_width, parts, "output")
    needed, edges = [], []
    for o0, o1 in out_bounds:
        lo, hi = window_input_range(o0, o1, kernel, stride, dilation, pad_lo)
        srcs = _sources(lo, hi, width, mode)
        needed.append(tuple(srcs))
        if mode == "circular":
            edges.append((0, 0, 0, 0))
            continue
        src_lo = srcs[0][0] if srcs else min(max(lo, 0), width)
        src_hi = srcs[-1][1] if srcs else src_lo
        pl, pr = max(0, src_lo - lo), max(0, hi - src_hi)
        edges.append((pl, pr, lo - min(lo, src_lo), max(hi, src_hi) - hi))
    plan = ExchangePlan(width, tuple(owned), tuple(needed), wrap=mode == "circular")
    plan.check_neighbours(what)
    return WindowPlan(plan, out_width, tuple(out_bounds), tuple(edges))


def gather_window(
    local: Tensor, wp: WindowPlan, rank: int, group, mode: str = "zeros", value: float = 0.0
) -> Tensor:
    """Fetch this rank's window (halo included) along the last dim and pad it at the image
    edges, so the local op afterwards runs with padding 0 along that dim.

    ``mode`` "zeros"/"constant" pads with ``value`` (e.g. ``-inf`` for max pooling);
    "reflect"/"replicate"/"circular" follow ``F.pad``. ``halo_window`` does the same for
    every sharded dim of any layout."""
    pl, pr, cl, cr = wp.edges[rank]
    if mode in ("zeros", "constant"):
        # The width padding is written straight into the window buffer (no extra copy).
        g = gather_columns(local, wp.exchange, rank, group, pl, pr, value)
    else:
        g = gather_columns(local, wp.exchange, rank, group)
        if pl or pr:  # (a circular window wraps around in the exchange: never padded)
            # two dims listed: F.pad's modes take a 3-D or a 4-D tensor then
            g = F.pad(g, (pl, pr, 0, 0), mode=mode)
    return g.narrow(-1, cl, g.shape[-1] - cl - cr) if cl or cr else g


@dataclass(frozen=True)
class WindowStep:
    """One exchange that built (part of) a window: along tensor dim ``dim``, ``exchange``'s
    pieces for ``rank`` between ``pad_lo`` and ``pad_hi`` elements of edge padding.
    ``result`` is the tensor it produced (its halo pieces are copied when the window is
    saved). A window fetched along several dims (a tile: W, then H on the W window, then D)
    is the chain of its steps, in order."""

    dim: int
    exchange: ExchangePlan
    rank: int
    pad_lo: int
    pad_hi: int
    result: Tensor


class _WindowRecipe:
    """How to rebuild a padded window from the local strip or tile (kept by reference:
    usually the op before saved it anyway) and thin copies of the halos of every step.
    Both go through the hooks that were active before (``outer``), so a memory meter,
    offloading or activation checkpointing sees exactly what is kept."""

    def __init__(self, window: Tensor, local: Tensor, steps, value, outer):
        self.shape, self.stride = window.shape, window.stride()
        self.value, self.outer = value, outer
        self.version = local._version
        self.local = outer[0](local) if outer else local
        #: per step: (dim, parts); a part is ("pad", n), ("own", (start, n)) or ("halo", t)
        self.levels: list[tuple[int, list[tuple[str, object]]]] = []
        for st in steps:
            a = st.exchange.owned[st.rank][0]
            parts: list[tuple[str, object]] = [("pad", st.pad_lo)] if st.pad_lo else []
            offset = st.pad_lo
            for owner, s, e in st.exchange.pieces(st.rank):
                if owner == st.rank:
                    parts.append(("own", (s - a, e - s)))
                else:  # a received halo: a few planes, copied (edges and corners included)
                    halo = st.result.narrow(st.dim, offset, e - s).clone()
                    parts.append(("halo", outer[0](halo) if outer else halo))
                offset += e - s
            if st.pad_hi:
                parts.append(("pad", st.pad_hi))
            self.levels.append((st.dim, parts))

    def _get(self, packed) -> Tensor:
        return self.outer[1](packed) if self.outer else packed

    def rebuild(self) -> Tensor:
        local = self._get(self.local)
        if not self.outer and local._version != self.version:
            raise RuntimeError(
                "a tensor a width-sharded layer saved for backward was modified in place "
                "after the forward; make that operation out of place"
            )
        # The window's own layout (a volume's window is a permuted view of its buffer).
        out = torch.empty_strided(self.shape, self.stride, dtype=local.dtype, device=local.device)
        self._fill(out, len(self.levels) - 1, local, {})
        return out

    def _fill(self, out: Tensor, level: int, local: Tensor, cuts: dict) -> None:
        """Write step ``level``'s result into ``out``, restricted to ``cuts`` (``{dim:
        (start, n)}`` along the dims of the later steps, in local coordinates)."""
        if level < 0:
            out.copy_(_cut(local, cuts))
            return
        dim, parts = self.levels[level]
        offset = 0
        for kind, item in parts:
            if kind == "pad":
                out.narrow(dim, offset, item).fill_(self.value)
                offset += item
            elif kind == "own":
                start, n = item
                self._fill(out.narrow(dim, offset, n), level - 1, local, {**cuts, dim: item})
                offset += n
            else:
                halo = _cut(self._get(item), cuts)
                out.narrow(dim, offset, halo.shape[dim]).copy_(halo)
                offset += halo.shape[dim]


def _cut(t: Tensor, cuts: dict) -> Tensor:
    for dim, (start, n) in cuts.items():
        t = t.narrow(dim, start, n)
    return t


def _shares(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextlib.contextmanager
def saving_steps_by_reference(window: Tensor, local: Tensor, steps, value=0.0):
    """While active, an op that saves ``window`` (built from ``local`` by the exchanges
    ``steps``, ``WindowStep``, in order: one per sharded dim; edge padding of ``value``) for
    its backward saves a recipe instead (``local`` by reference plus its halo slabs) and
    rebuilds the window in the backward (why: docs/design.md, "Saving windows by
    reference"). A no-op when the runtime's ``save_windows_by_reference`` option is off."""

    # Hooks already active (activation checkpointing, offloading, a memory meter) keep
    # seeing every other saved tensor: chain to them. ``_top_saved_tensors_default_hooks``
    # is internal (checked against torch 2.14; tests/test_conv.py covers the chaining).
    if not current_runtime().options.save_windows_by_reference or _shares(window, local):
        yield  # a view of the local tensor is no copy: nothing to save differently
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer else (None, None)
    key = (window.data_ptr(), window.shape, window.stride())
    # Every saved tensor keeps its pack hook alive until the backward frees it (torch's
    # PySavedVariableHooks): a closure over the window would keep the very copy this
    # avoids. The hook reads the tensors from ``held``, emptied when the op has run.
    held = [window, local, steps]

    def pack(t: Tensor):
        if held and (t.data_ptr(), t.shape, t.stride()) == key:
            return _WindowRecipe(*held[:2], held[2], value, outer)
        return ("outer", outer_pack(t)) if outer_pack else t

    def unpack(saved):
        if isinstance(saved, _WindowRecipe):
            return saved.rebuild()
        if isinstance(saved, tuple) and len(saved) == 2 and saved[0] == "outer":
            return outer_unpack(saved[1])
        return saved

    del window, local, steps
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        held.clear()
