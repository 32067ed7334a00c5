"""Global result shapes of torch ops, probed on meta tensors (torch's own rules and checks:
``torch.cat`` skipping legacy empty 1-D tensors, ``split``'s sections, a reshape's ``-1``) for
tens of microseconds, so cached per (op, shapes, arguments) in a bounded cache; arguments
that cannot be a key probe every call, and a failed probe is not cached (torch's error)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

#: the shape of a result: one tuple, or one per tensor of a tuple / list result
Shape = tuple


def _run(func: Callable, shapes: tuple, many: bool, dtype, args: tuple, kwargs: tuple) -> Shape:
    metas = [torch.empty(s, device="meta", dtype=dtype) for s in shapes]
    out = func(metas if many else metas[0], *args, **dict(kwargs))
    many_out = isinstance(out, (tuple, list))
    return tuple(tuple(o.shape) for o in out) if many_out else tuple(out.shape)


def _types(x):
    """The types of an argument's leaves: ``1``, ``1.0`` and ``True`` are equal keys to a
    dict, but ``t[1]`` drops a dim where ``t[True]`` adds one."""
    if isinstance(x, (tuple, list)):
        return tuple(_types(i) for i in x)
    return type(x)


@functools.lru_cache(maxsize=1024)
def _cached(types: tuple, *key) -> Shape:
    return _run(*key)


def _probe(func: Callable, shapes: tuple, many: bool, dtype, args: tuple, kwargs: dict) -> Shape:
    key = (func, shapes, many, dtype, args, tuple(kwargs.items()))
    # a tensor argument would be kept alive by the cache (and hashes by identity)
    if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
        return _run(*key)
    try:
        hash(key)
    except TypeError:  # e.g. a list or slice argument: probed every call
        return _run(*key)
    return _cached(_types(key[4:]), *key)


def result_shape(
    func: Callable, shape: Sequence[int], /, *args, meta_dtype=None, **kwargs
) -> Shape:
    """The global shape of ``func(t, *args, **kwargs)`` for ``t`` of ``shape`` and
    ``meta_dtype`` (a tuple of shapes for a tuple result: ``split``, ``max`` over a dim)."""
    return _probe(func, (tuple(shape),), False, meta_dtype, args, kwargs)


def index_shape(shape: Sequence[int], items: tuple) -> Shape:
    """The global shape of ``t[items]`` (basic indices) for a tensor ``t`` of ``shape``."""
    key = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else (i,) for i in items)
    return _probe(_index, (tuple(shape),), False, None, (key,), {})


def _index(t, key: tuple):
    return t[tuple(slice(*k) if len(k) == 3 else k[0] for k in key)]


def cat_shape(shapes: Sequence[Sequence[int]], dim: int) -> Shape:
    """The global shape of ``torch.cat`` of tensors of ``shapes`` along ``dim``."""
    return _probe(torch.cat, tuple(tuple(s) for s in shapes), True, None, (dim,), {})
