"""Make every rank of a mesh hold the same parameters and buffers (those of mesh rank 0).

Why: the ranks of the sp dimension each run a strip of *one* network. If one rank built
its model from a different random state (no seed, or a seed that differs per rank), every
strip is computed with different weights and the stitched output is silently wrong at
every column. DistributedDataParallel has the same hazard across data-parallel replicas
and broadcasts rank 0's state when it wraps a model; ``parallelize`` does the same, once,
over every dimension of the mesh.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["broadcast_model_state"]


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers that hold real data (meta tensors have nothing to send)."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        out.append(t)
    return out


def _broadcast_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` (same dtype and device) from the group's first rank as one
    flat buffer: one message instead of one per tensor."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    if flat.dtype == torch.bool:  # not every backend sends bool; copy_ casts it back
        flat = flat.to(torch.uint8)
    dist.broadcast(flat, group=group, group_src=0)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def broadcast_model_state(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy mesh rank 0's parameters and buffers into ``model`` on every rank of ``mesh``.

    Broadcasts along each mesh dimension in turn (first rank of each group), so after the
    last one every rank holds the values of the rank at mesh coordinate ``(0, ..., 0)``.
    A mesh of one rank (or no process group at all) sends nothing."""
    if not dist.is_initialized() or mesh.size() == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in _state_tensors(model):
        buckets[(t.dtype, t.device)].append(t)
    for dim in range(mesh.ndim):
        if mesh.size(dim) == 1:
            continue
        group = mesh.get_group(dim)
        for tensors in buckets.values():
            _broadcast_flat(tensors, group)
