"""Element-wise activations and dropout on sharded DTensors, run on the local part (no halo).

In-place requests (``F.relu(x, inplace=True)``, in-place dropout) run DTensor's own in-place
op on ``x`` (one on the ``to_local()`` view would bypass autograd's view tracking), eagerly
under ``torch.compile`` (a mutated graph input fails AOTAutograd's DTensor graphs); three
backward rules DTensor lacks: ``_errors.add_pointwise_strategies``.

Dropout: each rank draws the mask of its own part, so a sharded run is *not* bit-identical
to one device while dropout is active (``verify`` turns it off). Each call takes exactly one
draw of the global RNG on every rank (none in eval mode or with p = 0 or 1, as torch);
``dropout2d``'s mask (one value per sample and channel) is the same on every strip."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._compile import graph_handler, run_eagerly
from ._dims import local_of, mesh_rank, wrap_local
from ._errors import run_dtensor_op
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._runtime import function_name
from ._sharding import sharded_dim

# fmt: off
_ELEMENTWISE = (
    "relu", "relu6", "hardswish", "hardsigmoid", "hardtanh", "silu", "gelu", "leaky_relu",
    "elu", "selu", "celu", "mish", "softplus", "logsigmoid",
)
# fmt: on


def _wrap(x: DTensor, local_out: torch.Tensor) -> DTensor:
    return wrap_local(local_out, x.device_mesh, x.placements, x.shape, x.stride())


def _elementwise(x: DTensor, what: str) -> DTensor:
    """``x``, refused if ``Partial`` (a pending sum: an element-wise op of it is not)."""
    if any(p.is_partial() for p in x.placements):
        raise SpatialShardingError(f"{what} on a Partial DTensor {x.placements}: not element-wise")
    return x


def _inplace_at(fn) -> int | None:
    """The position of ``fn``'s ``inplace`` flag among the arguments after the input (read
    per call without binding the signature; F's activations default it to False), or
    ``None`` without the flag (builtins, ``F.gelu``)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except ValueError:  # a builtin (torch.relu, torch._C._nn.elu ...): no in-place flag
        return None
    return names.index("inplace") - 1 if "inplace" in names else None


def _make_local_handler(fn):
    """Handler running ``fn`` on the local strip (in place: DTensor's own in-place op)."""
    at, what = _inplace_at(fn), function_name(fn)

    def handler(input, *args, **kwargs):
        if not isinstance(input, DTensor):
            return fn(input, *args, **kwargs)
        if at is not None and kwargs.get("inplace", len(args) > at and args[at]):  # eagerly
            return run_eagerly(run_dtensor_op, fn, (_elementwise(input, what), *args), kwargs)
        return _wrap(input, fn(local_of(_elementwise(input, what)), *args, **kwargs))

    handler.__name__ = f"spatial_{fn.__name__}"
    return graph_handler(handler)


for _name in _ELEMENTWISE:
    # F.<name> and the torch / torch._C._nn function of that name, each with its own handler
    for _ns in (F, torch, torch._C._nn):
        _fn = getattr(_ns, _name, None)
        if _fn is not None:
            register_handler(_fn)(_make_local_handler(_fn))


def _drop(input, p=0.5, training=True, inplace=False, *, channels_only: bool):
    """``F.dropout`` / ``F.dropout2d`` (``channels_only``) on the local strip, with a
    per-rank mask whose seed takes one draw of the global RNG (module docstring)."""
    plain = F.dropout2d if channels_only else F.dropout
    if not isinstance(input, DTensor):
        return plain(input, p, training, inplace)
    if not 0.0 <= p <= 1.0:  # torch's check (F.dropout's comes after this dispatch)
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    local, mesh = local_of(_elementwise(input, f"F.{plain.__name__}")), input.device_mesh
    if p == 1.0:  # every element dropped, without a draw (as torch; 1 / (1 - p) is inf)
        scale = local.new_zeros(())
    else:
        if channels_only:  # the same seed on every strip of one image (+ its batch part)
            part, shape = 0, (*local.shape[:2], 1, 1)
            for i, pl in enumerate(input.placements):
                if sharded_dim(pl) == 0:
                    part = part * mesh.size(i) + mesh_rank(mesh, i)
        else:
            part, shape = 1 + mesh.get_rank(), local.shape
        g = torch.Generator(device=local.device)
        g.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) + part)  # the one global draw
        keep = torch.rand(shape, generator=g, device=local.device) >= p
        scale = keep.to(local.dtype) / (1.0 - p)
    if inplace:  # on the DTensor itself (module docstring)
        return run_eagerly(input.mul_, _wrap(input, scale.expand_as(local).contiguous()))
    return _wrap(input, local * scale)


# torch.dropout has F.dropout's leading arguments
register_handler(F.dropout, torch.dropout)(functools.partial(_drop, channels_only=False))
register_handler(F.dropout2d)(functools.partial(_drop, channels_only=True))
