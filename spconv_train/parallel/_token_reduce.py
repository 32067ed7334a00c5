"""Token-wise reductions and scans (``sum``, ``mean``, ``var``, ``norm``, ``amax``, ``max``,
``median``, ``argmax``, ``logsumexp``, ``F.normalize``, ``softmax``, ``cumsum``,
``F.rms_norm`` ...) over dims no rank splits (the channels) of pixel tokens, with or without
prefix tokens; ``F.layer_norm``: ``_channels.py``.

Each rank holds whole tokens, so the local reduction is exact and keeps the token layout.
Run here rather than by DTensor, whose backward sizes the gradient by its own chunking,
which is not the layout behind a prefix or of nested tiles ("The expanded size of the
tensor (15) must match the existing size (17)"). A reduction over the tokens goes to the
handler registered before (``_reduce.py``); behind a prefix it is refused by name.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._dims import wrap
from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._prefix_shard import prefix_of, reduced_placements
from ._probe import result_shape
from ._reduce import _dims  # (and its handlers, wrapped here)
from ._registry import function_name
from ._sharding import grad_groups, sharded_dim
from ._tokens import chain, chain_each, is_tokens, split_layouts

_T = torch.Tensor


class _Spec(NamedTuple):
    """Where an op takes its arguments: ``dim`` and ``keepdim`` by position (the tensor
    first; ``keep_pos`` ``None``: the shape is kept), the dims reduced without ``dim``
    (``None``: all), and whether the op without ``dim`` is another one (``x.max()`` over
    all, ``torch.max(a, b)`` element-wise) or needs it (``softmax``)."""

    dim_pos: int
    keep_pos: int | None
    default: int | None = None
    needs_dim: bool = False


#: the ops by ``_Spec``: a name for both ``torch.name`` and ``Tensor.name``, or the function
_OPS = {
    _Spec(1, 2): ("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "logsumexp")
    + ("argmax", "argmin"),
    _Spec(1, 3): ("var", "std"),
    _Spec(2, 3): ("norm", torch.linalg.vector_norm),
    _Spec(1, 2, needs_dim=True): ("max", "min", "median", "nanmedian"),
    _Spec(1, None, needs_dim=True): ("softmax", "log_softmax", "cumsum", "cumprod")
    + (F.softmax, F.log_softmax),
    _Spec(2, None, default=1): (F.normalize,),
}


def _arg(args, kwargs, pos: int | None, name: str, default):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and len(args) > pos else default


def _token_wise(fn, prev, spec: _Spec):
    """Handler for ``fn``: local on token tensors reduced over dims no rank splits."""
    what = function_name(fn)

    def handler(x, *args, **kwargs):
        if not is_tokens(x) or kwargs.get("out") is not None:
            return prev(x, *args, **kwargs)
        full = (x, *args)
        dim = _arg(full, kwargs, spec.dim_pos, "dim", spec.default)
        if isinstance(dim, bool):  # x.var(unbiased): over every dim
            dim = None
        ints = isinstance(dim, int) or (
            isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim)
        )
        if not ints and (dim is not None or spec.needs_dim):
            # x.max(): over all; torch.max(a, b): element-wise; softmax without dim
            return prev(x, *args, **kwargs)
        dims = _dims(dim, x.ndim)
        split = {sharded_dim(p) % x.ndim for p in x.placements if sharded_dim(p) is not None}
        if split & set(dims):
            if any(prefix_of(p) and sharded_dim(p) % x.ndim in dims for p in x.placements):
                raise SpatialShardingError(
                    f"{what} over dims {dims} of tokens {tuple(x.shape)} {x.placements} in "
                    f"module '{module_path()}': a reduction or scan over the tokens behind "
                    f"prefix (class / register) tokens, which one rank holds alone, is not "
                    f"supported. Slice the prefix off first (x[:, p:]), or reduce over the "
                    f"channels (dim=-1)."
                )
            return prev(x, *args, **kwargs)
        keep = spec.keep_pos
        keepdim = keep is None or bool(_arg(full, kwargs, keep, "keepdim", False))
        placements = reduced_placements(x, dims, keepdim)
        out = fn(x.to_local(), *args, **kwargs)
        shape = result_shape(fn, x.shape, *args, meta_dtype=x.dtype, **kwargs)
        if isinstance(out, tuple):  # max / min: (values, indices)
            parts = [wrap(o, x, placements, s) for o, s in zip(out, shape, strict=True)]
            return type(out)(parts)
        return wrap(out, x, placements, shape)

    return handler


for _spec, _ops in _OPS.items():
    _both = [(getattr(torch, n), getattr(_T, n)) if isinstance(n, str) else (n,) for n in _ops]
    chain_each([f for fns in _both for f in fns], partial(_token_wise, spec=_spec), graph=True)


def _splits_normalized(x: DTensor, normalized_shape) -> bool:
    """True when a rank splits one of the trailing dims that a norm over
    ``normalized_shape`` reduces."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return any(lay.dim >= x.ndim - k for lay in split_layouts(x))


@chain(F.rms_norm)
def _rms_norm(prev, input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` over trailing dims no rank splits (the channels): local, as
    ``F.layer_norm`` (``_channels.spatial_layer_norm``)."""
    # is_tokens first: the layouts are read only for token tensors
    if not is_tokens(input) or _splits_normalized(input, normalized_shape):
        return prev(input, normalized_shape, weight, eps)
    out = F.rms_norm(
        input.to_local(), normalized_shape, sum_grad_over(weight, grad_groups(input)), eps
    )
    return wrap(out, input, input.placements, input.shape)
