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
* element-wise arithmetic with a plain tensor (an absolute position embedding
  ``(1, L, C)`` is sliced to the rank's tokens, its gradient summed over the ranks);
  ``F.linear``, activations and dropout already run locally; norms and reductions over
  the channels: ``_token_reduce.py``.

A reshape that would mix the tokens of different ranks is refused with
``SpatialShardingError`` naming the op and the module. Prefix tokens (a ViT's class and
register tokens, ``_token_prefix.py``) are counted in ``TokenLayout.prefix``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from . import _channels  # noqa: F401  (its handlers are wrapped below)
from ._broadcast import ARITH, guard_computed_plain  # (and its handlers, wrapped below)
from ._dims import is_dp, mesh_group, mesh_rank, wrap
from ._errors import module_path, run_dtensor_op
from ._geometry import SpatialShardingError, all_shard_bounds, shard_bounds
from ._halo import sum_grad_over
from ._mode import register_handler
from ._prefix_shard import placement, prefix_of
from ._registry import DEFAULT_REGISTRY, function_name
from ._sharding import sharded_dim, sharding_mesh_dims


@dataclass(frozen=True)
class TokenLayout:
    """How one mesh dimension splits a tensor dimension: the dim viewed as
    ``(split_factor, inner, unit)``, ``inner`` chunked like DTensor's ``Shard``, every
    entry of it a whole run of ``unit`` (``split_factor`` and ``unit`` 1: a plain ``Shard``;
    ``unit`` 1: DTensor's ``_StridedShard``). Several mesh dims splitting one dim nest
    (``split_layouts``): on H x W tiles the tokens ``L = H * W`` are ``(1, H, W)`` chunked
    over ``sp_h`` and ``(H, W, 1)`` over ``sp_w``; a rank holds the tokens every one of them
    gives it (``held_indices``). ``prefix`` entries in front of all that (``PrefixShard``)
    belong to rank 0 alone."""

    dim: int
    mesh_dim: int
    split_factor: int
    inner: int
    parts: int
    rank: int
    unit: int = 1
    prefix: int = 0

    def sizes(self) -> tuple[int, ...]:
        """How many entries of ``dim`` every rank holds (this mesh dim's split alone)."""
        return tuple(
            self.split_factor * (b - a) * self.unit + (self.prefix if r == 0 else 0)
            for r, (a, b) in enumerate(all_shard_bounds(self.inner, self.parts))
        )

    def indices(self) -> Tensor:
        """Global indices along ``dim`` that this rank holds (this mesh dim's split alone),
        in its local order: the prefix (on rank 0), then its pixel tokens."""
        a, b = shard_bounds(self.inner, self.parts, self.rank)
        outer = torch.arange(self.split_factor).view(-1, 1, 1) * (self.inner * self.unit)
        mid = torch.arange(a, b).view(1, -1, 1) * self.unit
        idx = (outer + mid + torch.arange(self.unit).view(1, 1, -1)).reshape(-1) + self.prefix
        return torch.cat([torch.arange(self.prefix), idx]) if self.rank == 0 else idx


def _nest(n: int, chain: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """``{mesh dim: (inner, unit)}`` of the mesh dims splitting one ``n``-long dim,
    ``chain`` their ``(split_factor, mesh dim)`` sorted: each chunks the factor between its
    split factor and the next one's (the last: the rest). A split factor equal to the next
    one's chunks a factor of 1 (a map one row, or one window row, high split over ``sp_h``:
    its first rank holds it all). Split factors that do not nest keep the one-dim meaning:
    the rest of the dim chunked, ``unit`` 1."""
    out = {}
    for j, (sf, m) in enumerate(chain):
        nxt = chain[j + 1][0] if j + 1 < len(chain) else n
        if nxt >= sf and nxt % sf == 0 and n % max(nxt, 1) == 0:
            out[m] = (nxt // sf, n // nxt)
        else:
            out[m] = (n // sf, 1)
    return out


def split_layouts(x: DTensor) -> list[TokenLayout]:
    """One ``TokenLayout`` per mesh dimension that shards a dimension of ``x``, in mesh
    dim order. Several mesh dims on one tensor dim nest by their split factors
    (``_nest``), except a ``dp`` mesh dim: it splits whole images (its one-dim meaning)."""
    mesh = x.device_mesh
    chains: dict[int, list[tuple[int, int]]] = {}
    found: dict[int, tuple[int, int, int, int]] = {}  # mesh dim: dim, split factor, inner, unit
    for i, p in enumerate(x.placements):
        d = sharded_dim(p)
        if d is None:
            continue
        d %= x.ndim
        sf = p.split_factor if isinstance(p, _StridedShard) else 1
        if is_dp(x, i):
            found[i] = (d, sf, x.shape[d] // sf, 1)
        else:
            chains.setdefault(d, []).append((sf, i))
    for d, chain in chains.items():
        # prefix tokens (on every mesh dim of the chain alike) stand in front of the nesting
        prefix = max(prefix_of(x.placements[i]) for _, i in chain)
        nest = _nest(x.shape[d] - prefix, sorted(chain))
        found.update({i: (d, sf, *nest[i]) for sf, i in chain})
    return [
        TokenLayout(
            d, i, sf, inner, mesh.size(i), mesh_rank(mesh, i), unit, prefix_of(x.placements[i])
        )
        for i, (d, sf, inner, unit) in sorted(found.items())
    ]


def dim_layouts(lays: list[TokenLayout], dim: int) -> tuple[TokenLayout, ...]:
    """The layouts of ``lays`` that split ``dim``."""
    return tuple(lay for lay in lays if lay.dim == dim)


def held_indices(lays: tuple[TokenLayout, ...]) -> Tensor:
    """Global indices along one dim that the rank of ``lays`` (every layout splitting the
    dim, each with that rank's place on its mesh dim) holds, in its local order."""
    idx = lays[0].indices()
    for lay in lays[1:]:
        idx = idx[torch.isin(idx, lay.indices())]
    return idx


def is_tokens(x) -> bool:
    """True for a DTensor with a ``_StridedShard`` placement (flattened sharded pixels)."""
    return isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements)


def is_nested(x) -> bool:
    """True for a DTensor split over several spatial mesh dims (H x W tiles, rows on a
    ``(sp_h, sp_w)`` mesh, their tokens): a reshape of it runs on the local tensor here."""
    if not isinstance(x, DTensor):
        return False
    lays = [m for m in split_layouts(x) if not is_dp(x, m.mesh_dim)]
    return len(lays) > 1 and any(m.dim for m in lays)


def _target(
    shape: tuple[int, ...], lay: TokenLayout, out_shape: tuple[int, ...], last: bool = False
):
    """``(output dim, split factor, unit)`` of ``lay``'s sharded factor after a reshape to
    ``out_shape``; ``None`` if the reshape mixes that factor with others. A sharded factor
    of size 1 fits several output dims: the first, or with ``last`` the innermost
    (``_windows.py``: a single window's index). Behind a prefix the dim stays whole."""
    if lay.prefix:
        head = math.prod(shape[: lay.dim])
        for e, n in enumerate(out_shape):
            if n == shape[lay.dim] and math.prod(out_shape[:e]) == head:
                return e, lay.split_factor, lay.unit
        return None
    before = math.prod(shape[: lay.dim]) * lay.split_factor
    after = math.prod(shape[lay.dim + 1 :]) * lay.unit
    dims = list(enumerate(out_shape))
    found = []
    for e, n in reversed(dims) if last else dims:
        head, tail = math.prod(out_shape[:e]), math.prod(out_shape[e + 1 :])
        if not head or not tail or before % head or after % tail:
            continue
        sf, unit = before // head, after // tail
        if sf * max(lay.inner, 1) * unit == n and (n > 1 or lay.inner <= 1):
            found.append((e, sf, unit))
    # a factor followed by the same runs as before (``unit`` kept) first: the others put
    # it before (part of) the dims after it, which the placements say only when nested
    kept = [f for f in found if f[2] == lay.unit]
    return (kept or found or [None])[0]


def _mixes(x: DTensor, out_shape: tuple[int, ...], what: str, lay, why: str) -> Exception:
    return SpatialShardingError(
        f"{what} from {tuple(x.shape)} to {tuple(out_shape)} in module '{module_path()}' "
        f"would mix the tokens (pixels) of different ranks: dim {lay.dim} is split over mesh "
        f"dim {lay.mesh_dim} as {x.placements[lay.mesh_dim]}{why}. Reshape so that the token "
        f"dim stays whole (e.g. (N, L, C) <-> (N, L, heads, d), or back to (N, C, H, W)), "
        f"or gather explicitly (x.full_tensor())."
    )


def reshaped_layout(x: DTensor, out_shape: tuple[int, ...], what: str):
    """``(placements, local shape)`` of ``x`` reshaped to ``out_shape`` with every sharded
    factor kept whole; refuses (``SpatialShardingError`` naming ``what`` and the module) a
    reshape that mixes the tokens of several ranks or nests them in a way the placements
    cannot say (e.g. the token dim merged with the channels: runs of ``C`` entries)."""
    placements = list(x.placements)
    lays = split_layouts(x)
    placed = {}
    for lay in lays:
        found = _target(tuple(x.shape), lay, out_shape)
        if found is None:
            raise _mixes(x, out_shape, what, lay, "")
        placed[lay.mesh_dim] = found
        placements[lay.mesh_dim] = placement(found[0], found[1], lay.prefix)
    for lay in lays:
        e, sf, unit = placed[lay.mesh_dim]
        chain = sorted((f, m) for m, (d, f, _) in placed.items() if d == e and not is_dp(x, m))
        n = out_shape[e] - lay.prefix
        want = _nest(n, chain).get(lay.mesh_dim, (n // sf, 1))
        if want[1] != unit:
            raise _mixes(x, out_shape, what, lay, f" (runs of {unit} entries of dim {e})")
    shares = {}
    for lay in lays:
        e = placed[lay.mesh_dim][0]
        a, b = shard_bounds(lay.inner, lay.parts, lay.rank)
        own, total = shares.get(e, (1, 1))
        shares[e] = (own * (b - a), total * max(lay.inner, 1))
    local_shape = [
        n * shares[e][0] // shares[e][1] if e in shares else n for e, n in enumerate(out_shape)
    ]
    for lay in lays:  # a dim behind a prefix is the same dim, as long as before
        if lay.prefix:
            local_shape[placed[lay.mesh_dim][0]] = x.to_local().shape[lay.dim]
    return placements, tuple(local_shape)


def local_reshape(x: DTensor, out_shape: tuple[int, ...], what: str, fn=None) -> DTensor:
    """``x`` reshaped to the global ``out_shape`` on the local tensor, each sharded factor
    kept whole (``fn(local, local_shape)``: the op, ``reshape`` by default)."""
    placements, local_shape = reshaped_layout(x, out_shape, what)
    local = x.to_local()
    out = fn(local, local_shape) if fn else local.reshape(local_shape)
    return wrap(out, x, placements, out_shape)


def previous(fn) -> Callable:
    """The handler registered for ``fn`` so far, else DTensor's own rules (errors named)."""
    prev = DEFAULT_REGISTRY.handler(fn)
    return prev or (lambda *args, **kwargs: run_dtensor_op(fn, args, kwargs))


def chain(*functions, prefix: str = "token"):
    """Decorator: ``handler(prev, *args, **kwargs)`` becomes the handler of each of
    ``functions``, ``prev`` the one before it (``previous``), called for what it leaves."""

    def deco(handler):
        for fn in functions:
            prev = previous(fn)

            def run(*args, _prev=prev, **kwargs):
                return handler(_prev, *args, **kwargs)

            run.__name__ = f"{prefix}_{getattr(fn, '__name__', 'op')}"
            register_handler(fn)(run)
        return handler

    return deco


#: the matrix products (handlers in ``_attention_explicit.py`` and ``_windows.py``)
MATMULS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm)
#: the reshape-like ops, each a handler here and in ``_windows.py``
RESHAPES = (torch.reshape, torch.Tensor.reshape, torch.flatten, torch.Tensor.flatten)
RESHAPES += (torch.unflatten, torch.Tensor.unflatten, torch.Tensor.view)


def reshape_of(func, x: DTensor, args, kwargs) -> tuple[tuple[int, ...], Callable | None]:
    """``(global shape, fn)`` of ``func(x, *args, **kwargs)`` (one of ``RESHAPES``), ``fn``
    for ``local_reshape`` (a view for ``Tensor.view``); the shape ``None`` for a dtype view."""
    fn = (lambda t, s: t.view(s)) if func is torch.Tensor.view else None
    if (args and isinstance(args[0], torch.dtype)) or "dtype" in kwargs:
        return None, fn
    return _meta_shape(func, x, *args, **kwargs), fn


def _meta_shape(func, x: DTensor, *args, **kwargs) -> tuple[int, ...]:
    return tuple(func(torch.empty(x.shape, device="meta"), *args, **kwargs).shape)


def _reshaping(func):
    """Handler for ``func`` (a reshape-like op): local on token tensors, else DTensor's."""
    what = function_name(func)

    def handler(x, *args, **kwargs):
        tokens = is_tokens(x) or is_nested(x)
        shape, fn = reshape_of(func, x, args, kwargs) if tokens else (None, None)
        if shape is None:
            return run_dtensor_op(func, (x, *args), kwargs)  # DTensor's own
        return local_reshape(x, shape, what, fn)

    handler.__name__ = f"token_{func.__name__}"
    return handler


for _fn in RESHAPES:
    register_handler(_fn)(_reshaping(_fn))


def _grad_groups(x: DTensor, exclude: tuple[TokenLayout, ...] = ()) -> tuple:
    """The process groups of the mesh dims splitting ``x``, but those of ``exclude``."""
    skip = {lay.mesh_dim for lay in exclude}
    dims = sharding_mesh_dims(x.placements)
    return tuple(mesh_group(x.device_mesh, i) for i in dims if i not in skip)


def _unheld(x: DTensor, plain: Tensor, d: int, held: int, what: str) -> Exception:
    return SpatialShardingError(
        f"{what} of a token tensor {tuple(x.shape)} {x.placements} and a plain tensor "
        f"{tuple(plain.shape)} in module '{module_path()}': this rank holds "
        f"{x.to_local().shape[d]} entries of dim {d}, but those placements give it {held} "
        f"(its local tensor is not the token layout of _tokens.py, e.g. built by "
        f"DTensor.from_local with other shard sizes). Make the tokens by flattening the "
        f"sharded map (x.flatten(2).transpose(1, 2)), or gather explicitly (x.full_tensor())."
    )


def local_part(plain: Tensor, x: DTensor, skip: int | None = None, what: str = "an op") -> Tensor:
    """The part of ``plain`` (broadcast against ``x``'s global shape, e.g. a position
    embedding ``(1, L, C)``) that meets this rank's entries of ``x`` (all of dim ``skip``
    of ``x``), with its gradient summed over the ranks that split ``x``. Refuses
    (``SpatialShardingError`` naming ``what`` and the module) a local tensor of ``x`` that
    does not hold the entries its placements give the rank."""
    part = sum_grad_over(plain, _grad_groups(x))
    lead = x.ndim - part.ndim
    lays = split_layouts(x)
    for d in sorted({lay.dim for lay in lays} - {skip}):
        k = d - lead
        if k >= 0 and part.shape[k] != 1:
            idx = held_indices(dim_layouts(lays, d))
            # a mismatch would fail in the op as a bare size error, or broadcast a local
            # dim of size 1 against the picked entries
            if idx.numel() != x.to_local().shape[d]:
                raise _unheld(x, plain, d, idx.numel(), what)
            part = part.index_select(k, idx.to(part.device))
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
    # here, not in local_part: the attention masks and biases it cuts (_ring_mask.py) have
    # a window's size, not the image's
    guard_computed_plain(plain, dt, [lay.dim for lay in split_layouts(dt)], function_name(fn))
    part = local_part(plain, dt, what=function_name(fn))
    la, lb = (dt.to_local(), part) if a is dt else (part, dt.to_local())
    return wrap(fn(la, lb, *args, **kwargs), dt, dt.placements, shape)


def _arith_or_previous(fn):
    """Handler: ``_arith`` when the first or second argument is a token tensor."""

    def handler(prev, *args, **kwargs):
        tokens = any(is_tokens(a) for a in args[:2])
        return _arith(fn, *args, **kwargs) if tokens else prev(*args, **kwargs)

    return handler


for _fn in ARITH:
    chain(_fn)(_arith_or_previous(_fn))
