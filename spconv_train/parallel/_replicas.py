"""One model across a mesh: rank 0's starting state everywhere, DDP or FSDP2 over the mesh
flattened to one dim as gradient reducers, the ``GradReducer`` deferring to them (why:
docs/design.md, "Every rank starts from the same weights" and the two items before it).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ._comm_threads import gloo_threads_idle
from ._runtime import local_module, runtime_of


def broadcast_model_state(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy mesh rank 0's parameters and buffers into ``model`` on every rank of ``mesh``:
    a broadcast from the first rank along each mesh dim in turn (none on one rank), one
    flat buffer per dtype and device."""
    if not dist.is_initialized() or mesh.size() == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    # parameters and buffers holding real data (meta tensors have nothing to send), once each
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}.values():
        buckets[(t.dtype, t.device)].append(t)
    for dim in (d for d in range(mesh.ndim) if mesh.size(d) > 1):
        for tensors in buckets.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            if flat.dtype == torch.bool:  # not every backend sends bool; copy_ casts it back
                flat = flat.to(torch.uint8)
            dist.broadcast(flat, group=mesh.get_group(dim), group_src=0)
            with torch.no_grad():
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                    t.copy_(part.view_as(t))


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` as one dim over all its ranks (collective the first time)."""
    if mesh.ndim == 1:
        return mesh
    # the new group's gloo threads must not take cores (_comm_threads.py)
    with gloo_threads_idle() if dist.get_backend() == "gloo" else contextlib.nullcontext():
        return mesh._flatten("_".join(mesh.mesh_dim_names or ()))


def is_sharded(model: nn.Module) -> bool:
    """Whether ``shard_parameters`` (FSDP2) was applied to ``model``."""
    return isinstance(model, FSDPModule)


def shard_parameters(
    model: nn.Module,
    blocks: Iterable[nn.Module] = (),
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` on each of ``blocks``, then on the root ``model`` (a
    ``parallelize``d model), over all ranks of its mesh; the same model, in place.

    Parameters become ``Shard(0)`` DTensors (build the optimizer afterwards). A block is one
    all-gather / reduce-scatter unit freed after its forward; the root stays gathered until
    the backward ends. ``param_dtype`` / ``reduce_dtype``: FSDP2's mixed precision.
    ``ValueError``: not parallelized, sharded already, or a non-contiguous parameter."""
    runtime = runtime_of(model)
    if is_sharded(model):
        raise ValueError(f"shard_parameters: {type(model).__name__} is sharded already")
    for name, p in model.named_parameters():
        if not p.is_contiguous():
            raise ValueError(
                f"shard_parameters: parameter {name} of shape {tuple(p.shape)} is not "
                f"contiguous (stride {p.stride()}; channels-last weights?): FSDP2 shards "
                "contiguous parameters only. Keep the weights contiguous (convolutions follow "
                "a channels-last input all the same)"
            )
    mesh = flat_mesh(runtime.mesh)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        if block is not model and any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    runtime.grad_reducer.defer_to(mesh.size())
    return model


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Keep every parameter of a ``shard_parameters`` model gathered inside the block
    (collective on entry and exit; a no-op for other models): its forwards then talk to
    no rank outside their spatial group, so data-parallel replicas may run different
    numbers of them (validation) instead of all-gathering over the mesh in lock-step."""
    if not is_sharded(model):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # the same order on every rank: the all-gathers match
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def replicate_gradients(model: nn.Module) -> nn.Module:
    """``model`` (a ``parallelize``d model) in ``DistributedDataParallel`` over all ranks
    of its mesh, its ``GradReducer`` deferring to it (a one-rank mesh: ``model`` itself).
    ``static_graph`` (unused parameters keep ``.grad`` None; the used set must not change,
    else ``grad_reduce: builtin``), no buffer broadcasts (docs/design.md)."""
    runtime = runtime_of(model)
    if local_module(model) is not model:
        raise ValueError("replicate_gradients: the model is wrapped in DDP already")
    mesh = flat_mesh(runtime.mesh)
    if mesh.size() == 1:
        return model
    runtime.grad_reducer.defer_to(mesh.size())
    return DistributedDataParallel(
        model, process_group=mesh.get_group(), static_graph=True, forward_sync_buffers=False
    )
