"""The ring over the ranks holding a token sequence: one mesh dim's group, or two flattened
(tiles, rows); each member's token indices from its place on the mesh (docs/attention.md)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from ._replicas import flat_mesh
from ._token_layout import held_indices
from ._tokens import TokenLayout

#: the layouts splitting one token dim (one on strips, two on tiles), empty when whole
Seq = tuple[TokenLayout, ...]


@dataclass(frozen=True)
class TokenRing:
    """The ring's ``group`` and, per member in group-rank order, its layouts of the dim."""

    group: object
    members: tuple[tuple[TokenLayout, ...], ...]
    #: ``spec`` per device, built on the first call (``token_ring`` keeps the ring)
    _specs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def spec(self, device) -> tuple[object, tuple[int, ...], tuple[Tensor, ...]]:
        """``(group, every member's token count, its global token indices on device)``."""
        key = str(torch.device(device))
        if key not in self._specs:
            cols = tuple(held_indices(m).to(device) for m in self.members)
            self._specs[key] = (self.group, tuple(int(c.numel()) for c in cols), cols)
        return self._specs[key]


@functools.lru_cache(maxsize=256)
def token_ring(mesh: DeviceMesh, lays: tuple[TokenLayout, ...]) -> TokenRing:
    """The ring of the ranks splitting the token dim of ``lays`` (all its layouts but dp)."""
    dims = tuple(lay.mesh_dim for lay in lays)
    if len(dims) == 1:
        group = mesh.get_group(dims[0])
    elif not mesh.mesh_dim_names:
        raise ValueError(
            "attention over tokens split over several mesh dims needs a mesh with "
            "mesh_dim_names (e.g. ('sp_h', 'sp_w'))"
        )
    else:
        group = flat_mesh(mesh[tuple(mesh.mesh_dim_names[m] for m in dims)]).get_group()
    coords = [(mesh.mesh == r).nonzero()[0].tolist() for r in dist.get_process_group_ranks(group)]
    members = tuple(
        tuple(dataclasses.replace(lay, rank=c[lay.mesh_dim]) for lay in lays) for c in coords
    )
    return TokenRing(group, members)


def partial_local(t: DTensor, seq: Seq) -> Tensor:
    """``t``'s local tensor, whole on ``seq``'s mesh dims, each rank using it for its own
    tokens: its gradient there a partial sum (``Partial``)."""
    dims = {lay.mesh_dim for lay in seq}
    grad = tuple(Partial() if i in dims else p for i, p in enumerate(t.placements))
    return t.to_local(grad_placements=grad)
