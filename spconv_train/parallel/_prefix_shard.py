"""The placements of token dims: ``PrefixShard`` (prefix tokens in front, ``_token_prefix.py``),
``placement`` and ``reduced_placements``."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


class PrefixShard(_StridedShard):
    """``_StridedShard(dim, split_factor)`` of the pixel tokens behind ``prefix`` tokens held
    by the first rank. ``prefix`` is keyword-only: code copying a ``_StridedShard`` by its
    two fields fails instead of dropping it. Equal to that ``_StridedShard`` (laid out
    alike: DTensor's rules, a gradient sum or check, take it without moving data); its hash
    counts the prefix (DTensor's sharding cache must not hand it to plain pixel tokens)."""

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
    """The shard of ``dim``: ``Shard``, ``_StridedShard`` (``sf`` > 1) or ``PrefixShard``."""
    if prefix:
        return PrefixShard(dim, sf, prefix=prefix)
    return Shard(dim) if sf == 1 else _StridedShard(dim, split_factor=sf)


def reduced_placements(x: DTensor, dims, keepdim: bool = False) -> list:
    """``x``'s placements once ``dims`` are reduced (or indexed away, ``keepdim`` False)."""
    out = []
    for p in x.placements:
        if p.is_shard() or isinstance(p, _StridedShard):
            d = p.dim % x.ndim
            sf, new = getattr(p, "split_factor", 1), d if keepdim else d - sum(r < d for r in dims)
            p = Replicate() if d in dims else placement(new, sf, prefix_of(p))
        out.append(p)
    return out
