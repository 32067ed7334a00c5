"""The way in and out of DTensor at the spatial layers' boundaries, its metadata cached
(docs/design.md, ``_dtensor_wrap.py``'s row): ``DTensor.from_local`` builds a spec per call
and ``to_local``'s backward another, for the same few layouts. Its DTensor internals (torch
2.14.1) are checked against the public API by ``tests/test_dtensor_wrap.py``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor

__all__ = ["local_of", "wrap_local"]

#: ``(id(mesh), placements, their types, shape, stride, dtype) -> (mesh, DTensorSpec)``;
#: each entry holds its mesh, so its id cannot be reused while cached
_SPECS: dict[tuple, tuple] = {}
#: ``(forward spec, grad_placements, grad shape, grad stride, grad dtype, forward local
#: stride) -> gradient DTensorSpec`` (``local_of``'s backward)
_GRAD_SPECS: dict[tuple, object] = {}
#: bounded: shapes that change every step (e.g. random crops) must not grow them forever
_MAX_ENTRIES = 4096
_PLAIN = (Shard, Replicate)


#: ``DTensor(local, spec, requires_grad=...)`` without the call of ``DTensor.__init__``:
#: torch 2.14's ``__init__`` only calls ``Tensor.__init__`` (a no-op), behind
#: ``torch._disable_dynamo`` and an export marker (~2 us and seven Python calls a
#: construction here); ``__new__`` (torch's C++ ``_dtensor__new__``) builds the DTensor and
#: sets ``_spec`` and ``_local_tensor``. Eager code only: under ``torch.compile`` the public
#: functions run (module docstring), under ``torch.export`` the constructor with its marker.
_FAST_NEW = DTensor.__new__ is getattr(torch.Tensor, "_dtensor__new__", None)


def _dtensor(local: Tensor, spec, requires_grad: bool) -> DTensor:
    if _FAST_NEW and not torch.compiler.is_exporting():
        return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)
    return DTensor(local, spec, requires_grad=requires_grad)


def _remember(cache: dict, key: tuple, value) -> None:
    if len(cache) >= _MAX_ENTRIES:
        cache.clear()
    cache[key] = value


class _FromLocal(torch.autograd.Function):
    """``DTensor.from_local`` with a prepared spec: the same DTensor, torch's backward."""

    @staticmethod
    def forward(ctx, local: Tensor, spec) -> DTensor:  # type: ignore[override]
        ctx.forward_input_placements = spec.placements
        ctx.forward_input_device_mesh = spec.mesh
        ctx.grad_placements = None
        ctx.set_materialize_grads(False)
        return _dtensor(local.view_as(local), spec, local.requires_grad)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _FromTorchTensor.backward(ctx, grad)[:2]


def _public_from_local(local: Tensor, mesh, placements, shape, stride) -> DTensor:
    row_major = (math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))
    stride = tuple(row_major if stride is None else stride)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def wrap_local(local: Tensor, mesh, placements, shape, stride=None) -> DTensor:
    """``DTensor.from_local(..., run_check=False, shape=shape, stride=stride or row-major)``."""
    placements, shape = tuple(placements), tuple(shape)
    if torch.compiler.is_compiling():  # Dynamo traces the public function
        return _public_from_local(local, mesh, placements, shape, stride)
    key = (id(mesh), placements, tuple(map(type, placements)), shape, stride, local.dtype)
    hit = _SPECS.get(key)
    if hit is None or hit[0] is not mesh or local.device.type != mesh.device_type:
        out = _public_from_local(local, mesh, placements, shape, stride)
        if all(type(p) in _PLAIN for p in placements) and out._local_tensor.shape == local.shape:
            _remember(_SPECS, key, (mesh, out._spec))
        return out
    if not local.requires_grad:
        # no graph to record: the DTensor itself, as the autograd function would build it
        return _dtensor(local.view_as(local), hit[1], False)
    return _FromLocal.apply(local, hit[1])


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local``: the same local view; the backward's gradient spec cached."""

    @staticmethod
    def forward(ctx, x: DTensor, grad_placements) -> Tensor:  # type: ignore[override]
        ctx.dtensor_spec = x._spec
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        ctx.local_tensor_stride = local.stride()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None or torch.is_grad_enabled() or type(grad) is not Tensor:
            return _ToTorchTensor.backward(ctx, grad)
        spec, stride = ctx.dtensor_spec, ctx.local_tensor_stride
        key = (spec, ctx.grad_placements, grad.shape, grad.stride(), grad.dtype, stride)
        grad_spec = _GRAD_SPECS.get(key)
        if grad_spec is None or grad.device.type != spec.mesh.device_type:
            out, none = _ToTorchTensor.backward(ctx, grad)
            if all(type(p) in _PLAIN for p in (*spec.placements, *out.placements)):
                _remember(_GRAD_SPECS, key, out._spec)
            return out, none
        return _dtensor(grad.view_as(grad), grad_spec, grad.requires_grad), None


def local_of(x: DTensor, grad_placements=None) -> Tensor:
    """``x.to_local(grad_placements=grad_placements)`` (differentiable)."""
    if (
        torch.compiler.is_compiling()  # Dynamo traces the public method
        or not torch.is_grad_enabled()
        or getattr(x, "_is_param", False)
    ):
        return x.to_local(grad_placements=grad_placements)
    if grad_placements is not None:
        grad_placements = tuple(grad_placements)
    return _ToLocal.apply(x, grad_placements)
