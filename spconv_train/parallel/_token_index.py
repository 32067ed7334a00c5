"""Indexing token tensors along dims no rank splits (``kv[0]``, ``x.select(0, i)``), on the
local tensor: DTensor's ``select_backward`` would size the gradient by its own chunking, not
the layout of tiles. Behind prefix tokens (``_token_prefix.py``) ``x[:, p:]`` gives the pixel
tokens, an index inside the prefix (``x[:, 0]``) is broadcast from its owner as a
``Replicate`` DTensor. docs/attention.md, "Prefix tokens".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from ._dims import mesh_rank, norm_dim, wrap
from ._prefix_shard import placement, prefix_of, reduced_placements
from ._probe import index_shape
from ._rechunk import _expand_index  # (and its __getitem__ handler, chained below)
from ._token_layout import dim_layouts
from ._token_prefix import _keeps_prefix, _refuse, has_prefix
from ._token_ring import token_ring
from ._tokens import chain_each, is_nested, is_tokens, split_layouts

_T = torch.Tensor


def _items(x, index) -> tuple | None:
    """``index`` as one item per dim of ``x`` (``None``: not ints and slices), a slice that
    keeps a whole dim (``x[:, 0:]``, as torch: every entry) read as ``slice(None)``."""
    items = _expand_index(index, x.ndim)
    if items is None:
        return None
    whole = (
        isinstance(i, slice) and i.step in (None, 1) and range(n)[i] == range(n)
        for i, n in zip(items, x.shape, strict=True)
    )
    return tuple(slice(None) if w else i for w, i in zip(whole, items, strict=True))


def _local_index(x, index) -> DTensor | None:
    """``x[index]`` on the local tensor when ``x`` is a token tensor and ``index`` (ints and
    slices) leaves every split dim whole; ``None`` otherwise."""
    items = _items(x, index) if is_tokens(x) or is_nested(x) else None
    if items is None or any(items[lay.dim] != slice(None) for lay in split_layouts(x)):
        return None
    placements = reduced_placements(x, [d for d, i in enumerate(items) if isinstance(i, int)])
    return wrap(x.to_local()[items], x, placements, index_shape(x.shape, items))


def _select(x, dim, index) -> tuple | None:
    """``x.select(dim, index)`` as one index per dim (``None``: not an int index)."""
    if not isinstance(dim, int) or not isinstance(index, int):
        return None
    d = norm_dim(dim, x.ndim)
    return tuple(index if e == d else slice(None) for e in range(x.ndim))


class _FromOwner(torch.autograd.Function):
    """The group rank ``src``'s ``part`` on every rank of ``group`` (a broadcast); the
    gradient, a partial sum on every rank, summed back to ``src``."""

    @staticmethod
    def forward(ctx, part: Tensor, group, shape: tuple[int, ...], dim: int, src: int) -> Tensor:
        ctx.group, ctx.src, ctx.dim = group, src, dim
        ctx.owner = dist.get_rank(group) == src
        out = part.contiguous() if ctx.owner else part.new_empty(shape)
        dist.broadcast(out, group_src=src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.reduce(grad, group_dst=ctx.src, op=dist.ReduceOp.SUM, group=ctx.group)
        return (grad if ctx.owner else grad.narrow(ctx.dim, 0, 0)), None, None, None, None


def _prefix_index(x: DTensor, index, whole):
    """``x[index]`` on a tensor with prefix tokens: ``whole(x)`` when the token dim stays
    whole, the pixel tokens (``x[:, p:]``) or a part of the prefix (``x[:, 0]``, ``x[:, :p]``)
    from its owner, the first rank of every mesh dim splitting the tokens."""
    items = _items(x, index)
    dims = [m for m, q in enumerate(x.placements) if prefix_of(q)]
    d, p = norm_dim(x.placements[dims[0]].dim, x.ndim), prefix_of(x.placements[dims[0]])
    if items is not None and items[d] == slice(None):
        return whole(x)
    what = "indexing (x[...])"
    if items is None or any(i != slice(None) for e, i in enumerate(items) if e != d):
        raise _refuse(
            what,
            f"index {index!r} of tokens {tuple(x.shape)} behind {p} prefix tokens indexes "
            f"more than the token dim (dim {d})",
            "Index the token dim alone (x[:, p:], x[:, :p], x[:, 0])",
        )
    i, n, local = items[d], x.shape[d], x.to_local()
    owner = all(mesh_rank(x.device_mesh, m) == 0 for m in dims)
    if isinstance(i, slice) and i.step in (None, 1) and range(n)[i] == range(p, n):
        plain = list(x.placements)
        for m in dims:
            plain[m] = placement(d, x.placements[m].split_factor)
        out = local.narrow(d, p, local.shape[d] - p) if owner else local
        return wrap(out, x, plain, (*x.shape[:d], n - p, *x.shape[d + 1 :]))
    picked = range(n)[i] if isinstance(i, slice) else range(n)[i : i + 1 or None]
    if not picked or max(picked) >= p or not (isinstance(i, int) or i.step in (None, 1)):
        raise _refuse(
            what,
            f"index {i!r} of the token dim {d} of {tuple(x.shape)} mixes its {p} prefix "
            f"tokens (on the first rank) with the pixel tokens (split over the ranks)",
            "Take the prefix (x[:, :p], x[:, 0]) and the pixel tokens (x[:, p:]) apart",
        )
    shape = list(local.shape)
    shape[d] = len(picked)
    ring = token_ring(x.device_mesh, dim_layouts(split_layouts(x), d))
    src = next(r for r, m in enumerate(ring.members) if all(lay.rank == 0 for lay in m))
    part = local.narrow(d, picked[0], len(picked) if owner else 0)
    out = _FromOwner.apply(part, ring.group, shape, d, src)
    if isinstance(i, int):
        out = out.select(d, 0)
    placements, grads = list(x.placements), list(x.placements)
    for m in dims:
        placements[m], grads[m] = Replicate(), Partial()
    global_shape = index_shape(x.shape, items)
    return DTensor.from_local(
        out, x.device_mesh, placements, run_check=False, shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(), grad_placements=grads,
    )  # fmt: skip


def _indexing(index_of, fn, prev):
    """Handler (``_tokens.chain_each``) of ``x[index_of(x, *args)]``: behind a prefix by
    ``_prefix_index``, else locally (``_local_index``), else ``prev``."""

    def local(x, *args, **kwargs):
        out = _local_index(x, index_of(x, *args, **kwargs)) if isinstance(x, DTensor) else None
        return prev(x, *args, **kwargs) if out is None else out

    kept = _keeps_prefix(fn, local)

    def handler(x, *args, **kwargs):
        if not has_prefix(x):
            return local(x, *args, **kwargs)
        whole = lambda t: kept(t, *args, **kwargs)  # noqa: E731
        return _prefix_index(x, index_of(x, *args, **kwargs), whole)

    return handler


chain_each((_T.__getitem__,), partial(_indexing, lambda x, index: index), "prefix")
chain_each((torch.select, _T.select), partial(_indexing, _select), "prefix")
