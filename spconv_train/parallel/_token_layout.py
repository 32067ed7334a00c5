"""Which entries of each dim of a sharded DTensor every rank holds (``split_layouts``), and
``local_part``: the part of a plain tensor meeting a rank's entries. docs/attention.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from ._dims import is_dp, mesh_rank
from ._errors import module_path
from ._geometry import SpatialShardingError, shard_bounds
from ._halo import sum_grad_over
from ._prefix_shard import prefix_of
from ._sharding import grad_groups, sharded_dim


@dataclass(frozen=True)
class TokenLayout:
    """How mesh dim ``mesh_dim`` splits ``dim``: ``prefix`` entries (rank 0's), then the dim
    viewed as ``(split_factor, inner, unit)``, ``inner`` chunked like ``Shard`` over
    ``parts`` ranks (``unit`` > 1: tiles nest, ``split_layouts``)."""

    dim: int
    mesh_dim: int
    split_factor: int
    inner: int
    parts: int
    rank: int
    unit: int = 1
    prefix: int = 0

    def held(self) -> int:
        """How many entries of ``dim`` this rank holds (this mesh dim's split alone)."""
        a, b = shard_bounds(self.inner, self.parts, self.rank)
        return self.split_factor * (b - a) * self.unit + (self.prefix if self.rank == 0 else 0)

    def indices(self) -> Tensor:
        """Global indices along ``dim`` this rank holds (this split alone), in local order."""
        a, b = shard_bounds(self.inner, self.parts, self.rank)
        outer = torch.arange(self.split_factor).view(-1, 1, 1) * (self.inner * self.unit)
        mid = torch.arange(a, b).view(1, -1, 1) * self.unit
        idx = (outer + mid + torch.arange(self.unit).view(1, 1, -1)).reshape(-1) + self.prefix
        return torch.cat([torch.arange(self.prefix), idx]) if self.rank == 0 else idx


def _nest(n: int, chain: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """``{mesh dim: (inner, unit)}`` of the mesh dims splitting one ``n``-long dim, ``chain``
    their ``(split_factor, mesh dim)`` sorted: each chunks the factor up to the next one's
    split factor (the last: the rest; equal: a factor of 1); one that does not nest keeps
    the one-dim meaning (the rest chunked, ``unit`` 1)."""
    out = {}
    for j, (sf, m) in enumerate(chain):
        nxt = chain[j + 1][0] if j + 1 < len(chain) else n
        nests = nxt >= sf and nxt % sf == 0 and n % max(nxt, 1) == 0
        out[m] = (nxt // sf, n // nxt) if nests else (n // sf, 1)
    return out


def split_layouts(x: DTensor) -> list[TokenLayout]:
    """One ``TokenLayout`` per mesh dim sharding a dim of ``x``, in mesh dim order; mesh dims
    on one dim nest (``_nest``), a ``dp`` one aside (it splits whole images)."""
    mesh, chains = x.device_mesh, {}
    for i, p in enumerate(x.placements):
        d = sharded_dim(p)
        if d is not None:  # keyed by (dim, dp): a dp mesh dim nests with no other
            sf = p.split_factor if isinstance(p, _StridedShard) else 1
            chains.setdefault((d % x.ndim, is_dp(x, i)), []).append((sf, i))
    found = {}  # mesh dim: dim, split factor, inner, unit
    for (d, _), chain in chains.items():
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
    """Global indices along one dim this rank holds, in its local order (``lays``: the dim's)."""
    idx = lays[0].indices()
    for lay in lays[1:]:
        idx = idx[torch.isin(idx, lay.indices())]
    return idx


def is_tokens(x) -> bool:
    """True for a DTensor with a ``_StridedShard`` placement (flattened sharded pixels)."""
    return isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements)


def local_part(plain: Tensor, x: DTensor, skip: int | None = None, what: str = "an op") -> Tensor:
    """The part of ``plain`` (broadcast against ``x``: a position embedding) meeting this
    rank's entries of ``x`` (all of dim ``skip``), its gradient summed over the ranks; a
    local tensor of ``x`` not holding the entries its placements give refused by name."""
    part = sum_grad_over(plain, grad_groups(x))
    lead = x.ndim - part.ndim
    split = {d % x.ndim for d in map(sharded_dim, x.placements) if d is not None} - {skip}
    cut = sorted(d for d in split if d >= lead and part.shape[d - lead] != 1)
    if not cut:  # broadcast along every split dim (most calls): no layout to read
        return part
    lays = split_layouts(x)
    for d in cut:
        lay, *more = on_d = dim_layouts(lays, d)
        one = not more and lay.split_factor == lay.unit == 1 and not lay.prefix
        a, b = shard_bounds(lay.inner, lay.parts, lay.rank)  # of one block: a view
        idx = None if one else held_indices(on_d)
        held = b - a if one else idx.numel()
        # a mismatch: a bare size error in the op, or a size-1 local dim broadcast
        if held != x.to_local().shape[d]:
            raise SpatialShardingError(
                f"{what} of a token tensor {tuple(x.shape)} {x.placements} and a plain tensor "
                f"{tuple(plain.shape)} in module '{module_path()}': this rank holds "
                f"{x.to_local().shape[d]} entries of dim {d}, but those placements give it "
                f"{held} (its local tensor is not the token layout of _tokens.py, e.g. built by"
                f" DTensor.from_local with other shard sizes). Make the tokens by flattening "
                f"the sharded map (x.flatten(2).transpose(1, 2)), or gather explicitly "
                f"(x.full_tensor())."
            )
        k = d - lead
        part = part.narrow(k, a, held) if idx is None else part.index_select(k, idx.to(part.device))
    return part
