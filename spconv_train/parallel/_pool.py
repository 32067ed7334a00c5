"""Spatial pooling: the public functions, modules and torch-function routes of max, average
and adaptive pooling of NCHW images and NCDHW volumes, on strips, tiles and blocks alike.

Each name is a thin front over one implementation per family: ``_pooling.py`` (max and
average pooling: halos of every sharded dim, the unchanged local op) and ``_adaptive.py``
(adaptive pooling: separable window reductions with torch's tie-break, ``Shard`` or
``Replicate`` output). Volumes refuse ``return_indices`` (there is no sharded
``MaxUnpool3d`` to use them either).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._adaptive import adaptive_pool
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._pooling import avg_pool, max_pool, pool_args


def _no_volume_indices(return_indices: bool, what: str) -> None:
    if return_indices:
        raise SpatialShardingError(
            f"{what}: return_indices is not supported on a sharded volume (no MaxUnpool3d "
            f"either); use the values only"
        )


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
    """``F.max_pool2d`` on a sharded DTensor (same values, gradients and, with
    ``return_indices``, the same global indices into the flattened ``H*W`` input)."""
    k, s, p, d = pool_args(2, kernel_size, stride, padding, dilation)
    return max_pool(x, k, s, p, d, ceil_mode, return_indices, what)


def spatial_max_pool3d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    what: str = "max_pool3d",
) -> DTensor:
    """``F.max_pool3d`` on a sharded volume (same values and gradients)."""
    k, s, p, d = pool_args(3, kernel_size, stride, padding, dilation)
    _no_volume_indices(return_indices, what)
    return max_pool(x, k, s, p, d, ceil_mode, False, what)


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
    """``F.avg_pool2d`` on a sharded DTensor; padding and ceil-mode overhang are counted
    exactly as PyTorch counts them on the whole image."""
    k, s, p, _ = pool_args(2, kernel_size, stride, padding)
    return avg_pool(x, k, s, p, ceil_mode, count_include_pad, divisor_override, what)


def spatial_avg_pool3d(
    x: DTensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    what: str = "avg_pool3d",
) -> DTensor:
    """``F.avg_pool3d`` on a sharded volume; padding and ceil-mode overhang are counted
    exactly as PyTorch counts them on the whole volume."""
    k, s, p, _ = pool_args(3, kernel_size, stride, padding)
    return avg_pool(x, k, s, p, ceil_mode, count_include_pad, divisor_override, what)


def _out_sizes(output_size, shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``output_size`` (an int or a sequence, ``None`` = keep that size) as one int per
    spatial dim of ``shape``."""
    n = len(shape)
    size = (output_size,) * n if isinstance(output_size, int) else tuple(output_size)
    if len(size) != n:
        raise ValueError(f"{what}: output_size {output_size} must give {n} sizes")
    out = tuple(int(o) if o is not None else m for o, m in zip(size, shape, strict=True))
    if min(out) < 1:
        raise ValueError(f"{what}: output size must be positive, got {output_size}")
    return out


def spatial_adaptive_avg_pool2d(x: DTensor, output_size, what: str = "adaptive_avg_pool2d"):
    """``F.adaptive_avg_pool2d`` on a sharded DTensor: the input's ``Shard`` when every
    rank gets an output column, else ``Replicate`` on the spatial mesh dims (global
    pooling; tiles: small outputs only)."""
    return adaptive_pool(x, _out_sizes(output_size, x.shape[2:4], what), "avg", False, what)


def spatial_adaptive_max_pool2d(
    x: DTensor, output_size, return_indices: bool = False, what: str = "adaptive_max_pool2d"
):
    """``F.adaptive_max_pool2d`` on a sharded DTensor (placements as for the average;
    ties go to the first element in row-major order and indices are global, as in torch)."""
    out = _out_sizes(output_size, x.shape[2:4], what)
    return adaptive_pool(x, out, "max", return_indices, what)


def spatial_adaptive_avg_pool3d(x: DTensor, output_size, what: str = "adaptive_avg_pool3d"):
    """``F.adaptive_avg_pool3d`` on a sharded volume: the input's ``Shard`` when the sharded
    dim is pooled to more than one plane, else ``Replicate`` (global pooling)."""
    return adaptive_pool(x, _out_sizes(output_size, x.shape[2:5], what), "avg", False, what)


def spatial_adaptive_max_pool3d(
    x: DTensor, output_size, return_indices: bool = False, what: str = "adaptive_max_pool3d"
):
    """``F.adaptive_max_pool3d`` on a sharded volume (placements as for the average; ties go
    to the first element in row-major order, as in torch)."""
    out = _out_sizes(output_size, x.shape[2:5], what)
    _no_volume_indices(return_indices, what)
    return adaptive_pool(x, out, "max", False, what)


# ---------------------------------------------------------------- modules and functions


def _what(module: nn.Module) -> str:
    """The module's error label, computed once (``parallelize`` names it before a forward)."""
    label = module.__dict__.get("_spatial_label")
    if label is None:
        base = type(module).__mro__[1].__name__
        name = getattr(module, "spatial_name", "") or "<module>"
        label = module.__dict__["_spatial_label"] = f"{name} ({base}({module.extra_repr()}))"
    return label


def _forward(base: type, fn, *attrs: str):
    """A ``forward`` that runs ``base``'s own on a plain tensor and ``fn(x, *attributes)``
    on a DTensor."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return base.forward(self, x)
        return fn(x, *(getattr(self, a) for a in attrs), what=_what(self))

    return forward


_MAX = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


@register_spatial_module(nn.MaxPool2d)
class SpatialMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that runs sharded on a DTensor input (strips or tiles)."""

    forward = _forward(nn.MaxPool2d, spatial_max_pool2d, *_MAX)


@register_spatial_module(nn.AvgPool2d)
class SpatialAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` that runs sharded on a DTensor input (strips or tiles)."""

    forward = _forward(nn.AvgPool2d, spatial_avg_pool2d, *_AVG)


@register_spatial_module(nn.AdaptiveAvgPool2d)
class SpatialAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on a sharded DTensor (``Replicate`` output when the output
    width cannot give every spatial rank a column, e.g. global pooling)."""

    forward = _forward(nn.AdaptiveAvgPool2d, spatial_adaptive_avg_pool2d, "output_size")


@register_spatial_module(nn.AdaptiveMaxPool2d)
class SpatialAdaptiveMaxPool2d(nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` on a sharded DTensor (indices are global, into H*W)."""

    forward = _forward(
        nn.AdaptiveMaxPool2d, spatial_adaptive_max_pool2d, "output_size", "return_indices"
    )


@register_spatial_module(nn.MaxPool3d)
class SpatialMaxPool3d(nn.MaxPool3d):
    """``nn.MaxPool3d`` on a sharded volume (one or several of D, H, W)."""

    forward = _forward(nn.MaxPool3d, spatial_max_pool3d, *_MAX)


@register_spatial_module(nn.AvgPool3d)
class SpatialAvgPool3d(nn.AvgPool3d):
    """``nn.AvgPool3d`` on a sharded volume (one or several of D, H, W)."""

    forward = _forward(nn.AvgPool3d, spatial_avg_pool3d, *_AVG)


@register_spatial_module(nn.AdaptiveAvgPool3d)
class SpatialAdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` on a sharded volume."""

    forward = _forward(nn.AdaptiveAvgPool3d, spatial_adaptive_avg_pool3d, "output_size")


@register_spatial_module(nn.AdaptiveMaxPool3d)
class SpatialAdaptiveMaxPool3d(nn.AdaptiveMaxPool3d):
    """``nn.AdaptiveMaxPool3d`` on a sharded volume (values only)."""

    forward = _forward(
        nn.AdaptiveMaxPool3d, spatial_adaptive_max_pool3d, "output_size", "return_indices"
    )


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


# F.max_pool*d and F.adaptive_max_pool*d dispatch on return_indices: SpatialMode sees the
# dispatcher itself (-> tensor or pair) or a function that always returns a pair
# (F.*_with_indices, and torch._C._nn.adaptive_max_pool*d despite its name); the 3-D pair
# forms are routed so that they refuse clearly instead of gathering. F.avg_pool*d is
# torch._C._nn.avg_pool*d; torch.max_pool*d are separate objects.
_nn = torch._C._nn
_register(spatial_max_pool2d, F.max_pool2d, torch.max_pool2d)
_register(spatial_max_pool2d, F.max_pool2d_with_indices, _nn.max_pool2d_with_indices, pair_after=6)
_register(spatial_max_pool3d, F.max_pool3d, torch.max_pool3d)
_register(spatial_max_pool3d, F.max_pool3d_with_indices, _nn.max_pool3d_with_indices, pair_after=6)
_register(spatial_avg_pool2d, F.avg_pool2d)
_register(spatial_avg_pool3d, F.avg_pool3d)
_register(spatial_adaptive_avg_pool2d, F.adaptive_avg_pool2d, _nn.adaptive_avg_pool2d)
_register(spatial_adaptive_avg_pool3d, F.adaptive_avg_pool3d, _nn.adaptive_avg_pool3d)
_register(spatial_adaptive_max_pool2d, F.adaptive_max_pool2d)
_register(spatial_adaptive_max_pool3d, F.adaptive_max_pool3d)
_pairs = (F.adaptive_max_pool2d_with_indices, _nn.adaptive_max_pool2d)
_register(spatial_adaptive_max_pool2d, *_pairs, pair_after=2)
_pairs = (F.adaptive_max_pool3d_with_indices, _nn.adaptive_max_pool3d)
_register(spatial_adaptive_max_pool3d, *_pairs, pair_after=2)
