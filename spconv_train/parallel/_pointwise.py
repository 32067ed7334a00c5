"""Element-wise ops on sharded DTensors: activations and dropout on the local part (no
halo), and arithmetic between a sharded DTensor and a plain tensor.

In-place requests (``F.relu(x, inplace=True)``, in-place dropout) run DTensor's own in-place
op on ``x`` (one on the ``to_local()`` view would bypass autograd's view tracking), eagerly
under ``torch.compile`` (a mutated graph input fails AOTAutograd's DTensor graphs); three
backward rules DTensor lacks: ``_errors.add_pointwise_strategies``.

Dropout: each rank draws the mask of its own part, so a sharded run is *not* bit-identical
to one device while dropout is active (``verify`` turns it off). Each call takes exactly one
draw of the global RNG on every rank (none in eval mode or with p = 0 or 1, as torch);
``dropout2d``'s mask (one value per sample and channel) is the same on every strip.

Arithmetic: DTensor refuses a plain tensor next to a DTensor, but model code multiplies
activations by parameters it reshapes (timm ConvNeXt's layer scale) or masks it draws
(drop-connect). The plain tensor is the global value: each rank uses the part meeting its
entries, and its gradient is summed over the mesh dims sharding the activation. Next to a
``Partial`` DTensor (EdgeNeXt's attention map times ``temperature``) it joins as a
``Replicate`` DTensor. One the model *computed* at the activation's size would have its
gradient all-reduced at full size: refused (``guard_computed_plain``). ``addcmul`` /
``addcdiv`` with a plain operand run as ``input + value * (tensor1 op tensor2)``, each step
through its own handler.

``unbind`` along a dim no rank splits (the channels) runs on the local part: DTensor's own
rule stacks the gradients of the pieces in the backward, plain zeros for unused ones next to
DTensors (an error); along a split dim it is refused by name."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from ._compile import graph_handler, run_eagerly
from ._dims import handled, is_dp, local_of, mesh_rank, norm_dim, wrap, wrap_local
from ._errors import guard_gather, module_path, run_dtensor_op
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._prefix_shard import reduced_placements
from ._runtime import current_runtime, function_name
from ._sharding import sharded_dim
from ._token_layout import local_part

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


register_handler(F.dropout)(functools.partial(_drop, channels_only=False))


@register_handler(torch.dropout)
def _torch_dropout(input, p, train):
    """``torch.dropout``: ``F.dropout``'s leading arguments, the third named ``train``."""
    return _drop(input, p, train, channels_only=False)


register_handler(F.dropout2d)(functools.partial(_drop, channels_only=True))


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


@register_handler(torch.unbind, Tensor.unbind)
def spatial_unbind(input, dim=0):
    """``unbind`` along a dim no rank splits: the local pieces, that dim dropped from the
    placements (maps, tokens); along a split dim refused by name; ``Partial``: DTensor's."""
    if any(isinstance(p, Partial) for p in input.placements):
        return run_dtensor_op(torch.unbind, (input, dim), {})
    d = norm_dim(dim, input.ndim)
    if any(sharded_dim(p) is not None and p.dim % input.ndim == d for p in input.placements):
        raise SpatialShardingError(
            f"torch.unbind along dim {d} of a tensor {tuple(input.shape)} "
            f"{tuple(input.placements)} in module '{module_path()}' is not supported: the ranks "
            "split that dim, each holds some of its pieces. Unbind along a dim no rank splits "
            "(e.g. the channels)."
        )
    shape = (*input.shape[:d], *input.shape[d + 1 :])
    stride = (*input.stride()[:d], *input.stride()[d + 1 :])  # views of a permuted input
    placements = reduced_placements(input, (d,))
    mesh = input.device_mesh
    return tuple(wrap_local(t, mesh, placements, shape, stride) for t in local_of(input).unbind(d))
