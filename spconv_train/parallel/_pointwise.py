"""Element-wise activations and dropout on width-sharded DTensors, run on the local strip.

An element-wise op needs no halo, so it is exact on each strip. DTensor runs many of them
itself but lacks backward strategies for some (``hardswish_backward``,
``hardsigmoid_backward`` in torch 2.14, used by MobileNetV3), so the functional forms are
all routed here: the plain op runs on the local tensor and autograd does the rest.
In-place variants run out of place (an in-place op on a DTensor's local view would bypass
autograd's view tracking).

Dropout: every rank draws its own mask for its own strip, so a sharded run is *not*
bit-identical to a single-device run while dropout is active (compare with ``p=0`` or in
eval mode; ``spconv-train verify`` does so). What is kept: each call consumes exactly one
draw of the global RNG on every rank, so the RNG streams of all ranks stay in step, and
``dropout2d``'s channel mask (one value per sample and channel) is the same on every strip
of an image, as a whole-image channel dropout must be.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._geometry import SpatialShardingError
from ._mode import register_function

_ELEMENTWISE = (
    "relu",
    "relu6",
    "hardswish",
    "hardsigmoid",
    "hardtanh",
    "silu",
    "gelu",
    "leaky_relu",
    "elu",
    "selu",
    "celu",
    "mish",
    "softplus",
    "logsigmoid",
)


def _wrap(x: DTensor, local_out: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local_out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def _local(x: DTensor, what: str) -> torch.Tensor:
    if any(p.is_partial() for p in x.placements):
        raise SpatialShardingError(f"{what} on a Partial DTensor {x.placements}: not element-wise")
    return x.to_local()


def _make_local_handler(name: str):
    fn = getattr(F, name)
    try:
        sig = inspect.signature(fn)
    except ValueError:  # a builtin (e.g. gelu): no in-place flag to clear
        sig = None

    def handler(input, *args, **kwargs):
        if not isinstance(input, DTensor):
            return fn(input, *args, **kwargs)
        local = _local(input, f"F.{name}")
        if sig is None:
            return _wrap(input, fn(local, *args, **kwargs))
        bound = sig.bind(input, *args, **kwargs)
        if "inplace" in sig.parameters:
            bound.arguments["inplace"] = False
        bound.arguments["input"] = local
        return _wrap(input, fn(*bound.args, **bound.kwargs))

    handler.__name__ = f"spatial_{name}"
    return handler


for _name in _ELEMENTWISE:
    register_function(_name)(_make_local_handler(_name))


def _step_seed() -> int:
    """One draw of the global RNG (the same on every rank with the same seed history)."""
    return int(torch.randint(0, 2**62, (1,)).item())


@register_function("dropout")
def _dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """Element-wise dropout of the local strip with a per-rank mask (see module docstring)."""
    if not isinstance(input, DTensor):
        return F.dropout(input, p, training, inplace)
    if not training or p == 0.0:
        return input
    local = _local(input, "F.dropout")
    g = torch.Generator(device=local.device)
    g.manual_seed(_step_seed() + 1 + input.device_mesh.get_rank())
    keep = torch.rand(local.shape, generator=g, device=local.device, dtype=local.dtype) >= p
    return _wrap(input, local * keep / (1.0 - p))


@register_function("dropout2d")
def _dropout2d(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """Channel dropout: one mask per (sample, channel), identical on every strip of an image."""
    if not isinstance(input, DTensor):
        return F.dropout2d(input, p, training, inplace)
    if not training or p == 0.0:
        return input
    local = _local(input, "F.dropout2d")
    g = torch.Generator(device=local.device)
    seed = _step_seed()
    # Same seed on the ranks of one image's strips; the dp rank picks the batch part.
    batch_part = 0
    for i, pl in enumerate(input.placements):
        if pl.is_shard() and pl.dim == 0:
            mesh = input.device_mesh
            batch_part = batch_part * mesh.size(i) + mesh.get_local_rank(i)
    g.manual_seed(seed + batch_part)
    mask = torch.rand((*local.shape[:2], 1, 1), generator=g, device=local.device) >= p
    return _wrap(input, local * mask.to(local.dtype) / (1.0 - p))
