"""Small helpers shared by the ops that work on any tensor dimension (reductions, slicing,
re-chunking, permutes): which tensor dims a DTensor's placements shard, and how to wrap a
local result back into a DTensor of a given global shape.

Only plain ``Shard``/``Replicate`` placements are handled here; anything else (``Partial``,
``_StridedShard``) makes these handlers hand the call back to DTensor (``handled`` False),
whose own rules then apply (and, for a move of a sharded activation, the no-gather guard).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard


def handled(x) -> bool:
    """True for a DTensor whose placements are all exactly ``Shard`` or ``Replicate``."""
    return isinstance(x, DTensor) and all(type(p) in (Shard, Replicate) for p in x.placements)


def norm_dim(d: int, ndim: int) -> int:
    """``d`` as a non-negative dimension index of an ``ndim``-D tensor."""
    if not -ndim <= d < max(ndim, 1):
        raise IndexError(f"dimension {d} out of range for a {ndim}-D tensor")
    return d % ndim if ndim else 0


def shard_dim(x: DTensor, i: int) -> int | None:
    """Tensor dim that mesh dim ``i`` shards (non-negative), or None."""
    p = x.placements[i]
    return norm_dim(p.dim, x.ndim) if isinstance(p, Shard) else None


def sharded_dims(x: DTensor) -> dict[int, int]:
    """``{tensor dim: mesh dim}`` for every sharded dimension of ``x``."""
    out = {}
    for i in range(len(x.placements)):
        d = shard_dim(x, i)
        if d is not None:
            out[d] = i
    return out


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def wrap(local: Tensor, x: DTensor, placements, shape) -> DTensor:
    """``local`` as a DTensor on ``x``'s mesh with ``placements`` and global ``shape``."""
    return DTensor.from_local(
        local,
        x.device_mesh,
        tuple(placements),
        run_check=False,
        shape=tuple(shape),
        stride=contiguous_stride(tuple(shape)),
    )
