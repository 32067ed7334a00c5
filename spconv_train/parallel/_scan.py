"""``softmax`` / ``log_softmax`` / ``cumsum`` along any dim of a sharded DTensor.

Along an unsharded dim (softmax over channels, the usual case) the op runs on each strip.
Along a sharded dim (the width) each strip needs only small statistics of the others, never
their columns: softmax the global row maximum (all-reduce MAX, no gradient: softmax does not
depend on it) and the global sum of exponentials; cumsum the totals of the strips before it
(every rank's row totals, all-reduced into one small table). Those sums use the autograd-aware
all-reduce of ``torch.distributed.nn``: each rank uses the global value with its own part of
the gradient, and the backward sums those parts over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._dims import handled, norm_dim, sharded_dims, wrap
from ._mode import register_handler


def _group(x: DTensor, d: int):
    i = sharded_dims(x).get(d)
    return None if i is None else (x.device_mesh.get_group(i), x.device_mesh.get_local_rank(i))


def _softmax_local(local: Tensor, d: int, group, log: bool) -> Tensor:
    if local.shape[d]:
        m = local.detach().amax(d, keepdim=True)
    else:  # an empty strip contributes nothing
        m = local.detach().sum(d, keepdim=True).fill_(float("-inf"))
    dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
    e = torch.exp(local - m)
    s = dist_fn.all_reduce(e.sum(d, keepdim=True), group=group)
    return local - m - torch.log(s) if log else e / s


def _softmax(x, dim, dtype, log: bool, plain):
    if not handled(x) or dim is None:
        return plain(x, dim, dtype=dtype) if dim is not None else plain(x, dim)
    d = norm_dim(dim, x.ndim)
    local = x.to_local() if dtype is None else x.to_local().to(dtype)
    where = _group(x, d)
    out = plain(local, d) if where is None else _softmax_local(local, d, where[0], log)
    return wrap(out, x, x.placements, x.shape)


def _softmax_args(input, dim=None, _stacklevel=3, dtype=None):
    return input, dim, dtype


@register_handler(F.softmax, torch.softmax, torch.Tensor.softmax)
def spatial_softmax(*args, **kwargs):
    """``softmax`` along any dim; along a sharded one via per-strip maxima and sums."""
    x, dim, dtype = _softmax_args(*args, **kwargs)
    return _softmax(x, dim, dtype, False, torch.softmax)


@register_handler(F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
def spatial_log_softmax(*args, **kwargs):
    """``log_softmax`` along any dim; along a sharded one via per-strip maxima and sums."""
    x, dim, dtype = _softmax_args(*args, **kwargs)
    return _softmax(x, dim, dtype, True, torch.log_softmax)


@register_handler(torch.cumsum, torch.Tensor.cumsum)
def spatial_cumsum(input, dim, *, dtype=None, out=None):
    """``cumsum`` along any dim; along a sharded one each strip adds the totals of the
    strips before it."""
    if not handled(input) or out is not None:
        return torch.cumsum(input, dim, dtype=dtype, out=out)
    d = norm_dim(dim, input.ndim)
    local = input.to_local() if dtype is None else input.to_local().to(dtype)
    result = local.cumsum(d)
    where = _group(input, d)
    if where is not None:
        group, rank = where
        n = dist.get_world_size(group)
        total = local.sum(d, keepdim=True)
        table = torch.zeros((n, *total.shape), dtype=total.dtype, device=total.device)
        table = table.index_put((torch.tensor([rank], device=table.device),), total.unsqueeze(0))
        table = dist_fn.all_reduce(table, group=group)
        result = result + table[:rank].sum(0)
    return wrap(result, input, input.placements, input.shape)
