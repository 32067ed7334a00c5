"""``PrefixShard``: the placement of a token dim with prefix tokens (a ViT's class and
register tokens) in front of the pixel tokens, held by one rank alone: the first of every
mesh dim that splits the tokens (of ``sp`` on strips; of ``sp_h`` and ``sp_w`` on tiles and
rows), each of which carries a ``PrefixShard``. ``_tokens.py`` reads it into
``TokenLayout.prefix``; ``_token_prefix.py`` makes it and keeps it through the ops."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import _StridedShard


class PrefixShard(_StridedShard):
    """``_StridedShard(dim, split_factor)`` of the pixel tokens behind ``prefix`` tokens that
    the first rank of the mesh dim holds in front of its own: the dim is the ``prefix``
    tokens, then the pixel tokens (nested as without prefix where several mesh dims split
    them: ``_tokens.split_layouts``). ``prefix`` is keyword-only, so that code copying a
    ``_StridedShard`` by its two fields fails instead of dropping it.

    It compares equal to that ``_StridedShard``: the local tensors are laid out alike, so
    DTensor's own rules (the sum of two gradients of a tensor used twice, the check of a
    gradient's placements against its forward's) take it as is, without moving data;
    what the prefix changes is read from ``TokenLayout`` (``_tokens.py``) and put back
    after DTensor's ops (``_token_prefix.py``). Its hash counts the prefix, so that
    DTensor's cache of sharding decisions keeps the two apart (an output spec that copies
    its input's placements must not hand a prefix to pixel tokens of the same shape)."""

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
