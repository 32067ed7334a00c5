"""``shard_parameters``: FSDP2 (``fully_shard``) of a parallelized model over its whole mesh.

Every rank of the ``(dp, sp)`` mesh (tiles and volume blocks too) holds ``1 / world`` of
the parameters, gradients and optimizer state: FSDP2 shards each parameter along dim 0 over
the mesh flattened to one dimension, all-gathers a block's parameters before its forward
(the spatial ops see plain, full parameters) and again before its backward, and
reduce-scatters the gradients after it.

Gradient semantics (docs/design.md, "Exact semantics"): the loss is the global mean, so a
parameter that meets a sharded activation gets on each rank a partial gradient whose sum
over the activation's sharding groups (width and batch) is the single-device gradient.
FSDP's reduce-scatter averages over all ``world`` ranks (its default divide factor); the
model's ``GradReducer`` steps aside (``defer_to``) and only scales each partial gradient by
the size of its groups, so the average is exactly that sum and no gradient is reduced
twice. Gradients already complete on every rank (batch norm's affine gradients, which ride
on its statistics all-reduce) average to themselves. Dividing by ``dp`` instead would be
wrong here: every data-parallel rank's gradient is already a share of the global mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ._comm_threads import gloo_threads_idle
from ._runtime import runtime_of

__all__ = ["flat_mesh", "full_parameters", "is_sharded", "shard_parameters"]


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

    Parameters become ``DTensor`` shards (``Shard(0)`` on the flattened mesh), so the
    optimizer built afterwards keeps ``1 / world`` of its state per rank; names and
    ``state_dict`` keys are unchanged. Each block is one all-gather / reduce-scatter unit
    (its parameters are freed after its forward and gathered again in the backward); the
    root holds the parameters outside any block and keeps them gathered from its forward
    to the end of the backward. ``param_dtype`` (e.g. ``torch.bfloat16``) is the dtype the
    forward computes with, ``reduce_dtype`` the one gradients are reduced in (FSDP2's
    ``MixedPrecisionPolicy``; None: the parameters' own dtype).

    Raises ``ValueError`` for a model that was not parallelized or is sharded already, or
    that has a non-contiguous (e.g. channels-last) parameter.
    """
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
    would have to run in lock-step.
    """
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
