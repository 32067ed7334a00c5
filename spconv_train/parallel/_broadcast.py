"""Element-wise arithmetic between a sharded DTensor and a plain tensor (a parameter, a mask).

Model code multiplies activations by parameters it reshapes itself (timm ConvNeXt's layer
scale ``x.mul(self.gamma.reshape(1, -1, 1, 1))``) or by masks it draws (EfficientNet's
drop-connect ``x / keep * mask``); DTensor refuses a plain tensor next to a DTensor. The
plain tensor is the global value (the same on every rank): each rank uses the part that
meets its strip (all of it along size-1, broadcast dims; its chunk along a sharded dim), and
its gradient, a partial sum over the local strip, is summed over the mesh dimensions that
shard the activation (``sum_grad_over``), so it equals the single-device gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._dims import handled, mesh_group, mesh_rank, sharded_dims, wrap
from ._geometry import shard_bounds
from ._halo import sum_grad_over
from ._mode import register_handler

#: the arithmetic ops (handlers here, in ``_tokens.py`` and in ``_token_prefix.py``):
#: ``torch.add`` ... ``Tensor.div`` and the operators ``__add__``, ``__radd__`` ...
ARITH = [getattr(m, n) for n in ("add", "sub", "mul", "div") for m in (torch, Tensor)]
ARITH += [
    getattr(Tensor, f"__{r}{n}__") for n in ("add", "sub", "mul", "truediv") for r in ("", "r")
]


def _local_part(plain: Tensor, x: DTensor) -> Tensor:
    """The part of ``plain`` (broadcast against ``x``'s global shape) that meets this rank's
    local tensor, with its gradient summed over the groups sharding ``x``."""
    groups = tuple(mesh_group(x.device_mesh, i) for d, i in sharded_dims(x).items())
    part = sum_grad_over(plain, groups)
    lead = x.ndim - part.ndim
    for d, i in sharded_dims(x).items():
        k = d - lead
        if k >= 0 and part.shape[k] != 1:
            a, b = shard_bounds(x.shape[d], x.device_mesh.size(i), mesh_rank(x.device_mesh, i))
            part = part.narrow(k, a, b - a)
    return part


def _make(func):
    def handler(a, b, *args, **kwargs):
        dt, plain = (a, b) if isinstance(a, DTensor) else (b, a)
        if (
            not handled(dt)
            or not isinstance(plain, Tensor)
            or isinstance(plain, DTensor)
            or plain.ndim > dt.ndim
        ):
            return func(a, b, *args, **kwargs)
        try:
            shape = torch.broadcast_shapes(dt.shape, plain.shape)
        except RuntimeError:
            return func(a, b, *args, **kwargs)
        part = _local_part(plain, dt)
        la, lb = (dt.to_local(), part) if a is dt else (part, dt.to_local())
        out = func(la, lb, *args, **kwargs)
        return wrap(out, dt, dt.placements, shape)

    handler.__name__ = f"spatial_{func.__name__}"
    return handler


for _fn in ARITH:
    register_handler(_fn)(_make(_fn))
