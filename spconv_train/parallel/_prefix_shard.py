"""The placements of token dims: ``PrefixShard`` (prefix tokens in front, ``_token_prefix.py``),
``placement`` and ``reduced_placements``."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


class PrefixShard(_StridedShard):
    """``_StridedShard(dim, split_factor)`` of the pixel tokens behind ``prefix`` tokens held
    by the first rank of the mesh dim. ``prefix`` is keyword-only: code copying a
    ``_StridedShard`` by its two fields fails instead of dropping it. It compares equal to
    that ``_StridedShard`` (the local tensors are laid out alike), so DTensor's own rules
    (the sum of two gradients, the check of a gradient's placements) take it without moving
    data; its hash counts the prefix, so that DTensor's cache of sharding decisions keeps the
    two apart (an output spec copying its input's placements must not hand a prefix to
    pixel tokens of the same shape)."""

    def __init__(self, dim: int, split_factor: int = 1, *, prefix: int) -> None:
        super().__init__(dim, split_factor=split_factor)
        self.prefix = int(prefix)

    def __hash__(self) -> int:
        return hash((self.dim, self.split_factor, self.prefix))

    def __repr__(self) -> str:
        return f"PrefixShard(dim={self.dim}, sf={self.split_factor}, prefix={self.prefix})"

    __str__ = __repr__


def prefix_of(p) -> int:
    """The prefix tokens placement ``p`` puts on the first rank (0: none)."""
    return p.prefix if isinstance(p, PrefixShard) else 0


def placement(dim: int, sf: int = 1, prefix: int = 0):
    """The shard of ``dim``: a ``Shard``, a ``_StridedShard`` of split factor ``sf`` > 1, or
    a ``PrefixShard`` with ``prefix`` tokens."""
    if prefix:
        return PrefixShard(dim, sf, prefix=prefix)
    return Shard(dim) if sf == 1 else _StridedShard(dim, split_factor=sf)


def reduced_placements(x: DTensor, dims, keepdim: bool = False) -> list:
    """``x``'s placements once ``dims`` are reduced (or indexed away, ``keepdim`` False):
    a shard of one of them ``Replicate``, every other moved to its new dim."""
    out = []
    for p in x.placements:
        if p.is_shard() or isinstance(p, _StridedShard):
            d = p.dim % x.ndim
            sf, new = getattr(p, "split_factor", 1), d if keepdim else d - sum(r < d for r in dims)
            p = Replicate() if d in dims else placement(new, sf, prefix_of(p))
        out.append(p)
    return out
