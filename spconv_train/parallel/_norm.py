"""Sharded batch (and sync batch), group and instance norm on every layout, modules and
functionals: statistics over ``layout.stat_groups`` (batch norm, as SyncBatchNorm) or the
spatial groups; running statistics as torch's on every rank (arithmetic: ``_norm_stats``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._compile import not_traced
from ._conv import spatial_subclasses
from ._dims import mesh_group
from ._errors import module_label
from ._halo import sum_grad_over
from ._layout import reshape_kept
from ._mode import register_handler, spatial_module
from ._norm_stats import _Cells, _moments, _Normalize
from ._sharding import SpatialLayout, enter, leave, spatial_layout
from ._small_sum import sum_now


def _layout(x: DTensor, what: str, num_groups: int = 1, **params: Tensor | None) -> tuple:
    """``(x, layout, (N, C, H, W))``, a volume's D and H as one (statistics only count
    elements: they run on that 4-D view); checked in torch's order: the channels divisible
    by ``num_groups``, then the per-channel ``params``."""
    x, layout = spatial_layout(x, what, ndim=5 if x.ndim == 5 else 4, tiles=True)
    s = x.shape  # (one read: a DTensor's shape goes through the spatial mode)
    nchw = (s[0], s[1], math.prod(s[2:-1]), s[-1])
    if nchw[1] % num_groups:
        raise RuntimeError(
            f"{what}: Expected number of channels in input to be divisible by num_groups, "
            f"but got input of shape {list(x.shape)} and num_groups={num_groups}"
        )
    for name, t in params.items():
        if t is not None and t.numel() != nchw[1]:
            raise ValueError(f"{what}: {name} has {t.numel()} elements for {nchw[1]} channels")
    return x, layout, nchw


@not_traced  # a hand-written one-pass backward, and collectives (see _compile.py)
def _normalize(x: DTensor, layout: SpatialLayout, cells: _Cells, weight, bias, eps: float):
    """``(output, mean, biased variance)`` of ``x`` normalised with global ``cells``."""
    local = enter(x)
    shape = local.shape
    if local.ndim != 4:  # the same statistics on the 4-D view of the local part (``_layout``)
        local = local.flatten(2, -2)
    groups = layout.grad_groups
    reduce_affine = cells.groups == groups  # batch norm: affine gradients ride on the stats'
    if not reduce_affine:
        weight, bias = sum_grad_over(weight, groups), sum_grad_over(bias, groups)
    # plain local tensors: skip the spatial mode (its cost: docs/benchmarks.md, fused batch norm)
    with torch._C.DisableTorchFunction():
        mean, var = _moments(local, cells)  # under no_grad
        y = _Normalize.apply(local, weight, bias, mean, var, eps, cells, reduce_affine)
    return leave(reshape_kept(y, shape), layout, tuple(x.shape)), mean, var


def _normalize_with(x: DTensor, layout, mean, var, weight, bias, eps: float) -> DTensor:
    """Normalise with given (running) per-channel statistics: elementwise, no reduction."""
    w, b = sum_grad_over(weight, layout.grad_groups), sum_grad_over(bias, layout.grad_groups)
    y = F.batch_norm(enter(x), mean, var, w, b, False, 0.0, eps)
    return leave(y, layout, tuple(x.shape))


@torch.no_grad()
def _update(pairs: tuple[tuple[Tensor | None, Tensor], ...], momentum: float) -> None:
    """``running = momentum * value + (1 - momentum) * running``, all pairs in three ops."""
    running = [r for r, _ in pairs if r is not None]
    values = [v if v.dim() == 1 else v.reshape(-1) for r, v in pairs if r is not None]
    if not running:
        return
    with torch._C.DisableTorchFunction():  # plain tensors: skip the mode (see _normalize)
        if len({t.dtype for t in running + values}) > 1:  # mixed: promoted, then written
            for r, v in zip(running, values, strict=True):
                r.copy_(momentum * v + (1 - momentum) * r)
            return
        torch._foreach_mul_(running, 1 - momentum)
        torch._foreach_add_(running, torch._foreach_mul(values, momentum))


def spatial_batch_norm(
    input: DTensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    what: str = "batch_norm",
) -> DTensor:
    """``F.batch_norm`` of a sharded DTensor (training: global batch statistics)."""
    params = dict(weight=weight, bias=bias, mean=running_mean, var=running_var)
    x, layout, (n, c, h, w) = _layout(input, what, **params)
    if not training:
        return _normalize_with(x, layout, running_mean, running_var, weight, bias, eps)
    if n * h * w == 1:
        raise ValueError(f"{what}: Expected more than 1 value per channel, got {list(x.shape)}")
    if eps <= 0.0:
        raise ValueError(f"{what}: batch_norm eps must be positive during training, got {eps}")
    count = n * h * w
    cells = _Cells("batch", c, c, count, layout.stat_groups)
    y, mean, var = _normalize(x, layout, cells, weight, bias, eps)
    _update(((running_mean, mean), (running_var, var * (count / (count - 1)))), momentum)
    return y


def spatial_group_norm(
    input: DTensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    what: str = "group_norm",
) -> DTensor:
    """``F.group_norm`` of a sharded DTensor."""
    x, layout, (n, c, h, w) = _layout(input, what, num_groups, weight=weight, bias=bias)
    count = c // num_groups * h * w
    if n * count == 1:
        raise ValueError(f"{what}: Expected more than 1 value per channel, got {list(x.shape)}")
    cells = _Cells("group", c, num_groups, count, layout.spatial_groups)
    return _normalize(x, layout, cells, weight, bias, eps)[0]


def spatial_instance_norm(
    input: DTensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    what: str = "instance_norm",
) -> DTensor:
    """``F.instance_norm`` of a sharded DTensor (running statistics as torch's)."""
    params = dict(weight=weight, bias=bias, mean=running_mean, var=running_var)
    x, layout, (n, c, h, w) = _layout(input, what, **params)
    if not use_input_stats:
        return _normalize_with(x, layout, running_mean, running_var, weight, bias, eps)
    count = h * w
    if count == 1:
        raise ValueError(f"{what}: Expected more than 1 spatial element, got {list(x.shape)}")
    cells = _Cells("instance", c, c, count, layout.spatial_groups)
    y, mean, var = _normalize(x, layout, cells, weight, bias, eps)
    if running_mean is not None or running_var is not None:
        # (the same per-sample statistics on the spatial group: summed over the batch dims)
        spatial = layout.spatial_mesh_dims
        dp = [mesh_group(layout.mesh, i) for i in layout.batch_dims if i not in spatial]
        avg = torch.stack([mean.sum(0), (var * (count / (count - 1))).sum(0)])
        avg = sum_now(avg.contiguous(), *dp) / n
        _update(((running_mean, avg[0]), (running_var, avg[1])), momentum)
    return y


class _SpatialBatchNorm:
    """``_BatchNorm.forward`` (torch 2.14) running ``spatial_batch_norm`` on a DTensor input:
    statistics over the global batch and image (SyncBatchNorm: over the input's mesh, its
    ``process_group`` unused)."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super().forward(x)
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats  # running stats to use or update
        rm, rv = (self.running_mean, self.running_var) if keep else (None, None)
        args = (rm, rv, self.weight, self.bias, batch_stats, factor, self.eps)
        return spatial_batch_norm(x, *args, what=module_label(self))


SpatialBatchNorm2d, SpatialBatchNorm3d, SpatialSyncBatchNorm = spatial_subclasses(
    _SpatialBatchNorm, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, module=__name__
)
_NORM_ARGS = ("num_groups", "weight", "bias", "eps")
SpatialGroupNorm = spatial_module(nn.GroupNorm, spatial_group_norm, *_NORM_ARGS, module=__name__)


class _SpatialInstanceNorm:
    """``_InstanceNorm`` running ``spatial_instance_norm`` on a DTensor input."""

    def _apply_instance_norm(self, x: Tensor) -> Tensor:
        if not isinstance(x, DTensor):
            return super()._apply_instance_norm(x)
        batch_stats = self.training or not self.track_running_stats
        momentum = self.momentum if self.momentum is not None else 0.0
        args = (self.running_mean, self.running_var, self.weight, self.bias, batch_stats, momentum)
        return spatial_instance_norm(x, *args, self.eps, what=module_label(self))


SpatialInstanceNorm2d, SpatialInstanceNorm3d = spatial_subclasses(
    _SpatialInstanceNorm, nn.InstanceNorm2d, nn.InstanceNorm3d, module=__name__
)


def _weight_first(fn, what: str):
    """A handler of ``torch.batch_norm`` / ``torch.instance_norm`` (weight and bias first, a
    required ``cudnn_enabled`` last) calling ``fn``."""

    def handler(input, weight, bias, running_mean, running_var, *args, **kwargs):
        kwargs.pop("cudnn_enabled", None)
        return fn(input, running_mean, running_var, weight, bias, *args[:3], what=what, **kwargs)

    return handler


for _fn, _name in ((spatial_batch_norm, "batch_norm"), (spatial_instance_norm, "instance_norm")):
    register_handler(getattr(F, _name))(functools.partial(_fn, what=f"F.{_name}"))
    register_handler(getattr(torch, _name))(_weight_first(_fn, f"torch.{_name}"))


@register_handler(F.group_norm, torch.group_norm)  # same leading arguments
def _functional_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return spatial_group_norm(input, num_groups, weight, bias, eps, "F.group_norm")
