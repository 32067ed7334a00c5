"""One model across the ranks of a mesh: the same starting state, and torch's gradient
reducers in place of the runtime's own.

``broadcast_model_state`` (``sync_state``) copies mesh rank 0's parameters and buffers to
every rank; ``replicate_gradients`` (DDP, the default) and ``shard_parameters`` (FSDP2)
reduce over the mesh flattened to one dimension, the ``GradReducer`` deferring to them
(``defer_to``: partial gradients scaled by the size of their groups). Gradient semantics
and why: docs/design.md, "Every rank starts from the same weights", "Parameter gradients
are averaged by DistributedDataParallel by default", "With FSDP nothing is reduced twice".
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


def _broadcast_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` (same dtype and device) from the group's first rank as one
    flat buffer: one message instead of one per tensor."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    if flat.dtype == torch.bool:  # not every backend sends bool; copy_ casts it back
        flat = flat.to(torch.uint8)
    dist.broadcast(flat, group=group, group_src=0)
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view_as(t))


def broadcast_model_state(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy mesh rank 0's parameters and buffers into ``model`` on every rank of ``mesh``.

    Broadcasts along each mesh dimension in turn (first rank of each group), so after the
    last one every rank holds the values of the rank at mesh coordinate ``(0, ..., 0)``.
    A mesh of one rank (or no process group at all) sends nothing."""
    if not dist.is_initialized() or mesh.size() == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    # parameters and buffers holding real data (meta tensors have nothing to send), once each
    for t in {id(t): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}.values():
        buckets[(t.dtype, t.device)].append(t)
    for dim in range(mesh.ndim):
        if mesh.size(dim) == 1:
            continue
        group = mesh.get_group(dim)
        for tensors in buckets.values():
            _broadcast_flat(tensors, group)


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` as one dimension over all its ranks (collective the first time: the
    flattened group is created on every rank)."""
    if mesh.ndim == 1:
        return mesh
    name = "_".join(mesh.mesh_dim_names or ())
    quiet = dist.get_backend() == "gloo"
    if quiet:  # the new group's gloo threads must not take cores (_comm_threads.py)
        with gloo_threads_idle():
            return mesh._flatten(name)
    return mesh._flatten(name)


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
    """Apply FSDP2 ``fully_shard`` to each of ``blocks`` and then to the root ``model`` (a
    ``parallelize``d model) over all ranks of its mesh; returns the same model, in place.

    Parameters become ``Shard(0)`` DTensors on the flattened mesh (build the optimizer
    afterwards: ``1 / world`` of its state per rank; names and ``state_dict`` keys
    unchanged). Each block is one all-gather / reduce-scatter unit, freed after its forward;
    the root keeps its own parameters gathered from its forward to the end of the backward.
    ``param_dtype`` / ``reduce_dtype``: FSDP2's ``MixedPrecisionPolicy`` (None: the
    parameters' dtype). Raises ``ValueError`` for a model not parallelized, sharded
    already, or with a non-contiguous (channels-last) parameter."""
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
    (collective on entry and exit; a no-op for other models).

    Its forwards then talk to no rank outside their own spatial group, so data-parallel
    replicas may run different numbers of them (validation: image ``i`` on replica
    ``i % dp``); without it each forward all-gathers over the whole mesh and the replicas
    would have to run in lock-step."""
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
    """``model`` (a ``parallelize``d model) wrapped in ``DistributedDataParallel`` over all
    ranks of its mesh, its ``GradReducer`` deferring to it; a one-rank mesh returns
    ``model`` itself (nothing to reduce).

    DDP runs with ``static_graph`` (parameters no rank uses keep ``.grad`` None, as on one
    device, with no per-step graph walk; the set of used parameters must stay the same
    every step, else ``parallel.grad_reduce: builtin``) and without buffer broadcasts
    (batch norm's running statistics are equal on every rank already): docs/design.md.
    Without either, a model with unused parameters fails at its second step. Names gain
    DDP's ``module.`` prefix; ``local_module`` gives the wrapped model back."""
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
