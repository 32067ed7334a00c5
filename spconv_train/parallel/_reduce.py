"""Reductions and scans over any dims of a sharded DTensor (``sum``, ``mean``, ``nansum``,
``nanmean``, ``amax``, ``amin``, ``var``, ``std``, the L2 norm, ``softmax``, ``log_softmax``,
``cumsum``): each rank reduces its part, small all-reduces over the mesh dims splitting a
reduced dim give the exact value; scans along a split dim take small statistics of the other
blocks, summed by ``torch.distributed.nn`` (its backward sums the gradient's parts).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._dims import handled, mesh_axis, mesh_group, norm_dim, sharded_dims, wrap
from ._errors import run_dtensor_op
from ._geometry import SpatialShardingError
from ._mode import register_handler
from ._prefix_shard import reduced_placements
from ._runtime import function_name
from ._sharding import sharded_dim
from ._small_sum import sum_now, sum_replicated

_REDUCIBLE = (Shard, _StridedShard, Replicate)


def _dims(dim, ndim: int) -> tuple[int, ...]:
    """``dim`` (None, empty: all) as sorted non-negative dims."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({norm_dim(int(d), ndim) for d in dims}))


def all_reduce_extreme(m: Tensor, groups, kind: str) -> Tensor:
    """``m`` (a rank's maxima or minima, ``kind``) reduced over ``groups`` in place. A NaN
    goes as the opposite infinity: gloo's MAX / MIN drop a NaN held by a later rank."""
    inf = float("inf")
    if groups:
        m.nan_to_num_(inf if kind == "max" else -inf, posinf=inf, neginf=-inf)
    for g in groups:
        dist.all_reduce(m, dist.ReduceOp.MAX if kind == "max" else dist.ReduceOp.MIN, group=g)
    return m


def _global_extreme(local: Tensor, dims, groups, kind: str) -> Tensor:
    """Max or min of ``local`` over ``dims`` and ``groups`` (detached, keepdim); a NaN as the
    opposite infinity (``all_reduce_extreme``): no element equals it, so the result is NaN."""
    if local.numel():
        m = (torch.amax if kind == "max" else torch.amin)(local.detach(), dims, keepdim=True)
    else:
        m = local.detach().sum(dims, keepdim=True).fill_(float("inf" if kind == "min" else "-inf"))
    return all_reduce_extreme(m, groups, kind)


def _split_groups(x: DTensor, dims) -> list:
    """The groups of the mesh dims splitting one of ``dims`` (two on one dim: tokens on tiles)."""
    split = ((i, sharded_dim(p)) for i, p in enumerate(x.placements))
    return [mesh_group(x.device_mesh, i) for i, d in split if d is not None and d % x.ndim in dims]


#: the kinds torch refuses on integer and bool inputs (unless a floating ``dtype`` is given)
_FLOATING = ("mean", "nanmean", "var", "std")


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def reduce_sharded(x: DTensor, kind: str, dim=None, keepdim: bool = False, **opts) -> DTensor:
    """``kind`` (sum, mean, nansum, nanmean, amax, amin, var, std, norm2) over ``dim`` of a
    sharded DTensor, exact and differentiable; ``opts``: ``dtype`` (sums, means),
    ``correction`` (var, std)."""
    dims = _dims(dim, x.ndim)
    groups, local = _split_groups(x, dims), x.to_local()
    if kind in _FLOATING and opts.get("dtype") is None and not _floating(x.dtype):
        getattr(torch, kind)(local.new_zeros(1))  # torch's error (an integer mean, var)
    count = math.prod(x.shape[d] for d in dims)
    if kind in ("sum", "mean", "nansum", "nanmean"):  # DTensor's nan*: gathers
        add = local.nansum if kind.startswith("nan") else local.sum
        out = sum_replicated(add(dims, keepdim=True, dtype=opts.get("dtype")), groups)
        if kind == "nanmean":
            count = sum_now(local.detach().isnan().logical_not().sum(dims, keepdim=True), *groups)
        out = out / count if kind.endswith("mean") else out
    elif kind == "norm2":  # DTensor's own rule all-gathers the activation in the backward
        out = sum_replicated(local.square().sum(dims, keepdim=True), groups).sqrt()
    elif kind in ("amax", "amin"):  # the gradient spread over every extreme (as torch)
        hit = local.detach() == _global_extreme(local, dims, groups, kind[1:])
        hits = sum_now(hit.sum(dims, keepdim=True).to(local.dtype), *groups)
        part = torch.where(hit, local, local.new_zeros(())).sum(dims, keepdim=True)
        out = sum_replicated(part / hits, groups)
    else:
        # detached: its gradient contribution is zero (deviations sum to zero)
        mean = sum_replicated(local.detach().sum(dims, keepdim=True), groups) / count
        sq = sum_replicated((local - mean).square().sum(dims, keepdim=True), groups)
        out = sq / (count - opts.get("correction", 1))
        out = out.sqrt() if kind == "std" else out
    if keepdim:
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
    else:
        out, shape = out.squeeze(dims), [n for d, n in enumerate(x.shape) if d not in dims]
    return wrap(out, x, reduced_placements(x, dims, keepdim), shape)


def _refuse_out(func, out) -> None:
    """DTensor's rules drop ``out=`` for these reductions (``out`` stays unwritten) or fail."""
    if out is not None:
        raise SpatialShardingError(
            f"{function_name(func)}(..., out=) on a DTensor is not supported: the result "
            "would not be written to out. Assign the result instead (y = x.sum(dim))"
        )


def _reducible(x) -> bool:
    """Whether ``reduce_sharded`` takes ``x`` (``Shard``, token ``_StridedShard``,
    ``Replicate``; not a pending sum or a prefix). DTensor's rules over a ``_StridedShard``
    all-gather the tokens (``var(1)``) or give a NaN gradient (``amin((), True)``, torch 2.14.1)."""
    return isinstance(x, DTensor) and all(type(p) in _REDUCIBLE for p in x.placements)


def _sum_like(kind: str, func):  # sum, mean, nansum, nanmean, amax, amin
    def handler(input, dim=None, keepdim=False, *, dtype=None, out=None):
        _refuse_out(func, out)
        if not _reducible(input):  # a pending sum (Partial) or a prefix: DTensor's rules
            kw = {"dtype": dtype} if dtype is not None else {}
            if dim is not None and not (isinstance(dim, (tuple, list)) and not dim):
                return func(input, dim, keepdim, **kw)
            # over every dim: DTensor's amin(None, True) of a (prefix) _StridedShard keeps one
            # rank's value (torch 2.14.1), so keepdim is the reshape of the full reduction
            whole = func(input, **kw)
            return whole.reshape((1,) * input.ndim) if keepdim else whole
        return reduce_sharded(input, kind, dim, keepdim, dtype=dtype)

    return handler


@register_handler(torch.aminmax, torch.Tensor.aminmax)
def spatial_aminmax(input, *, dim=None, keepdim=False, out=None):
    """``torch.aminmax`` as ``amin`` and ``amax`` (the gradient spread over the extremes, as
    torch's): DTensor's own rule all-gathers the activation in the backward (torch 2.14.1)."""
    _refuse_out(torch.aminmax, out)
    if not _reducible(input):  # a pending sum (Partial) or a prefix: DTensor's rules
        return run_dtensor_op(torch.aminmax, (input,), {"dim": dim, "keepdim": keepdim})
    parts = (reduce_sharded(input, kind, dim, keepdim) for kind in ("amin", "amax"))
    return torch.return_types.aminmax(tuple(parts))


def _var_like(kind: str, func):
    def handler(input, dim=None, unbiased=None, keepdim=False, *, correction=None, out=None):
        if isinstance(dim, bool):  # the x.var(unbiased) overload
            dim, unbiased = None, dim
        if correction is None:
            correction = 0 if unbiased is False else 1
        _refuse_out(func, out)
        if not _reducible(input):
            return func(input, dim, correction=correction, keepdim=keepdim)
        return reduce_sharded(input, kind, dim, keepdim, correction=correction)

    return handler


def _extreme_of_all(kind: str, func):  # x.max() / x.min(): amax / amin over every dim
    def handler(input, *args, **kwargs):
        if args or kwargs or not _reducible(input):  # max(x, dim) / max(x, y): DTensor's rules
            return func(input, *args, **kwargs)
        return reduce_sharded(input, f"a{kind}")  # DTensor's MAX drops a later rank's NaN

    return handler


for _make, _kinds in (
    (_sum_like, "sum mean nansum nanmean amax amin"),
    (_var_like, "var std"),
    (_extreme_of_all, "max min"),
):
    for _kind in _kinds.split():
        for _fn in (getattr(torch, _kind), getattr(torch.Tensor, _kind)):
            register_handler(_fn)(_make(_kind, _fn))


def _norm_like(func):
    def handler(input, p="fro", dim=None, keepdim=False, *args, **kwargs):
        if func is torch.linalg.vector_norm:  # (x, ord=2, dim=None, keepdim=False)
            p = kwargs.pop("ord", 2 if p == "fro" else p)
        two = p == 2 or (p == "fro" and dim is not None)
        plain_call = not args and all(v is None for v in kwargs.values())  # Tensor.norm: dtype=None
        if not handled(input) or not two or not plain_call:
            return run_dtensor_op(func, (input, p, dim, keepdim, *args), kwargs)  # DTensor's
        return reduce_sharded(input, "norm2", dim, keepdim)

    return handler


for _fn in (torch.norm, torch.Tensor.norm, torch.linalg.vector_norm):
    register_handler(_fn)(_norm_like(_fn))


def _softmax_like(plain, log: bool):
    """``softmax`` / ``log_softmax`` (``log``) along any dim (split: global maxima, sums; in
    any order, so also over the tokens)."""

    def handler(x, dim=None, _stacklevel=3, dtype=None):
        if isinstance(_stacklevel, torch.dtype):  # torch.softmax(x, dim, dtype), x.softmax
            dtype = _stacklevel
        if not _reducible(x) or dim is None:
            return plain(x, dim, dtype=dtype) if dim is not None else plain(x, dim)
        d = norm_dim(dim, x.ndim)
        local = x.to_local() if dtype is None else x.to_local().to(dtype)
        groups = _split_groups(x, (d,))
        if not groups:
            return wrap(plain(local, d), x, x.placements, x.shape)
        m = _global_extreme(local, d, groups, "max")
        e = torch.exp(local - m)
        s = e.sum(d, keepdim=True)
        for g in groups:
            s = dist_fn.all_reduce(s, group=g)
        return wrap(local - m - torch.log(s) if log else e / s, x, x.placements, x.shape)

    return handler


for _fn, _log in ((torch.softmax, False), (torch.log_softmax, True)):
    _all = (getattr(F, _fn.__name__), _fn, getattr(torch.Tensor, _fn.__name__))
    register_handler(*_all)(_softmax_like(_fn, _log))


@register_handler(torch.cumsum, torch.Tensor.cumsum)
def spatial_cumsum(input, dim, *, dtype=None, out=None):
    """``cumsum`` along any dim (sharded: each strip adds the totals of those before; tokens'
    strided order: DTensor's rules)."""
    if not handled(input) or out is not None:
        return torch.cumsum(input, dim, dtype=dtype, out=out)
    d = norm_dim(dim, input.ndim)
    local = input.to_local() if dtype is None else input.to_local().to(dtype)
    result = local.cumsum(d)
    i = sharded_dims(input).get(d)
    if i is not None:
        n, rank, group = mesh_axis(input.device_mesh, i)
        total = local.sum(d, keepdim=True)  # in its rank's row of a zeroed table, summed
        table = torch.stack([total if q == rank else torch.zeros_like(total) for q in range(n)])
        table = dist_fn.all_reduce(table, group=group)
        result = result + table[:rank].sum(0)
    return wrap(result, input, input.placements, input.shape)
