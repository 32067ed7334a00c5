"""Token layouts: an NCHW map flattened to a sequence of pixel tokens, kept sharded.

``x.flatten(2).transpose(1, 2)`` of a width-sharded map gives ``(N, L, C)`` tokens in
row-major order: on a W strip a rank owns, for every row ``h``, the tokens ``h * W + w``
of its columns ``w`` -- not a contiguous chunk of ``L``. DTensor calls that
``_StridedShard(dim, split_factor=H)``: the dim viewed as ``(H, W)`` with ``W`` chunked.
That placement *is* the token layout here (``TokenLayout`` reads it): what a rank holds
is exactly its local flatten, so token-wise ops stay local:

* reshapes (``reshape``, ``view``, ``flatten``, ``unflatten``) that keep the sharded
  factor of the token dim whole run on the local tensor (``(N, L, C) -> (N, L, heads, d)``,
  tokens back to ``(N, C, H, W)`` or channels-last ``(N, H, W, C)``), also for uneven
  splits, where DTensor refuses ("Cannot unflatten unevenly sharded tensor");
* ``F.layer_norm`` over the channels and element-wise arithmetic with a plain tensor (an
  absolute position embedding ``(1, L, C)`` is sliced to the rank's tokens, its gradient
  summed over the ranks); ``F.linear``, activations and dropout already run locally.

A reshape that would mix the tokens of different ranks is refused with
``SpatialShardingError`` naming the op and the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import _broadcast, _channels  # noqa: F401  (their handlers are wrapped below)
from ._dims import wrap
from ._errors import module_path, run_dtensor_op
from ._geometry import SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import sum_grad_over
from ._mode import register_handler
from ._registry import DEFAULT_REGISTRY, function_name
from ._sharding import sharded_dim, sharding_mesh_dims


@dataclass(frozen=True)
class TokenLayout:
    """How one mesh dimension splits a tensor dimension: viewed as ``(split_factor,
    inner)``, ``inner`` chunked like DTensor's ``Shard`` (``split_factor`` 1: a plain
    ``Shard``)."""

    dim: int
    mesh_dim: int
    split_factor: int
    inner: int
    parts: int
    rank: int

    def sizes(self) -> tuple[int, ...]:
        """How many entries of ``dim`` every rank holds."""
        return tuple(
            self.split_factor * (b - a) for a, b in all_shard_bounds(self.inner, self.parts)
        )

    def indices(self) -> Tensor:
        """Global indices along ``dim`` that this rank holds, in its local order."""
        a, b = shard_bounds(self.inner, self.parts, self.rank)
        outer = torch.arange(self.split_factor).unsqueeze(1) * self.inner
        return (outer + torch.arange(a, b).unsqueeze(0)).reshape(-1)


def split_layouts(x: DTensor) -> list[TokenLayout]:
    """One ``TokenLayout`` per mesh dimension that shards a dimension of ``x``."""
    out = []
    for i, p in enumerate(x.placements):
        d = sharded_dim(p)
        if d is None:
            continue
        d %= x.ndim
        sf = p.split_factor if isinstance(p, _StridedShard) else 1
        mesh = x.device_mesh
        out.append(TokenLayout(d, i, sf, x.shape[d] // sf, mesh.size(i), mesh.get_local_rank(i)))
    return out


def is_tokens(x) -> bool:
    """True for a DTensor with a ``_StridedShard`` placement (flattened sharded pixels)."""
    return isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements)


def _placement(dim: int, sf: int):
    return Shard(dim) if sf == 1 else _StridedShard(dim, split_factor=sf)


def _target(
    shape: tuple[int, ...], lay: TokenLayout, out_shape: tuple[int, ...], last: bool = False
):
    """The output dim holding ``lay``'s sharded factor after a reshape to ``out_shape``,
    and its split factor there; ``None`` if the reshape mixes that factor with others.
    A sharded factor of size 1 fits several output dims: the first, or with ``last`` the
    innermost (``_windows.py``: a single window's index)."""
    before = math.prod(shape[: lay.dim]) * lay.split_factor
    after = math.prod(shape[lay.dim + 1 :])
    dims = list(enumerate(out_shape))
    for e, n in reversed(dims) if last else dims:
        if math.prod(out_shape[e + 1 :]) != after or n % max(lay.inner, 1):
            continue
        sf = n // max(lay.inner, 1)
        if math.prod(out_shape[:e]) * sf == before and (n > 1 or lay.inner <= 1):
            return e, sf
    return None


def local_reshape(x: DTensor, out_shape: tuple[int, ...], what: str, fn=None) -> DTensor:
    """``x`` reshaped to the global ``out_shape`` on the local tensor, each sharded factor
    kept whole (``fn(local, local_shape)``: the op, ``reshape`` by default)."""
    placements = list(x.placements)
    local = x.to_local()
    local_shape = list(out_shape)
    for lay in split_layouts(x):
        found = _target(tuple(x.shape), lay, out_shape)
        if found is None:
            raise SpatialShardingError(
                f"{what} from {tuple(x.shape)} to {tuple(out_shape)} in module "
                f"'{module_path()}' would mix the tokens (pixels) of different ranks: dim "
                f"{lay.dim} is split over mesh dim {lay.mesh_dim} as {x.placements[lay.mesh_dim]}."
                f" Reshape so that the token dim stays whole (e.g. (N, L, C) <-> "
                f"(N, L, heads, d), or back to (N, C, H, W)), or gather explicitly "
                f"(x.full_tensor())."
            )
        e, sf = found
        placements[lay.mesh_dim] = _placement(e, sf)
        local_shape[e] = sf * (local.shape[lay.dim] // lay.split_factor)
    out = fn(local, tuple(local_shape)) if fn else local.reshape(local_shape)
    return wrap(out, x, placements, out_shape)


def _meta_shape(func, x: DTensor, *args, **kwargs) -> tuple[int, ...]:
    return tuple(func(torch.empty(x.shape, device="meta"), *args, **kwargs).shape)


def _reshaping(func, use_view: bool = False):
    """Handler for ``func`` (a reshape-like op): local on token tensors, else DTensor's."""
    what = function_name(func)

    def handler(x, *args, **kwargs):
        if not is_tokens(x) or (args and isinstance(args[0], torch.dtype)) or "dtype" in kwargs:
            # DTensor's own ("Cannot flatten unevenly sharded tensor" on H x W tiles: named)
            return run_dtensor_op(func, (x, *args), kwargs)
        shape = _meta_shape(func, x, *args, **kwargs)
        fn = (lambda t, s: t.view(s)) if use_view else None
        return local_reshape(x, shape, what, fn)

    handler.__name__ = f"token_{func.__name__}"
    return handler


for _fn in (torch.reshape, torch.Tensor.reshape, torch.flatten, torch.Tensor.flatten):
    register_handler(_fn)(_reshaping(_fn))
for _fn in (torch.unflatten, torch.Tensor.unflatten):
    register_handler(_fn)(_reshaping(_fn))
register_handler(torch.Tensor.view)(_reshaping(torch.Tensor.view, use_view=True))


def _wrap_existing(*functions):
    """Decorator: ``token_handler`` runs for token tensors (``is_tokens`` of the first
    argument or of a DTensor among the first two), the handler registered before (or the
    function itself) for everything else."""

    def deco(token_handler):
        for fn in functions:
            prev = DEFAULT_REGISTRY.handler(fn) or fn

            def handler(*args, _prev=prev, _fn=fn, **kwargs):
                if any(is_tokens(a) for a in args[:2]):
                    return token_handler(_fn, *args, **kwargs)
                return _prev(*args, **kwargs)

            handler.__name__ = f"token_{getattr(fn, '__name__', 'op')}"
            register_handler(fn)(handler)
        return token_handler

    return deco


def _grad_groups(x: DTensor) -> tuple:
    return tuple(x.device_mesh.get_group(i) for i in sharding_mesh_dims(x.placements))


@_wrap_existing(F.layer_norm, torch.layer_norm)
def token_layer_norm(fn, input, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    """``F.layer_norm`` over trailing dims that no rank splits (the channels): local."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if any(lay.dim >= input.ndim - k for lay in split_layouts(input)):
        raise SpatialShardingError(
            f"F.layer_norm over a split dim of {tuple(input.shape)} {input.placements} in "
            f"module '{module_path()}': statistics over the tokens of several ranks are not "
            f"supported; normalise over the channels (the last dim)."
        )
    g = _grad_groups(input)
    out = F.layer_norm(
        input.to_local(), normalized_shape, sum_grad_over(weight, g), sum_grad_over(bias, g), eps
    )
    return wrap(out, input, input.placements, input.shape)


def local_part(plain: Tensor, x: DTensor) -> Tensor:
    """The part of ``plain`` (broadcast against ``x``'s global shape, e.g. a position
    embedding ``(1, L, C)``) that meets this rank's entries of ``x``, with its gradient
    summed over the ranks that split ``x``."""
    part = sum_grad_over(plain, _grad_groups(x))
    lead = x.ndim - part.ndim
    for lay in split_layouts(x):
        k = lay.dim - lead
        if k >= 0 and part.shape[k] != 1:
            part = part.index_select(k, lay.indices().to(part.device))
    return part


def _same_split(a: DTensor, b: DTensor) -> bool:
    """Both laid out alike: the same placements, and every split dim of the same size."""
    return (
        a.ndim == b.ndim
        and a.placements == b.placements
        and all(a.shape[lay.dim] == b.shape[lay.dim] for lay in split_layouts(a))
    )


def _arith(fn, a, b, *args, **kwargs):
    dt, plain = (a, b) if isinstance(a, DTensor) else (b, a)
    if isinstance(plain, DTensor) and _same_split(dt, plain):
        # DTensor redistributes some of these when the strides differ (a transposed view
        # next to a contiguous tensor); laid out alike, the op is local
        shape = torch.broadcast_shapes(a.shape, b.shape)
        return wrap(fn(a.to_local(), b.to_local(), *args, **kwargs), dt, dt.placements, shape)
    if isinstance(plain, DTensor) or not isinstance(plain, Tensor) or plain.ndim > dt.ndim:
        return fn(a, b, *args, **kwargs)  # DTensor's own rules
    shape = torch.broadcast_shapes(dt.shape, plain.shape)
    if shape != dt.shape:
        raise SpatialShardingError(
            f"{function_name(fn)} of a token tensor {tuple(dt.shape)} and a plain tensor "
            f"{tuple(plain.shape)} in module '{module_path()}' broadcasts the token tensor."
        )
    part = local_part(plain, dt)
    la, lb = (dt.to_local(), part) if a is dt else (part, dt.to_local())
    return wrap(fn(la, lb, *args, **kwargs), dt, dt.placements, shape)


_ARITH = [getattr(torch, n) for n in ("add", "sub", "mul", "div")]
_ARITH += [getattr(Tensor, n) for n in ("add", "sub", "mul", "div")]
_ARITH += [
    getattr(Tensor, f"__{p}{n}__") for n in ("add", "sub", "mul", "truediv") for p in ("", "r")
]
for _fn in _ARITH:
    _wrap_existing(_fn)(_arith)
