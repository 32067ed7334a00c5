"""Element-wise arithmetic between a sharded DTensor and a plain tensor (a parameter, a mask).

DTensor refuses a plain tensor next to a DTensor, but model code multiplies activations by
parameters it reshapes (timm ConvNeXt's layer scale) or masks it draws (drop-connect). The
plain tensor is the global value: each rank uses the part meeting its entries, and its
gradient is summed over the mesh dims sharding the activation. Next to a ``Partial`` DTensor
(EdgeNeXt's attention map times ``temperature``) it joins as a ``Replicate`` DTensor. One
the model *computed* at the activation's size would have its gradient all-reduced at full
size: refused (``guard_computed_plain``). ``addcmul`` / ``addcdiv`` with a plain operand run
as ``input + value * (tensor1 op tensor2)``, each step through its own handler."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from ._dims import handled, is_dp, wrap
from ._errors import guard_gather, run_dtensor_op
from ._mode import register_handler
from ._runtime import current_runtime
from ._sharding import sharded_dim
from ._token_layout import local_part

#: the arithmetic ops (handlers here, in ``_tokens.py`` and in ``_token_prefix.py``):
#: ``torch.add`` ... ``Tensor.div`` and the operators ``__add__``, ``__radd__`` ...
ARITH = [getattr(m, n) for n in ("add", "sub", "mul", "div") for m in (torch, Tensor)]
ARITH += [
    getattr(Tensor, f"__{r}{n}__") for n in ("add", "sub", "mul", "truediv") for r in ("", "r")
]


#: why a computed plain tensor cut to the strips is a gather, and the ways out (the end of
#: the refusals here and in ``_token_prefix.py``)
PLAIN_GRADIENT_GATHERS = (
    "its gradient would be all-reduced at full size in the backward. Compute it per strip "
    "(from a DTensor), keep it a parameter, or detach it"
)


def guard_computed_plain(plain: Tensor, x: DTensor, dims, what: str) -> None:
    """Refuse (``allow_gather``: count) ``plain`` cut to ``x``'s strip along one of ``dims``
    when the model computed it with a gradient (all-reduced at full size)."""
    if not (plain.requires_grad and plain.grad_fn is not None):  # not computed (most calls)
        return
    # only the spatial splits gather: a plain tensor cut along dp's batch split keeps a
    # batch-sized gradient (e.g. the learned queries of a decoder on the (dp, sp) mesh)
    split = {sharded_dim(p) for i, p in enumerate(x.placements) if not is_dp(x, i)} - {None}
    dims = set(dims) & {d % x.ndim for d in split}
    lead = x.ndim - plain.ndim
    if not any(d >= lead and plain.shape[d - lead] != 1 for d in dims):
        return
    # the audit's yardstick: a gradient of at most an eighth of a rank's input share is not
    # activation-sized (e.g. a Swin window's bias where the whole map is one window)
    if plain.numel() > current_runtime().input_share // 8:
        why = (
            f"takes a plain tensor {tuple(plain.shape)} computed at the activation's size with "
            f"the width-sharded activation {x.placements}: {PLAIN_GRADIENT_GATHERS}"
        )
        guard_gather(what, "plain", str(x.placements), why)


def plain_part(plain: Tensor, x: DTensor, what: str) -> Tensor:
    """The part of ``plain`` (broadcast against ``x``) meeting this rank's entries of ``x``
    (``local_part``: any layout), after ``guard_computed_plain``."""
    split = (d % x.ndim for d in map(sharded_dim, x.placements) if d is not None)
    guard_computed_plain(plain, x, split, what)  # reads ``split`` only for a computed one
    return local_part(plain, x, what=what)


def _make(func):
    def handler(a, b, *args, **kwargs):
        dt, plain = (a, b) if isinstance(a, DTensor) else (b, a)
        if not isinstance(plain, Tensor) or isinstance(plain, DTensor) or plain.ndim > dt.ndim:
            return func(a, b, *args, **kwargs)
        if not handled(dt):
            if any(isinstance(p, Partial) for p in dt.placements):  # a Replicate plain (docstring)
                mesh = dt.device_mesh
                plain = DTensor.from_local(plain, mesh, [Replicate()] * mesh.ndim, run_check=False)
                a, b = (dt, plain) if a is dt else (plain, dt)
            return func(a, b, *args, **kwargs)
        try:
            shape = torch.broadcast_shapes(dt.shape, plain.shape)
        except RuntimeError:
            return func(a, b, *args, **kwargs)
        part = plain_part(plain, dt, func.__name__)
        la, lb = (dt.to_local(), part) if a is dt else (part, dt.to_local())
        return wrap(func(la, lb, *args, **kwargs), dt, dt.placements, shape)

    handler.__name__ = f"spatial_{func.__name__}"
    return handler


for _fn in ARITH:
    register_handler(_fn)(_make(_fn))


def _addc(func, combine):
    def handler(input, tensor1, tensor2, *, value=1):
        args = (input, tensor1, tensor2)
        if all(isinstance(t, DTensor) for t in args):
            return run_dtensor_op(func, args, {"value": value})
        registry = current_runtime().registry

        def call(fn, a, b):  # the handlers chained on ``fn`` (tokens, strips, DTensor's)
            return (registry.handler(fn) or fn)(a, b)

        step = call(combine, tensor1, tensor2)
        return call(torch.add, input, step if value == 1 else call(torch.mul, step, value))

    handler.__name__ = f"spatial_{func.__name__}"
    return handler


for _fn, _combine in ((torch.addcmul, torch.mul), (torch.addcdiv, torch.div)):
    register_handler(_fn, getattr(Tensor, _fn.__name__))(_addc(_fn, _combine))
