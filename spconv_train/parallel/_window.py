"""A window op's halo along the last, sharded dim (``plan_window``, ``gather_window``: the op
then runs with padding 0 there; docs/halo.md), and windows saved for the backward by reference.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ._geometry import ExchangePlan, Interval, SpatialShardingError, check_strips, window_out_size
from ._halo import gather_columns
from ._layout import reshape_kept
from ._runtime import current_runtime

PAD_MODES = ("zeros", "constant", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class WindowPlan:
    """A window op along a sharded dim; per rank: ``edges`` (pad_lo, pad_hi, crop_lo, crop_hi),
    ``starts`` the global input index of its window's first element (may be negative)."""

    exchange: ExchangePlan
    out_width: int
    out_bounds: tuple[Interval, ...]
    edges: tuple[tuple[int, int, int, int], ...]
    starts: tuple[int, ...]


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
    """Plan a window op along a width over ``parts`` ranks (``ceil_mode``: extra ``pad_hi``)."""
    if mode not in PAD_MODES:
        raise SpatialShardingError(f"{what}: padding mode {mode!r} is not supported")
    owned = tuple(check_strips(what, width, parts, "input"))
    out_width = window_out_size(width, kernel, stride, dilation, pad_lo, pad_hi)
    if out_width < 1:
        raise SpatialShardingError(f"{what}: input width {width} is too small for this window")
    out_bounds = check_strips(what, out_width, parts, "output")
    needed, edges = [], []
    for o0, o1 in out_bounds:
        lo, hi = o0 * stride - pad_lo, (o1 - 1) * stride - pad_lo + dilation * (kernel - 1) + 1
        if mode == "circular":  # wrapped left, inside, wrapped right: never padded
            if lo < -width or hi > 2 * width:
                raise SpatialShardingError("circular padding wider than the image")
            spans = [(width + lo, width), (max(lo, 0), min(hi, width)), (0, hi - width)]
            needed.append(tuple((a, b) for a, b in spans if a < b))
            edges.append((0, 0, 0, 0))
            continue
        src_lo = min(max(lo, 0), width)  # the columns inside [0, width) the window is built of
        src_hi = max(min(hi, width), src_lo)
        if mode in ("reflect", "replicate"):  # reflect: column -i mirrors i, W-1+i mirrors W-1-i
            reflect = mode == "reflect"
            if lo < 0:
                src_lo, src_hi = 0, max(src_hi, 1 - lo if reflect else 1)
            if hi > width:
                src_lo, src_hi = min(src_lo, 2 * width - 1 - hi if reflect else width - 1), width
        needed.append(((src_lo, src_hi),) if src_lo < src_hi else ())
        pl, pr = max(0, src_lo - lo), max(0, hi - src_hi)
        edges.append((pl, pr, lo - min(lo, src_lo), max(hi, src_hi) - hi))
    plan = ExchangePlan(width, owned, tuple(needed), wrap=mode == "circular")
    plan.check_neighbours(what)
    starts = tuple(o0 * stride - pad_lo for o0, _ in out_bounds)
    return WindowPlan(plan, out_width, tuple(out_bounds), tuple(edges), starts)


def gather_window(
    local: Tensor, wp: WindowPlan, rank: int, group, mode: str = "zeros", value: float = 0.0
) -> Tensor:
    """This rank's window along the last dim, edges padded in ``mode`` (constant: ``value``)."""
    pl, pr, cl, cr = wp.edges[rank]
    if mode in ("zeros", "constant"):  # the padding written into the window buffer
        g = gather_columns(local, wp.exchange, rank, group, pl, pr, value)
    else:
        g = gather_columns(local, wp.exchange, rank, group)
        if pl or pr:  # (a circular window wraps around in the exchange: never padded)
            # F.pad's modes pad two listed dims of a 3-D or 4-D tensor only
            flat = F.pad(g.flatten(1, g.ndim - 3) if g.ndim > 4 else g, (pl, pr, 0, 0), mode=mode)
            g = reshape_kept(flat, (*g.shape[:-1], flat.shape[-1]))
    return g.narrow(-1, cl, g.shape[-1] - cl - cr) if cl or cr else g


class _WindowRecipe:
    """A window rebuilt from the local part (by reference) and thin copies of each step's halos,
    both through the hooks active before (``outer``: offloading, checkpointing, a meter)."""

    def __init__(self, window: Tensor, local: Tensor, steps, value, outer):
        self.shape, self.stride, self.value = window.shape, window.stride(), value
        self.outer, self.version = outer, local._version
        self.local = self._put(local)
        #: per step (tensor dim, WindowPlan, rank, result): (dim, parts); a part (offset, n,
        #: source): pad (None), the previous result from ``start`` (an int) or a copied halo
        self.levels: list[tuple[int, list[tuple[int, int, object]]]] = []
        for dim, wp, rank, result in steps:
            (pad_lo, pad_hi, _, _), a = wp.edges[rank], wp.exchange.owned[rank][0]
            parts, offset = ([(0, pad_lo, None)] if pad_lo else []), pad_lo
            for owner, s, e in wp.exchange.pieces(rank):
                src = s - a  # own columns: read from the previous step's result
                if owner != rank:  # a received halo: a few planes, copied (corners too)
                    src = self._put(result.narrow(dim, offset, e - s).clone())
                parts.append((offset, e - s, src))
                offset += e - s
            if pad_hi:
                parts.append((offset, pad_hi, None))
            self.levels.append((dim, parts))

    def _put(self, t: Tensor):
        return self.outer[0](t) if self.outer else t

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
        """Write step ``level``'s result into ``out``, restricted to ``cuts`` ({dim: (at, n)})."""
        if level < 0:
            out.copy_(_cut(local, cuts))
            return
        dim, parts = self.levels[level]
        for offset, n, src in parts:
            dst = out.narrow(dim, offset, n)
            if src is None:
                dst.fill_(self.value)
            elif isinstance(src, int):
                self._fill(dst, level - 1, local, {**cuts, dim: (src, n)})
            else:
                dst.copy_(_cut(self._get(src), cuts))


def _cut(t: Tensor, cuts: dict) -> Tensor:
    for dim, (start, n) in cuts.items():
        t = t.narrow(dim, start, n)
    return t


@contextlib.contextmanager
def saving_steps_by_reference(window: Tensor, local: Tensor, steps, value=0.0):
    """While active, an op saving ``window`` (built from ``local`` by ``steps``, edge padding
    of ``value``) saves a recipe instead, rebuilt in the backward (docs/design.md, "Saving
    windows by reference"); a no-op when the runtime's option is off."""
    # Hooks already active (checkpointing, offloading, a memory meter) see every other saved
    # tensor: chained (the internal hook getter checked on torch 2.14, tests/test_conv.py).
    view = window.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    if view or not current_runtime().options.save_windows_by_reference:
        yield  # a view of the local tensor is no copy: nothing to save differently
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer else (None, None)
    key = (window.data_ptr(), window.shape, window.stride())
    # Every saved tensor keeps its pack hook alive until the backward (PySavedVariableHooks):
    # a closure over the window would keep the copy this avoids; ``held`` is emptied instead.
    held = [window, local, steps]

    def pack(t: Tensor):
        if held and (t.data_ptr(), t.shape, t.stride()) == key:
            return _WindowRecipe(*held[:2], held[2], value, outer)
        return outer_pack(t) if outer_pack else t

    def unpack(saved):  # (a recipe the outer hooks made, nested windows, rebuilds the same)
        if isinstance(saved, _WindowRecipe):
            return saved.rebuild()
        return outer_unpack(saved) if outer_unpack else saved

    del window, local, steps
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        held.clear()
