"""Width-sharded pooling: max/avg pooling with halos, adaptive pooling by global windows.

``MaxPool2d``/``AvgPool2d`` (any kernel, stride, padding, dilation, ``ceil_mode``,
``count_include_pad``, ``divisor_override``) fetch their halo and run the unchanged local op,
exactly like ``_conv.py``. ``ceil_mode`` is turned into extra right padding (so the window
geometry is the plain floor rule): ``-inf`` for max pooling; for average pooling the divisor
is then computed from *global* positions, as PyTorch counts it. ``return_indices`` gives
global indices into the flattened ``H*W`` input, like the single-device op.

Adaptive pooling: output column ``j`` covers input columns
``[floor(j*W/ow), ceil((j+1)*W/ow))``. When DTensor chunking of ``ow`` gives every rank at
least one output column the output is ``Shard(3)`` (each rank gathers the columns its
windows read). Otherwise (notably global pooling to width 1, as in DeepLabV3's ASPP or
LR-ASPP) each rank pools its own columns for *every* output column and a small all-reduce
over the spatial group combines them: the output is then ``Replicate`` on the "sp" mesh
dimension (other mesh dimensions as in the input).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from ._geometry import ExchangePlan, all_shard_bounds, check_strips, window_out_size
from ._halo import gather_columns
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._sharding import SpatialLayout, enter, leave, run_unsharded, spatial_layout
from ._small_sum import sum_now
from ._window import gather_window, plan_window, saving_plain_window

Segments = tuple[tuple[int, int], ...]


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _pool_plan(what: str, width: int, parts: int, k: int, s: int, d: int, pad: int, ceil: bool):
    """Window plan of a pooling op along W, with ``ceil_mode`` expressed as extra right
    padding (the columns past ``width + pad`` that the last ceil window overhangs).
    Returns ``(plan, right_pad)``."""
    out = window_out_size(width, k, s, d, pad, pad, ceil)
    pad_hi = max(pad, (out - 1) * s + d * (k - 1) + 1 - width - pad)
    wp = plan_window(what, width, parts, k, s, d, pad, pad_hi)
    assert wp.out_width == out, (what, width, wp.out_width, out)
    return wp, pad_hi


def spatial_max_pool2d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    what: str = "max_pool2d",
):
    """``F.max_pool2d`` on a width-sharded DTensor (same values, gradients and, with
    ``return_indices``, the same global indices into the flattened ``H*W`` input)."""
    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel_size), _pair(padding), _pair(dilation)
    sh, sw = _pair(stride) if stride else (kh, kw)
    # torch's own argument checks (they differ with and without indices), computing nothing
    meta = torch.empty(x.shape, device="meta")
    F.max_pool2d(meta, (kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil_mode, return_indices)
    x, layout = spatial_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_max_pool  # imports this module

        args = ((kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil_mode, return_indices, what)
        return tile_max_pool(x, layout, *args)
    if not layout.width_sharded:
        args = ((kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil_mode)
        if not return_indices:
            return run_unsharded(x, layout, lambda t: F.max_pool2d(t, *args))
        out = run_unsharded(x, layout, lambda t: F.max_pool2d(t, *args, True)[0])
        idx = F.max_pool2d(x.to_local().detach(), *args, True)[1]
        return out, leave(idx, layout, tuple(out.shape))
    width, rank = x.shape[layout.dim], layout.sp_rank
    wp, _ = _pool_plan(what, width, layout.sp_size, kw, sw, dw, pw, ceil_mode)
    local = enter(x)
    win = gather_window(local, wp, rank, layout.sp_group, "zeros", float("-inf"))
    with saving_plain_window(win, local, wp, rank, float("-inf")):
        out, idx = F.max_pool2d(win, (kh, kw), (sh, sw), (ph, 0), (dh, dw), ceil_mode, True)
    shape = (x.shape[0], *out.shape[1:3], wp.out_width)
    if not return_indices:
        return leave(out, layout, shape)
    # local index h * win_width + c  ->  global index h * W + (window start + c)
    ww, start = win.shape[-1], wp.out_bounds[rank][0] * sw - pw
    idx = idx // ww * width + idx % ww + start
    return leave(out, layout, shape), leave(idx, layout, shape)


def _counts(size: int, k: int, s: int, pad: int, lo: int, hi: int, include_pad: bool) -> list:
    """PyTorch's average-pool divisor factor along one dimension for outputs ``[lo, hi)``:
    the window clipped to ``size + pad`` (``count_include_pad``) or to the image."""
    windows = [(j * s - pad, min(j * s - pad + k, size + pad)) for j in range(lo, hi)]
    return [e - a if include_pad else min(e, size) - max(a, 0) for a, e in windows]


def spatial_avg_pool2d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    what: str = "avg_pool2d",
) -> DTensor:
    """``F.avg_pool2d`` on a width-sharded DTensor; padding and ceil-mode overhang columns
    are counted exactly as PyTorch counts them on the whole image."""
    (kh, kw), (ph, pw) = _pair(kernel_size), _pair(padding)
    sh, sw = _pair(stride) if stride else (kh, kw)
    meta = torch.empty(x.shape, device="meta")
    args = ((kh, kw), (sh, sw))
    F.avg_pool2d(meta, *args, (ph, pw), ceil_mode, count_include_pad, divisor_override)
    x, layout = spatial_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_avg_pool  # imports this module

        args = ((kh, kw), (sh, sw), (ph, pw), ceil_mode, count_include_pad, divisor_override)
        return tile_avg_pool(x, layout, *args, what)
    if not layout.width_sharded:
        pool_args = (*args, (ph, pw), ceil_mode, count_include_pad, divisor_override)
        return run_unsharded(x, layout, lambda t: F.avg_pool2d(t, *pool_args))
    height, width, rank = x.shape[2], x.shape[layout.dim], layout.sp_rank
    wp, pad_hi = _pool_plan(what, width, layout.sp_size, kw, sw, 1, pw, ceil_mode)
    win = gather_window(enter(x), wp, rank, layout.sp_group, "zeros", 0.0)
    # In the window every width-padding column is an ordinary zero column, so the local op's
    # divisor is right unless padding must not be counted or a ceil window overhangs.
    if divisor_override or (pad_hi == pw and (count_include_pad or pw == 0)):
        out = F.avg_pool2d(win, *args, (ph, 0), ceil_mode, count_include_pad, divisor_override)
    else:
        sums = F.avg_pool2d(win, *args, (ph, 0), ceil_mode, True, 1)
        o0, o1 = wp.out_bounds[rank]
        fh = _counts(height, kh, sh, ph, 0, sums.shape[2], count_include_pad)
        fw = _counts(width, kw, sw, pw, o0, o1, count_include_pad)
        div = torch.tensor([[a * b for b in fw] for a in fh], dtype=sums.dtype, device=sums.device)
        out = sums / div
    return leave(out, layout, (x.shape[0], *out.shape[1:3], wp.out_width))


# ---------------------------------------------------------------- adaptive pooling


def adaptive_bounds(size: int, out: int, lo: int = 0, hi: int | None = None) -> Segments:
    """Input ``[start, end)`` of adaptive-pooling outputs ``[lo, hi)`` (PyTorch's rule)."""
    hi = out if hi is None else hi
    return tuple(((j * size) // out, -(-((j + 1) * size) // out)) for j in range(lo, hi))


@functools.lru_cache(maxsize=1024)
def _adaptive_exchange(what: str, width: int, out: int, parts: int) -> ExchangePlan:
    """Columns (or a volume's planes) each rank gathers to compute its chunk of ``out``
    adaptive outputs (DTensor chunking; none for a rank that gets no output when ``out <
    parts``). Raises ``SpatialShardingError`` (naming ``what``) when a window reads columns
    beyond the neighbouring strips."""
    owned = check_strips(what, width, parts, "input")
    needed = tuple(
        (((o0 * width) // out, -(-(o1 * width) // out)),) if o0 < o1 else ()
        for o0, o1 in all_shard_bounds(out, parts)
    )
    plan = ExchangePlan(width, tuple(owned), needed)
    plan.check_neighbours(what)
    return plan


def _own_segments(win: Segments, a: int, b: int) -> Segments:
    """The parts of the global segments ``win`` inside a rank's columns ``[a, b)``, in
    local indices (an empty ``(i, i)`` where a segment misses them)."""
    return tuple((min(max(s, a), b) - a, max(min(e, b), a) - a) for s, e in win)


def _segment_sums(g: Tensor, segs: Segments) -> Tensor:
    """Sums of ``g`` over column segments (local indices), last dim = segment."""
    if segs == ((0, g.shape[-1]),):
        return g.sum(-1, keepdim=True)
    # float64 prefix sums: the differences of neighbouring prefixes stay exact to fp32
    c = F.pad(g.double().cumsum(-1), (1, 0))
    starts = torch.tensor([s for s, _ in segs], device=g.device)
    ends = torch.tensor([e for _, e in segs], device=g.device)
    return (c.index_select(-1, ends) - c.index_select(-1, starts)).to(g.dtype)


def _segment_max(g: Tensor, segs: Segments) -> tuple[Tensor, Tensor]:
    """Max of ``g`` over column segments and the (first) column where it is reached;
    an empty segment gives ``-inf`` at column ``g.shape[-1]``."""
    w = g.shape[-1]
    if segs == ((0, w),):
        return g.max(-1, keepdim=True)
    length = max(1, *(e - s for s, e in segs))
    # every segment padded to the same length by repeating its last column (a repeat never
    # wins: max() returns the first maximum), empty segments read the -inf column w
    idx = torch.tensor(
        [[s + min(t, e - s - 1) if e > s else w for t in range(length)] for s, e in segs],
        device=g.device,
    )
    gp = F.pad(g, (0, 1), value=float("-inf"))
    vals = gp.index_select(-1, idx.flatten()).unflatten(-1, idx.shape)
    v, arg = vals.max(-1)
    col = idx.expand(*arg.shape, length).gather(-1, arg.unsqueeze(-1)).squeeze(-1)
    return v, col


def _adaptive_local(g: Tensor, oh: int, segs: Segments, lens: list[int], kind: str):
    """Adaptive pool of ``g`` to ``oh`` rows (PyTorch's rule) and the given column segments
    (averages divide by ``lens``, the global window widths). Max: width first then height,
    so ties resolve in row-major order as in PyTorch; returns ``(values, row, column)``."""
    nseg = len(segs)
    if kind == "avg":
        rows = F.adaptive_avg_pool2d(g, (oh, g.shape[-1]))  # heights only
        div = torch.tensor(lens, dtype=g.dtype, device=g.device)
        return _segment_sums(rows, segs) / div, None, None
    v, col = _segment_max(g, segs)
    v, hidx = F.adaptive_max_pool2d(v, (oh, nseg), return_indices=True)
    row = hidx // nseg
    return v, row, col.gather(-2, row)


class _SumReplicated(torch.autograd.Function):
    """All-reduce (sum) per-rank partial results into a replicated tensor. The gradient of
    the Replicate output reaches every rank whole (``from_local``'s backward redistributes
    it), and each partial entered the sum once, so the backward is the identity."""

    @staticmethod
    def forward(ctx, t: Tensor, group) -> Tensor:
        return sum_now(t.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _adaptive_pool2d(x: DTensor, output_size, kind: str, return_indices: bool, what: str):
    """Adaptive ``kind`` ("avg"/"max") pooling of a width-sharded DTensor."""
    size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    oh, ow = (int(o) if o is not None else n for o, n in zip(size, x.shape[2:], strict=True))
    if oh < 1 or ow < 1:
        raise ValueError(f"{what}: output size must be positive, got {output_size}")
    x, layout = spatial_layout(x, what, tiles=True)
    if layout.is_tile:
        from ._tiles_ops import tile_adaptive_pool  # imports this module

        return tile_adaptive_pool(x, layout, (oh, ow), kind, return_indices, what)
    if not layout.width_sharded:
        pool = F.adaptive_avg_pool2d if kind == "avg" else F.adaptive_max_pool2d
        if not return_indices:
            return run_unsharded(x, layout, lambda t: pool(t, (oh, ow)))
        out = run_unsharded(x, layout, lambda t: pool(t, (oh, ow), True)[0])
        idx = pool(x.to_local().detach(), (oh, ow), True)[1]
        return out, leave(idx, layout, tuple(out.shape))
    n, rank, group, width = layout.sp_size, layout.sp_rank, layout.sp_group, x.shape[layout.dim]
    local = enter(x)
    # A global pool (one output column) is Replicate even on one rank, so that flatten +
    # Linear heads see the same layout at every world size.
    if ow > 1 and all(a < b for a, b in all_shard_bounds(ow, n)):
        plan = _adaptive_exchange(what, width, ow, n)
        g = gather_columns(local, plan, rank, group)
        lo = plan.needed[rank][0][0]
        o0, o1 = all_shard_bounds(ow, n)[rank]
        win = adaptive_bounds(width, ow, o0, o1)
        segs = tuple((s - lo, e - lo) for s, e in win)
        v, row, col = _adaptive_local(g, oh, segs, [e - s for s, e in win], kind)
        shape = (x.shape[0], *v.shape[1:3], ow)
        if not return_indices:
            return leave(v, layout, shape)
        return leave(v, layout, shape), leave(row * width + col + lo, layout, shape)
    # Reduce path: partial results over this rank's own columns for every output column.
    a, b = all_shard_bounds(width, n)[rank]
    win = adaptive_bounds(width, ow)
    segs = _own_segments(win, a, b)
    if b == a:  # empty strip: one neutral column keeps the local ops well defined
        local = F.pad(local, (0, 1), value=0.0 if kind == "avg" else float("-inf"))
    v, row, col = _adaptive_local(local, oh, segs, [e - s for s, e in win], kind)
    d, pl = layout.sp_dim, layout.placements
    rep = SpatialLayout(layout.mesh, (*pl[:d], Replicate(), *pl[d + 1 :]), d)
    shape = (x.shape[0], *v.shape[1:3], ow)
    if kind == "avg":
        return leave(_SumReplicated.apply(v, group) if n > 1 else v, rep, shape)
    valid = col < (b - a)
    gidx = row * width + col + a
    best = v.detach().clone()
    dist.all_reduce(best, dist.ReduceOp.MAX, group=group)
    # ties between ranks: the smallest global (row-major) index wins, as on one device
    cand = torch.where(valid & (v.detach() == best), gidx, torch.iinfo(gidx.dtype).max)
    dist.all_reduce(cand, dist.ReduceOp.MIN, group=group)
    out = torch.where(valid & (gidx == cand), v, best)  # only the owner passes the gradient
    if not return_indices:
        return leave(out, rep, shape)
    return leave(out, rep, shape), leave(cand, rep, shape)


def spatial_adaptive_avg_pool2d(x: DTensor, output_size, what: str = "adaptive_avg_pool2d"):
    """``F.adaptive_avg_pool2d`` on a width-sharded DTensor: ``Shard(3)`` output when every
    rank gets an output column, else ``Replicate`` on the sp mesh dimension (global pooling)."""
    return _adaptive_pool2d(x, output_size, "avg", False, what)


def spatial_adaptive_max_pool2d(
    x: DTensor, output_size, return_indices: bool = False, what: str = "adaptive_max_pool2d"
):
    """``F.adaptive_max_pool2d`` on a width-sharded DTensor (placements as for the average;
    ties go to the first element in row-major order and indices are global, as in torch)."""
    return _adaptive_pool2d(x, output_size, "max", return_indices, what)


# ---------------------------------------------------------------- modules and functions


def _what(module: nn.Module) -> str:
    base = type(module).__mro__[1].__name__
    return f"{getattr(module, 'spatial_name', '') or '<module>'} ({base}({module.extra_repr()}))"


@register_spatial_module(nn.MaxPool2d)
class SpatialMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that runs width-sharded on a ``Shard(3)`` DTensor input."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return spatial_max_pool2d(x, *args, self.return_indices, what=_what(self))


@register_spatial_module(nn.AvgPool2d)
class SpatialAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` that runs width-sharded on a ``Shard(3)`` DTensor input."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode)
        args += (self.count_include_pad, self.divisor_override)
        return spatial_avg_pool2d(x, *args, what=_what(self))


@register_spatial_module(nn.AdaptiveAvgPool2d)
class SpatialAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on a ``Shard(3)`` DTensor (``Replicate`` output when the
    output width cannot give every spatial rank a column, e.g. global pooling)."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        return spatial_adaptive_avg_pool2d(x, self.output_size, what=_what(self))


@register_spatial_module(nn.AdaptiveMaxPool2d)
class SpatialAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` on a ``Shard(3)`` DTensor (indices are global, into H*W)."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return super().forward(x)
        size, ri = self.output_size, self.return_indices
        return spatial_adaptive_max_pool2d(x, size, ri, what=_what(self))


def _register(fn, *functions, pair_after: int = 0) -> None:
    """Route ``functions`` to ``fn``. ``pair_after`` marks functions that always return
    ``(values, indices)``: only their first ``pair_after`` positionals are geometry (the
    ``*_with_indices`` forms carry a ``return_indices`` after them that they ignore)."""
    what = "F." + functions[0].__name__.removesuffix("_with_indices")

    def handler(*args, **kwargs):
        if pair_after:
            args = args[:pair_after]
            kwargs = {k: v for k, v in kwargs.items() if k != "return_indices"}
            kwargs["return_indices"] = True
        return fn(*args, what=what, **kwargs)

    register_handler(*functions)(handler)


# F.max_pool2d and F.adaptive_max_pool2d dispatch on return_indices: SpatialMode sees the
# dispatcher itself (-> tensor or pair) or a function that always returns a pair
# (F.*_with_indices, and torch._C._nn.adaptive_max_pool2d despite its name).
_nn = torch._C._nn
_register(spatial_max_pool2d, F.max_pool2d, torch.max_pool2d)
_register(spatial_max_pool2d, F.max_pool2d_with_indices, _nn.max_pool2d_with_indices, pair_after=6)
_register(spatial_avg_pool2d, F.avg_pool2d)  # torch._C._nn.avg_pool2d is the same object
_register(spatial_adaptive_avg_pool2d, F.adaptive_avg_pool2d, _nn.adaptive_avg_pool2d)
_register(spatial_adaptive_max_pool2d, F.adaptive_max_pool2d)
_register(
    spatial_adaptive_max_pool2d,
    F.adaptive_max_pool2d_with_indices,
    _nn.adaptive_max_pool2d,
    pair_after=2,
)
