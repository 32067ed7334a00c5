"""Prefix tokens (a ViT's class / register tokens) in front of sharded pixel tokens: ``cat``
gives a ``PrefixShard`` token dim (the prefix held once); ops keeping the tokens in place run
on the plain placements, the prefix put back; ``x[:, p:]``: the pixel tokens, ``x[:, 0]``:
broadcast from its owner. Indexing along unsplit dims (``kv[0]``) runs locally (DTensor's
``select_backward`` sizes the gradient by its own chunking). docs/attention.md."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import _attention_explicit  # noqa: F401  (its handlers are wrapped)
from ._dims import cat_shape, index_shape, norm_dim, wrap
from ._errors import guard_gather, module_path
from ._geometry import SpatialShardingError
from ._pointwise import ARITH, PLAIN_GRADIENT_GATHERS, guard_computed_plain, plain_part
from ._prefix_shard import PrefixShard, placement, prefix_of, reduced_placements
from ._rechunk import _expand_index  # (and its __getitem__ handler, chained below)
from ._runtime import function_name
from ._sharding import sharded_dim
from ._token_layout import local_part
from ._token_ring import token_ring
from ._tokens import chain, chain_each, is_dp, is_nested, is_tokens, split_layouts


def has_prefix(x) -> bool:
    """True for a DTensor with prefix tokens (a ``PrefixShard`` placement)."""
    return isinstance(x, DTensor) and any(prefix_of(p) for p in x.placements)


def _refuse(what: str, why: str, fix: str) -> SpatialShardingError:
    return SpatialShardingError(f"{what} in module '{module_path()}': {why}. {fix}")


def _strip(x):
    """``x`` (or a list / tuple of them) with every ``PrefixShard`` read as ``_plain``."""
    if isinstance(x, (list, tuple)):
        return type(x)(_strip(t) for t in x)
    return wrap(x.to_local(), x, _plain(x.placements), x.shape) if has_prefix(x) else x


def _plain(placements) -> list:
    """``placements`` with every ``PrefixShard`` read as its plain ``_StridedShard``."""
    return [placement(p.dim, p.split_factor) if prefix_of(p) else p for p in placements]


def _attach(out, prefixes: dict[int, tuple[int, int]], what: str):
    """``out`` (or a list / tuple of them) with the prefixes ``{mesh dim: (prefix, tokens)}``
    put back; refused where a split dim no longer holds all the tokens."""
    if isinstance(out, (list, tuple)):
        return type(out)(_attach(t, prefixes, what) for t in out)
    if not isinstance(out, DTensor):
        return out
    placements = list(out.placements)
    for m, (p, n) in prefixes.items():
        d = sharded_dim(placements[m])
        if d is None or out.shape[d] != n:
            raise _refuse(
                what,
                f"the result {tuple(out.shape)} {out.placements} no longer splits all {n} "
                f"tokens behind {p} prefix (class / register) tokens (a reduction over the "
                f"tokens, or a part of them)",
                "Slice the prefix off first (x[:, p:]) or build the model without class "
                "token (class_token: false, no reg_tokens)",
            )
        sf = getattr(placements[m], "split_factor", 1)
        placements[m] = PrefixShard(d % out.ndim, sf, prefix=p)
    return wrap(out.to_local(), out, placements, out.shape)


def _prefixes(args) -> dict[int, tuple[int, int]]:
    """``{mesh dim: (prefix, tokens)}`` of the tensors with prefix tokens among ``args``."""
    found: dict[int, tuple[int, int]] = {}
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            for m, p in enumerate(t.placements if has_prefix(t) else ()):
                if prefix_of(p):
                    found[m] = (prefix_of(p), t.shape[p.dim])
    return found


def _keeps_prefix(fn, prev):
    """Handler for ``fn``, an op keeping every token in place: ``prev`` on the plain
    placements, the prefix put back."""
    what = function_name(fn)

    def handler(*args, **kwargs):
        prefixes = _prefixes((*args, *kwargs.values()))
        if not prefixes:
            return prev(*args, **kwargs)
        out = prev(*_strip(args), **{k: _strip(v) for k, v in kwargs.items()})
        return _attach(out, prefixes, what)

    return handler


_T = torch.Tensor
#: ops that keep every token where it is (on ``Tensor`` and ``torch``, ``Tensor`` alone, ``F``);
#: the math from ``exp`` on: DTensor runs it with placements of its own making (no prefix)
# fmt: off
_BOTH = ("permute", "transpose", "unbind", "movedim", "softmax", "unsqueeze", "squeeze",
         "sigmoid", "tanh", "chunk", "split", "exp", "log", "pow", "abs", "sqrt", "rsqrt",
         "square", "erf", "clamp", "reciprocal", "sin", "cos", "log1p", "expm1", "sign")
_KEEPING = [getattr(ns, n) for n in _BOTH for ns in (_T, torch)]
_KEEPING += [getattr(_T, n) for n in ("contiguous", "clone", "to", "type_as", "float", "double",
                                      "neg", "__neg__")]
_KEEPING += [F.gelu, F.silu, F.relu, F.dropout, F.softmax, F.sigmoid, F.tanh]
# fmt: on
chain_each(_KEEPING, _keeps_prefix, "prefix", graph=True)


def _arith_handler(fn, prev):
    """Arithmetic with a token tensor first or second: local next to a token tensor laid out
    alike or a plain tensor (the rank's part of it); a scalar behind a prefix on the plain
    placements, the prefix put back; else ``prev``."""
    what = function_name(fn)

    def tokens(a, b, *rest, **kwargs):
        dt, plain = (a, b) if isinstance(a, DTensor) else (b, a)
        alike = isinstance(plain, DTensor) and a.ndim == b.ndim and a.placements == b.placements
        if alike and all(a.shape[lay.dim] == b.shape[lay.dim] for lay in split_layouts(a)):
            # DTensor redistributes some when the strides differ (a transposed view)
            shape = torch.broadcast_shapes(a.shape, b.shape)
            return wrap(fn(a.to_local(), b.to_local(), *rest, **kwargs), dt, dt.placements, shape)
        if isinstance(plain, DTensor) or not isinstance(plain, Tensor) or plain.ndim > dt.ndim:
            return fn(a, b, *rest, **kwargs)  # DTensor's own rules
        shape = torch.broadcast_shapes(dt.shape, plain.shape)
        if shape != dt.shape:
            raise SpatialShardingError(
                f"{what} of a token tensor {tuple(dt.shape)} and a plain tensor "
                f"{tuple(plain.shape)} in module '{module_path()}' broadcasts the token tensor."
            )
        # the guard here, not in local_part: it also cuts window-sized masks (_ring_mask.py)
        part = plain_part(plain, dt, what)
        la, lb = (dt.to_local(), part) if a is dt else (part, dt.to_local())
        return wrap(fn(la, lb, *rest, **kwargs), dt, dt.placements, shape)

    kept = _keeps_prefix(fn, tokens)

    def handler(a, *args, **kwargs):
        if not args and "other" in kwargs:  # x.add(other=y): the handlers below by position
            args = (kwargs.pop("other"),)
        if not args or not (is_tokens(a) or is_tokens(args[0])):
            return prev(a, *args, **kwargs)
        b, *args = args
        dt, other = (a, b) if has_prefix(a) else (b, a)
        if has_prefix(dt) and not (
            isinstance(other, Tensor)
            and (not isinstance(other, DTensor) or _prefixes([other]) == _prefixes([dt]))
        ):
            return kept(a, b, *args, **kwargs)
        return tokens(a, b, *args, **kwargs)

    return handler


chain_each(ARITH, _arith_handler, "prefix")


def _expanded_leaf(t: Tensor) -> Tensor | None:
    """The leaf ``t`` is an expanded view of (``cls_token.expand(N, -1, -1)``), or ``None``."""
    base = t._base
    if base is None or not base.is_leaf or base.ndim != t.ndim:
        return None
    try:
        same = base.expand(t.shape)
    except RuntimeError:
        return None
    layout = (same.stride(), same.storage_offset()) == (t.stride(), t.storage_offset())
    return base if layout else None


def _cat_prefix(tensors: list, d: int, what: str) -> DTensor:
    """``torch.cat(tensors, d)`` of plain prefix tokens in front of the token tensor (the
    last) along its token dim ``d``, held by the first rank. An expanded parameter is
    expanded here (its gradient summed as the parameter's, not as ``(N, p, C)``); other
    plain tokens with a gradient as long as a rank's share of the pixel tokens are refused
    (``guard_gather``: their gradient would be all-reduced at that size)."""
    x, front, parts = tensors[-1], tensors[:-1], []
    lays = [lay for lay in split_layouts(x) if lay.dim == d and not is_dp(x, lay.mesh_dim)]
    share = (x.shape[d] - lays[0].prefix) // math.prod(lay.parts for lay in lays)
    for t in front:
        k, base = d - (x.ndim - t.ndim), _expanded_leaf(t)
        if base is not None:
            shape = list(x.to_local().shape)
            shape[d] = t.shape[d]
            parts.append(local_part(base, x, skip=d).expand(shape))
            continue
        if t.requires_grad and t.grad_fn is not None and k >= 0 and t.shape[k] >= max(1, share):
            why = (
                f"puts a plain tensor {tuple(t.shape)} computed with a gradient in front of the "
                f"width-sharded tokens {x.placements} as {t.shape[k]} prefix tokens, held by "
                f"one rank: {PLAIN_GRADIENT_GATHERS}"
            )
            guard_gather(what, "plain", str(x.placements), why)
        parts.append(local_part(t, x, skip=d))
    if any(lay.rank != 0 for lay in lays):
        # the owner holds the prefix; the others take part in the gradient sums with none
        parts = [t.narrow(d - (x.ndim - t.ndim), 0, 0) for t in parts]
    prefix = lays[0].prefix + sum(t.shape[d - (x.ndim - t.ndim)] for t in front)
    placements = list(x.placements)
    for lay in lays:
        placements[lay.mesh_dim] = PrefixShard(d, lay.split_factor, prefix=prefix)
    shape = cat_shape([t.shape for t in tensors], d)
    return wrap(torch.cat([*parts, x.to_local()], d), x, placements, shape)


def _cat_alongside(tensors: list, d: int, x: DTensor, what: str) -> DTensor | None:
    """``torch.cat`` along an unsplit dim of token tensors laid out like ``x`` and plain
    tensors (the rank's part of each); ``None`` for other mixes."""
    dims = [lay.dim for lay in split_layouts(x)]
    for t in (t for t in tensors if isinstance(t, DTensor)):
        if t.placements != x.placements or any(t.shape[e] != x.shape[e] for e in dims):
            return None
    for t in tensors:
        if not isinstance(t, DTensor):  # an expanded parameter is summed as the parameter
            leaf = _expanded_leaf(t)
            guard_computed_plain(t if leaf is None else leaf, x, dims, what)
    parts = [t.to_local() if isinstance(t, DTensor) else local_part(t, x) for t in tensors]
    shape = cat_shape([t.shape for t in tensors], d)
    return wrap(torch.cat(parts, d), x, x.placements, shape)


def _cat_handler(fn, prev):
    what = function_name(fn)

    def handler(tensors, dim=0, **kwargs):
        if "axis" in kwargs:  # torch's alias: passed on with dim=0, tokens were cat on dim 0
            dim = kwargs.pop("axis")
        tensors = list(tensors)
        x, last = next((t for t in reversed(tensors) if is_tokens(t)), None), tensors[-1]
        if x is None and dim in (1, -2) and isinstance(last, DTensor) and last.ndim == 3:
            x = last if Shard(1) in last.placements else None  # even chunks of L (_windows.py)
        if x is None or any(k != "axis" for k in kwargs):
            return prev(tensors, dim, **kwargs)
        d, out, front = norm_dim(dim, x.ndim), None, tensors[:-1]
        plain = all(isinstance(t, Tensor) and not isinstance(t, DTensor) for t in front)
        if d not in {lay.dim for lay in split_layouts(x) if not is_dp(x, lay.mesh_dim)}:
            out = _cat_alongside(tensors, d, x, what)
        elif last is x and front and plain:
            out = _cat_prefix(tensors, d, what)
        return prev(tensors, dim, **kwargs) if out is None else out

    return handler


chain_each((torch.cat, torch.concat, torch.concatenate), _cat_handler, "prefix", graph=True)


@chain(_T.expand_as, prefix="prefix", graph=True)
def _expand_as(prev, t, other, *args, **kwargs):
    """``t.expand_as(tokens)`` of ``t`` replicated where ``tokens`` is split, of size 1
    along the split dims (a class token): local, laid out like ``tokens``."""
    if not (isinstance(t, DTensor) and is_tokens(other) and t.ndim == other.ndim):
        return prev(t, other, *args, **kwargs)
    grads = list(t.placements)
    for m, (pt, po) in enumerate(zip(t.placements, other.placements, strict=True)):
        d = sharded_dim(po)
        if pt != po and not (isinstance(pt, Replicate) and d is not None and t.shape[d] == 1):
            return prev(t, other, *args, **kwargs)
        grads[m] = pt if pt == po else Partial()
    local = t.to_local(grad_placements=grads).expand(other.to_local().shape)
    return wrap(local, other, other.placements, other.shape)


def _items(x, index) -> tuple | None:
    """``index`` as one item per dim of ``x`` (``None``: not ints and slices), a slice that
    keeps a whole dim (``x[:, 0:]``) read as ``slice(None)``."""
    items = _expand_index(index, x.ndim)
    if items is None:
        return None
    return tuple(
        slice(None)
        if isinstance(i, slice) and i.step in (None, 1) and range(n)[i] == range(n)
        else i
        for i, n in zip(items, x.shape, strict=True)
    )


def _local_index(x, index) -> DTensor | None:
    """``x[index]`` on the local tensor of a token tensor when ``index`` (ints and slices)
    leaves every split dim whole; ``None`` otherwise."""
    items = _items(x, index) if is_tokens(x) or is_nested(x) else None
    if items is None or any(items[lay.dim] != slice(None) for lay in split_layouts(x)):
        return None
    placements = reduced_placements(x, [d for d, i in enumerate(items) if isinstance(i, int)])
    return wrap(x.to_local()[items], x, placements, index_shape(x.shape, items))


def _select(x, dim, index) -> tuple | None:
    """``x.select(dim, index)`` as ``x[index]``'s index (``None``: not an int index)."""
    ints = isinstance(dim, int) and isinstance(index, int)
    return (*(slice(None),) * norm_dim(dim, x.ndim), index) if ints else None


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


def _prefix_index(x: DTensor, index) -> DTensor | None:
    """``x[index]`` behind prefix tokens (``None``: the token dim stays whole): the pixel
    tokens (``x[:, p:]``) or a part of the prefix (``x[:, 0]``) from its owner."""
    items, lays = _items(x, index), [lay for lay in split_layouts(x) if lay.prefix]
    d, p, n = lays[0].dim, lays[0].prefix, x.shape[lays[0].dim]
    if items is not None and items[d] == slice(None):
        return None
    what = "indexing (x[...])"
    if items is None or any(i != slice(None) for e, i in enumerate(items) if e != d):
        raise _refuse(
            what,
            f"index {index!r} of tokens {tuple(x.shape)} behind {p} prefix tokens indexes "
            f"more than the token dim (dim {d})",
            "Index the token dim alone (x[:, p:], x[:, :p], x[:, 0])",
        )
    i, local, owner = items[d], x.to_local(), all(lay.rank == 0 for lay in lays)
    picked = range(n)[i] if isinstance(i, slice) else range(n)[i : i + 1 or None]
    if isinstance(i, slice) and i.step in (None, 1) and picked == range(p, n):
        out = local.narrow(d, p, local.shape[d] - p) if owner else local
        return wrap(out, x, _plain(x.placements), index_shape(x.shape, items))
    if not picked or max(picked) >= p or not (isinstance(i, int) or i.step in (None, 1)):
        raise _refuse(
            what,
            f"index {i!r} of the token dim {d} of {tuple(x.shape)} mixes its {p} prefix "
            f"tokens (on the first rank) with the pixel tokens (split over the ranks)",
            "Take the prefix (x[:, :p], x[:, 0]) and the pixel tokens (x[:, p:]) apart",
        )
    shape = list(local.shape)
    shape[d] = len(picked)
    ring = token_ring(x.device_mesh, tuple(lays))
    src = next(r for r, m in enumerate(ring.members) if all(lay.rank == 0 for lay in m))
    part = local.narrow(d, picked[0], len(picked) if owner else 0)
    out = _FromOwner.apply(part, ring.group, shape, d, src)
    out = out.select(d, 0) if isinstance(i, int) else out
    placements = [Replicate() if prefix_of(q) else q for q in x.placements]
    grads = [Partial() if prefix_of(q) else q for q in x.placements]
    global_shape = index_shape(x.shape, items)
    return DTensor.from_local(
        out, x.device_mesh, placements, run_check=False, shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(), grad_placements=grads,
    )  # fmt: skip


def _indexing(index_of, fn, prev):
    """Handler of ``x[index_of(x, *args)]``: ``_prefix_index``, ``_local_index``, else
    ``prev``."""

    def local(x, *args, **kwargs):
        out = _local_index(x, index_of(x, *args, **kwargs))
        return prev(x, *args, **kwargs) if out is None else out

    kept = _keeps_prefix(fn, local)

    def handler(x, *args, **kwargs):
        if not has_prefix(x):
            return local(x, *args, **kwargs)
        out = _prefix_index(x, index_of(x, *args, **kwargs))
        return kept(x, *args, **kwargs) if out is None else out

    return handler


chain_each((_T.__getitem__,), partial(_indexing, lambda x, index: index), "prefix")
chain_each((torch.select, _T.select), partial(_indexing, _select), "prefix")
