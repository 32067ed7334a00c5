"""``replicate_gradients``: PyTorch's ``DistributedDataParallel`` as the gradient reducer of a
parallelized model (``parallel.grad_reduce: ddp``, the default).

Gradient semantics as under FSDP (``_fsdp.py``): the loss is the global mean, so a parameter
that meets a sharded activation gets on each rank a partial gradient whose sum over the
activation's sharding groups is the single-device gradient. DDP averages every gradient over
all ``world`` ranks of the mesh (one process group, the mesh flattened); the model's
``GradReducer`` steps aside (``defer_to``) and only scales each partial gradient by the size
of its groups, so DDP's average is exactly that sum and nothing is reduced twice. Gradients
already complete on every rank (batch norm's affine gradients) average to themselves.

DDP was measured against the built-in bucketed reducer over the same groups
(``scripts/bench_step.py --reducers builtin ddp``, docs/benchmarks.md) and is no slower, so
it is the default; ``parallel.grad_reduce: builtin`` keeps the built-in one.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._fsdp import flat_mesh
from ._runtime import runtime_of

__all__ = ["local_module", "replicate_gradients"]


def replicate_gradients(model: nn.Module) -> nn.Module:
    """``model`` (a ``parallelize``d model) wrapped in ``DistributedDataParallel`` over all
    ranks of its mesh, its ``GradReducer`` deferring to it; a one-rank mesh returns
    ``model`` itself (nothing to reduce).

    DDP runs with ``static_graph``: its first backward finds the parameters no rank used
    (a head or encoder stage the forward skips, a weight off the loss's path), which then
    keep ``.grad`` None, as on one device; later steps neither walk the autograd graph
    nor all-reduce a used-parameter map (``find_unused_parameters`` would, every step).
    Without either, such a model fails at its second step. The price: the parameters a
    step uses must be the same every step (a model that skips layers at random needs
    ``parallel.grad_reduce: builtin``).

    Buffers are not broadcast before each forward (``forward_sync_buffers=False``): batch
    norm's running statistics are computed from the all-reduced batch statistics and are
    the same on every rank already. Parameter and buffer names gain DDP's ``module.``
    prefix; ``local_module`` gives the wrapped model back.
    """
    runtime = runtime_of(model)
    if isinstance(model, DistributedDataParallel):
        raise ValueError("replicate_gradients: the model is wrapped in DDP already")
    mesh = flat_mesh(runtime.mesh)
    if mesh.size() == 1:
        return model
    runtime.grad_reducer.defer_to(mesh.size())
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        static_graph=True,
        forward_sync_buffers=False,
    )


def local_module(model: nn.Module) -> nn.Module:
    """The parallelized model inside a ``replicate_gradients`` (DDP) wrapper; any other
    model as it is. Validation and start-up probes call it: its forwards need no DDP
    bookkeeping and no lock-step between data-parallel replicas."""
    return model.module if isinstance(model, DistributedDataParallel) else model
