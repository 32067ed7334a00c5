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
from ._label import module_label
from ._mode import register_handler
from ._parallelize import register_spatial_module
from ._pooling import avg_pool, max_pool, pool_args


def _max_pool(rank: int):
    def spatial_max_pool(
        x: DTensor,
        kernel_size,
        stride=None,
        padding=0,
        dilation=1,
        ceil_mode: bool = False,
        return_indices: bool = False,
        what: str = f"max_pool{rank}d",
    ):
        k, s, p, d = pool_args(rank, kernel_size, stride, padding, dilation)
        _no_volume_indices(rank, return_indices, what)
        return max_pool(x, k, s, p, d, ceil_mode, return_indices, what)

    spatial_max_pool.__doc__ = f"""``F.max_pool{rank}d`` on a sharded DTensor (same values,
    gradients and, for images with ``return_indices``, global indices into ``H*W``)."""
    return spatial_max_pool


def _avg_pool(rank: int):
    def spatial_avg_pool(
        x: DTensor,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
        what: str = f"avg_pool{rank}d",
    ) -> DTensor:
        k, s, p, _ = pool_args(rank, kernel_size, stride, padding)
        return avg_pool(x, k, s, p, ceil_mode, count_include_pad, divisor_override, what)

    spatial_avg_pool.__doc__ = f"""``F.avg_pool{rank}d`` on a sharded DTensor; padding and
    ceil-mode overhang are counted exactly as PyTorch counts them on the whole input."""
    return spatial_avg_pool


def _adaptive_pool(rank: int, kind: str):
    def spatial_adaptive_pool(
        x: DTensor, output_size, return_indices: bool = False, what: str = ""
    ) -> DTensor:
        what = what or f"adaptive_{kind}_pool{rank}d"
        size = (output_size,) * rank if isinstance(output_size, int) else tuple(output_size)
        if len(size) != rank:
            raise ValueError(f"{what}: output_size {output_size} must give {rank} sizes")
        shape = x.shape[2 : 2 + rank]
        out = tuple(int(o) if o is not None else m for o, m in zip(size, shape, strict=True))
        if min(out) < 1:
            raise ValueError(f"{what}: output size must be positive, got {output_size}")
        _no_volume_indices(rank, return_indices, what)
        return adaptive_pool(x, out, kind, return_indices, what)

    spatial_adaptive_pool.__doc__ = f"""``F.adaptive_{kind}_pool{rank}d`` on a sharded DTensor:
    the input's ``Shard`` when every rank gets an output element along its sharded dims,
    else ``Replicate`` on the spatial mesh dims (global pooling); ties go to the first
    element in row-major order and indices are global, as in torch."""
    return spatial_adaptive_pool


def _no_volume_indices(rank: int, return_indices: bool, what: str) -> None:
    if return_indices and rank == 3:
        raise SpatialShardingError(
            f"{what}: return_indices is not supported on a sharded volume (no MaxUnpool3d "
            f"either); use the values only"
        )


def _module(base: type, fn, *attrs: str) -> type:
    """``Spatial<base>``: ``base`` running ``fn(x, *attributes)`` on a DTensor input (its
    own forward on a plain tensor), registered for ``parallelize`` to swap in."""

    def forward(self, x: Tensor):
        if not isinstance(x, DTensor):
            return base.forward(self, x)
        return fn(x, *(getattr(self, a) for a in attrs), what=module_label(self))

    doc = f"``nn.{base.__name__}`` that runs sharded on a DTensor input (any layout)."
    name = f"Spatial{base.__name__}"
    cls = type(name, (base,), {"forward": forward, "__doc__": doc, "__module__": __name__})
    cls.__qualname__ = name
    return register_spatial_module(base)(cls)


_MAX = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
spatial_max_pool2d, spatial_max_pool3d = _max_pool(2), _max_pool(3)
spatial_avg_pool2d, spatial_avg_pool3d = _avg_pool(2), _avg_pool(3)
spatial_adaptive_avg_pool2d = _adaptive_pool(2, "avg")
spatial_adaptive_avg_pool3d = _adaptive_pool(3, "avg")
spatial_adaptive_max_pool2d = _adaptive_pool(2, "max")
spatial_adaptive_max_pool3d = _adaptive_pool(3, "max")
SpatialMaxPool2d = _module(nn.MaxPool2d, spatial_max_pool2d, *_MAX)
SpatialMaxPool3d = _module(nn.MaxPool3d, spatial_max_pool3d, *_MAX)
SpatialAvgPool2d = _module(nn.AvgPool2d, spatial_avg_pool2d, *_AVG)
SpatialAvgPool3d = _module(nn.AvgPool3d, spatial_avg_pool3d, *_AVG)
SpatialAdaptiveAvgPool2d = _module(nn.AdaptiveAvgPool2d, spatial_adaptive_avg_pool2d, "output_size")
SpatialAdaptiveAvgPool3d = _module(nn.AdaptiveAvgPool3d, spatial_adaptive_avg_pool3d, "output_size")
_ADAPTIVE_MAX = ("output_size", "return_indices")
SpatialAdaptiveMaxPool2d = _module(
    nn.AdaptiveMaxPool2d, spatial_adaptive_max_pool2d, *_ADAPTIVE_MAX
)
SpatialAdaptiveMaxPool3d = _module(
    nn.AdaptiveMaxPool3d, spatial_adaptive_max_pool3d, *_ADAPTIVE_MAX
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
