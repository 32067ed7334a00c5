"""Reshapes of token tensors keeping each sharded factor whole, locally (``local_reshape``;
DTensor refuses uneven ones), one mixing ranks' tokens refused by name; ``chain_each``: the
token modules' handler registration. docs/attention.md."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import _channels  # noqa: F401  (first: the token modules' handlers wrap its)
from ._compile import graph_handler, in_dtensor_graphs
from ._dims import is_dp, wrap
from ._errors import module_path, run_dtensor_op
from ._geometry import SpatialShardingError, shard_bounds
from ._mode import register_handler
from ._prefix_shard import placement
from ._runtime import DEFAULT_REGISTRY
from ._token_layout import TokenLayout, _nest, is_tokens, split_layouts  # noqa: F401  (re-exported)


def is_nested(x) -> bool:
    """True for a DTensor split over several spatial mesh dims (tiles, rows, their tokens)."""
    if not isinstance(x, DTensor):
        return False
    lays = [m for m in split_layouts(x) if not is_dp(x, m.mesh_dim)]
    return len(lays) > 1 and any(m.dim for m in lays)


def fits(shape: tuple, lay: TokenLayout, out_shape: tuple) -> list[tuple[int, int, int]]:
    """Every ``(output dim, split factor, unit)`` where ``lay``'s sharded factor lands whole
    after a reshape to ``out_shape`` (a factor of size 1: on several, in dim order)."""
    before = math.prod(shape[: lay.dim]) * lay.split_factor
    after = math.prod(shape[lay.dim + 1 :]) * lay.unit
    found = []
    for e, n in enumerate(out_shape):
        head, tail = math.prod(out_shape[:e]), math.prod(out_shape[e + 1 :])
        if not head or not tail or before % head or after % tail:
            continue
        sf, unit = before // head, after // tail
        if sf * max(lay.inner, 1) * unit == n and (n > 1 or lay.inner <= 1):
            found.append((e, sf, unit))
    return found


def _target(shape: tuple, lay: TokenLayout, out_shape: tuple, last: bool = False):
    """The ``fits`` of ``lay`` after a reshape, ``None`` if it mixes with others: the first,
    or with ``last`` the innermost (a single window's index)."""
    if lay.prefix:  # the dim stays whole
        head, n = math.prod(shape[: lay.dim]), shape[lay.dim]
        found = [e for e, m in enumerate(out_shape) if m == n and math.prod(out_shape[:e]) == head]
        return (found[0], lay.split_factor, lay.unit) if found else None
    found = fits(shape, lay, out_shape)
    # a factor followed by the same runs as before (``unit`` kept) first: the others put
    # it before (part of) the dims after it, which the placements say only when nested
    kept = [f for f in found if f[2] == lay.unit]
    return (kept or found or [None])[-1 if last else 0]


def _mixes(x: DTensor, out_shape: tuple[int, ...], what: str, lay, why: str) -> Exception:
    return SpatialShardingError(
        f"{what} from {tuple(x.shape)} to {tuple(out_shape)} in module '{module_path()}' "
        f"would mix the tokens (pixels) of different ranks: dim {lay.dim} is split over mesh "
        f"dim {lay.mesh_dim} as {x.placements[lay.mesh_dim]}{why}. Reshape so that the token "
        f"dim stays whole (e.g. (N, L, C) <-> (N, L, heads, d), or back to (N, C, H, W)), "
        f"or gather explicitly (x.full_tensor())."
    )


def local_reshape(x: DTensor, out_shape: tuple[int, ...], what: str, fn=None) -> DTensor:
    """``x`` reshaped to ``out_shape`` locally (``fn(local, shape)``, else ``reshape``), every
    sharded factor kept whole; refuses by name (``what``) one mixing ranks' tokens or nesting
    them in a way the placements cannot say (the token dim merged with the channels)."""
    placements, lays, placed, shares = list(x.placements), split_layouts(x), {}, {}
    for lay in lays:
        found = _target(tuple(x.shape), lay, out_shape)
        if found is None:
            raise _mixes(x, out_shape, what, lay, "")
        placed[lay.mesh_dim], e = found, found[0]
        placements[lay.mesh_dim] = placement(e, found[1], lay.prefix)
        a, b = shard_bounds(lay.inner, lay.parts, lay.rank)
        own, total = shares.get(e, (1, 1))
        shares[e] = (own * (b - a), total * max(lay.inner, 1))
    for lay in lays:
        e, sf, unit = placed[lay.mesh_dim]
        chain = sorted((f, m) for m, (d, f, _) in placed.items() if d == e and not is_dp(x, m))
        n = out_shape[e] - lay.prefix
        want = _nest(n, chain).get(lay.mesh_dim, (n // sf, 1))
        if want[1] != unit:
            raise _mixes(x, out_shape, what, lay, f" (runs of {unit} entries of dim {e})")
        if lay.prefix:  # a dim behind a prefix is the same dim, as long as before
            shares[e] = (x.to_local().shape[lay.dim], out_shape[e])
    local_shape = tuple(
        n * shares[e][0] // shares[e][1] if e in shares else n for e, n in enumerate(out_shape)
    )
    out = fn(x.to_local(), local_shape) if fn else x.to_local().reshape(local_shape)
    return wrap(out, x, placements, out_shape)


def chain(*functions, prefix: str = "token", graph: bool = False):
    """Decorator: ``handler(prev, *args, **kwargs)`` the handler of each of ``functions``
    (``chain_each``), ``prev`` the one before it."""

    def deco(handler):
        chain_each(
            functions, lambda fn, prev: lambda *a, **k: handler(prev, *a, **k), prefix, graph
        )
        return handler

    return deco


def chain_each(functions, make, prefix: str = "token", graph: bool = False) -> None:
    """Register ``make(fn, prev)`` for each of ``functions``, ``prev`` the handler before it
    (else DTensor's rules, errors named); ``graph``: graph material where ``prev`` is (a
    wrapper must not make an element-wise op a graph break, ``_compile.graph_handler``)."""
    for fn in functions:
        prev = DEFAULT_REGISTRY.handler(fn) or (lambda *a, _fn=fn, **k: run_dtensor_op(_fn, a, k))
        handler = make(fn, prev)
        handler.__name__ = f"{prefix}_{getattr(fn, '__name__', 'op')}"
        marked = graph and in_dtensor_graphs(prev)
        register_handler(fn)(graph_handler(handler) if marked else handler)


#: the matrix products (handlers in ``_attention_explicit.py`` and ``_windows.py``)
MATMULS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm)
