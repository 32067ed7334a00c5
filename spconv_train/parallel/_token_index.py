"""Basic indexing of token tensors along dims no rank splits: ``kv[0]`` of SegFormer's and
timm's stacked keys and values, ``x.select(0, i)``, ``x[:, :, 0]``.

The result is the local tensor indexed the same way; the split dims only shift. DTensor's
own rule would run ``select`` here too, but its backward (``select_backward``) builds the
gradient from the *global* size, turned into a local one by DTensor's chunking, which is
not the token layout of a dim split over several mesh dims (H x W tiles, ``_tokens.py``):
run locally, autograd takes the backward on the local tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._dims import norm_dim, wrap
from ._mode import register_handler
from ._rechunk import _expand_index  # (and its __getitem__ handler, chained below)
from ._registry import DEFAULT_REGISTRY
from ._tokens import is_nested, is_tokens, split_layouts


def _shifted(p, removed: list[int]):
    """Placement ``p`` once the dims in ``removed`` are indexed away."""
    if isinstance(p, _StridedShard):
        return _StridedShard(p.dim - sum(r < p.dim for r in removed), split_factor=p.split_factor)
    if isinstance(p, Shard):
        return Shard(p.dim - sum(r < p.dim for r in removed))
    return p


def _local_index(x, items: tuple) -> DTensor | None:
    """``x[items]`` on the local tensor when ``x`` is a token tensor and ``items`` (ints
    and slices, one per dim) leaves every split dim whole; ``None`` otherwise."""
    if not (is_tokens(x) or is_nested(x)) or items is None:
        return None
    if any(items[lay.dim] != slice(None) for lay in split_layouts(x)):
        return None
    removed = [d for d, i in enumerate(items) if isinstance(i, int)]
    placements = [_shifted(p, removed) for p in x.placements]
    shape = torch.empty(x.shape, device="meta")[items].shape
    return wrap(x.to_local()[items], x, placements, shape)


def _chained(fn, handler) -> None:
    prev = DEFAULT_REGISTRY.handler(fn) or fn

    def run(x, *args, **kwargs):
        out = handler(x, *args, **kwargs) if isinstance(x, DTensor) else None
        return out if out is not None else prev(x, *args, **kwargs)

    run.__name__ = f"token_{fn.__name__}"
    register_handler(fn)(run)


def _getitem(x, index):
    return _local_index(x, _expand_index(index, x.ndim))


def _select(x, dim, index):
    if not isinstance(dim, int) or not isinstance(index, int):
        return None
    d = norm_dim(dim, x.ndim)
    return _local_index(x, tuple(index if e == d else slice(None) for e in range(x.ndim)))


_chained(torch.Tensor.__getitem__, _getitem)
for _fn in (torch.select, torch.Tensor.select):
    _chained(_fn, _select)
