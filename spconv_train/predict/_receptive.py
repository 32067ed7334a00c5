"""How far a network looks along the rows: the plan for exact band-streamed prediction.

A band of output rows ``[r0, r1)`` equals the whole-image forward's rows exactly when the
band's input holds enough real context rows above and below (``margin``, so that the
zero padding a layer adds at the band border only ever reaches discarded rows) and when
the band starts on a multiple of the network's total stride (so every pooling / strided
grid of the band coincides with the whole image's grid).

``analyse`` derives both from the network itself: it runs the model once on a small
probe input under a ``TorchFunctionMode`` that sees every convolution, pooling and
resampling call (modules and functional calls alike) with its input/output heights, and
sums each op's window span in input pixels (a span of ``(k - 1) * dilation`` at a
resolution of ``jump`` image pixels per feature row). The total stride is the coarsest
resolution reached. Ops whose output row depends on every input row (adaptive / global
pooling, GroupNorm / InstanceNorm / LayerNorm statistics, reductions over the height)
make the network impossible to stream exactly: the plan then carries the reason.

``check_plan`` is the empirical proof for one image height: it predicts a narrow random
probe column of that very height whole and band by band with the planned geometry and
compares the logits. It catches what the op walk cannot see (e.g. a resampling to a size
computed from the whole image, as FCN's final ``F.interpolate`` does when the height is
not a multiple of 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["CHECK_RTOL", "StreamPlan", "analyse", "check_plan"]

#: ``check_plan`` results up to this are fp32 rounding (different conv blockings), not a
#: band border effect (those are of the order of the logits).
CHECK_RTOL = 1e-4

#: Probe input height (a multiple of every usual total stride, up to 64).
PROBE_HEIGHT = 512
_WINDOW_OPS = {"conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d", "lp_pool2d"}
_GLOBAL_OPS = {
    "adaptive_avg_pool2d": "adaptive (global) average pooling",
    "adaptive_max_pool2d": "adaptive (global) max pooling",
    "group_norm": "GroupNorm (statistics over the whole image)",
    "instance_norm": "InstanceNorm (statistics over the whole image)",
    "layer_norm": "LayerNorm over the spatial dimensions",
}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "std", "var", "logsumexp", "softmax", "cumsum"}


@dataclass(frozen=True)
class StreamPlan:
    """Band geometry of a network: ``stride`` (band starts are multiples of it), ``margin``
    (context rows read on each side of a band's kept rows, a multiple of ``stride``) and
    ``reason`` (why the network cannot be streamed exactly; None when it can)."""

    stride: int
    margin: int
    reason: str | None = None

    @property
    def exact(self) -> bool:
        """Whether band-streamed prediction can equal the whole-image forward."""
        return self.reason is None

    def widened(self) -> StreamPlan:
        """The same plan with twice the margin (still a multiple of the stride)."""
        return StreamPlan(self.stride, 2 * self.margin, self.reason)


def _first_4d(args, kwargs) -> Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and a.dim() == 4:
            return a
    return None


def _pair_first(value) -> int:
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def _window(name: str, args, kwargs) -> int:
    """Window span ``(k - 1) * dilation`` along the rows, in the op's own input (conv) or
    output (transposed conv) pixels."""
    if name in ("conv2d", "conv_transpose2d"):
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        if name == "conv2d":
            dil = kwargs.get("dilation", args[5] if len(args) > 5 else 1)
        else:
            dil = kwargs.get("dilation", args[7] if len(args) > 7 else 1)
        return (weight.shape[2] - 1) * _pair_first(dil)
    kernel = kwargs.get("kernel_size", args[1] if len(args) > 1 else 1)
    dil = kwargs.get("dilation", args[4] if name == "max_pool2d" and len(args) > 4 else 1)
    return (_pair_first(kernel) - 1) * _pair_first(dil)


def _reduces_height(name: str, args, kwargs) -> bool:
    x = args[0] if args and isinstance(args[0], Tensor) else None
    if name not in _REDUCTIONS or x is None or x.dim() != 4 or x.shape[2] < 2:
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        return True
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(int(d) % 4 == 2 for d in dims if isinstance(d, int))


class _RowTracer(TorchFunctionMode):
    """Sums the row spans of every windowed op, in image pixels, and records the coarsest
    resolution and any op that mixes all rows."""

    def __init__(self, height: int) -> None:
        super().__init__()
        self.height, self.span, self.coarsest, self.global_ops = height, 0.0, 1.0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "").lstrip("_")
        if name == "max_pool2d_with_indices":
            name = "max_pool2d"
        x = _first_4d(args, kwargs)
        y = out[0] if isinstance(out, tuple) and out else out
        if x is None or not isinstance(y, Tensor) or y.dim() != 4:
            if _reduces_height(name, args, kwargs):
                self.global_ops.append(f"{name} over the height")
            return out
        jump_in, jump_out = self.height / x.shape[2], self.height / max(y.shape[2], 1)
        if name in _GLOBAL_OPS and not (name == "layer_norm" and len(args[1]) < 2):
            if name.startswith("adaptive") and y.shape[2] == x.shape[2]:
                return out  # keeps the rows: a per-row op
            self.global_ops.append(_GLOBAL_OPS[name])
        elif name == "batch_norm" and kwargs.get("training", args[5] if len(args) > 5 else 0):
            self.global_ops.append("BatchNorm in training mode (batch statistics)")
        elif name in _WINDOW_OPS:
            if name == "conv_transpose2d":  # one input row feeds a window of output rows
                self.span += _window(name, args, kwargs) * jump_out + jump_in
            else:
                self.span += _window(name, args, kwargs) * jump_in
            if y.shape[2] > 1:  # a 1-row output (after global pooling) is no grid
                self.coarsest = max(self.coarsest, jump_out)
        elif name in ("interpolate", "upsample", "upsample_bilinear", "upsample_nearest"):
            self.span += 2 * jump_in  # linear interpolation reads the neighbouring rows
        elif _reduces_height(name, args, kwargs):
            self.global_ops.append(f"{name} over the height")
        return out


def _round_up(n: float, k: int) -> int:
    return int(math.ceil(n / k)) * k


def analyse(model: nn.Module, in_channels: int, *, probe_height: int = PROBE_HEIGHT) -> StreamPlan:
    """The band plan of ``model`` (an ``N x C x H x W -> N x K x H x W`` network in eval
    mode) from one forward of a ``probe_height x 64`` probe on its own device.

    The margin is half the summed row spans (the usual symmetric windows) plus two total
    strides (asymmetric windows, pooling grids), rounded up to the stride: generous for
    U-Nets and ResNets; ``check_plan`` proves it per image height and the caller widens
    it when the proof fails."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    x = torch.rand(1, in_channels, probe_height, 64, generator=torch.Generator().manual_seed(0))
    tracer = _RowTracer(probe_height)
    with torch.no_grad(), tracer:
        model(x.to(device))
    stride = max(1, round(tracer.coarsest))
    reason = None
    if tracer.global_ops:
        reason = "its output rows depend on the whole image: " + ", ".join(
            dict.fromkeys(tracer.global_ops)
        )
    return StreamPlan(stride, _round_up(tracer.span / 2 + 2 * stride, stride), reason)


def check_plan(
    model: nn.Module,
    plan: StreamPlan,
    height: int,
    band_rows: int,
    in_channels: int,
    *,
    width: int | None = None,
    axis: int = 2,
) -> float:
    """Largest difference (relative to the logits' scale) between the whole-image forward
    and the band-streamed forward with ``plan`` and ``band_rows`` of a random probe column
    ``height`` rows tall (``width`` columns, default two total strides: narrow, so the
    proof costs a sliver of the image). At most ``CHECK_RTOL`` means exact up to fp32
    rounding. ``axis=3`` proves column pieces the same way: a probe row ``height``
    columns wide, cut into pieces of ``band_rows`` columns."""
    from ._bands import band_layout

    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    w = width or max(2 * plan.stride, 16)
    gen = torch.Generator().manual_seed(height)
    shape = (1, in_channels, height, w) if axis == 2 else (1, in_channels, w, height)
    x = torch.rand(*shape, generator=gen).to(device)
    with torch.no_grad():
        whole = model(x)
        worst = 0.0
        for band in band_layout(height, band_rows, plan):
            (i0, i1), (r0, r1) = band.read, band.rows
            part = model(x.narrow(axis, i0, i1 - i0)).narrow(axis, r0 - i0, r1 - r0)
            worst = max(worst, float((part - whole.narrow(axis, r0, r1 - r0)).abs().max()))
    return worst / (1.0 + float(whole.abs().max()))
