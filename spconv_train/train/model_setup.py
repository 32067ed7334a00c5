"""The parallelized model as ``run`` and ``verify`` both train it: ``parallelize`` over the
mesh, activation checkpointing, the gradient reduction (FSDP2 with ``parallel.fsdp``, else
``DistributedDataParallel`` with ``parallel.grad_reduce: ddp``), then ``torch.compile``
(``training.compile``, ``compile_model``), in that order.

One function for both, so ``verify`` checks the model ``run`` trains. The order matters:
activation checkpointing wraps a block's ``forward``, and FSDP's hooks run around the
block's call, outside the checkpointed function, so the recomputation in the backward sees
the parameters FSDP has gathered again for that block (as torchtitan orders them). Under
DDP, ``compile_model`` compiles the model inside the wrapper (``local_module``): DDP's
hooks stay eager around the compiled forward, and validation, which calls the inner model,
runs the same compiled code.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spconv_train.config import Config
from spconv_train.parallel import (
    local_module,
    parallelize,
    replicate_gradients,
    shard_parameters,
)
from spconv_train.train.optim import checkpoint_blocks, enable_activation_checkpointing

__all__ = ["compile_model", "compile_options", "prepare_model", "to_channels_last"]

#: ``training.compile_mode`` -> the ``parallelize`` options it sets (parallel/_compile.py)
COMPILE_MODES: dict[str, dict[str, bool]] = {
    "default": {},
    "trace": {"trace_under_compile": True},
    "dtensor_graphs": {"trace_dtensor_ops": True},
}


def prepare_model(model: nn.Module, mesh: DeviceMesh, cfg: Config, precision: str) -> nn.Module:
    """``model`` (already on its device) parallelized over ``mesh``, with
    ``training.channels_last``, ``training.activation_checkpointing``, ``parallel.fsdp`` and
    ``parallel.grad_reduce`` applied as configured. Returns the same object, or with
    ``grad_reduce: ddp`` on a mesh of more than one rank its ``DistributedDataParallel``
    wrapper (``runtime_of`` and the checkpoint functions take either; ``local_module``
    unwraps it). ``precision`` is the one the step computes in (``fp32``, ``bf16`` or
    ``fp64``): with ``bf16`` FSDP gathers bf16 parameters and reduces gradients in fp32
    (``MixedPrecisionPolicy``); otherwise both stay in the parameters' dtype."""
    t = cfg.training
    model = parallelize(model, mesh, allow_gather=cfg.parallel.allow_gather, **compile_options(cfg))
    if not cfg.parallel.fsdp:
        to_channels_last(model, t.channels_last)
    if t.activation_checkpointing:
        enable_activation_checkpointing(
            model, t.activation_checkpointing_granularity, t.activation_checkpointing_every
        )
    if cfg.parallel.fsdp:
        bf16 = precision == "bf16"
        shard_parameters(
            model,
            checkpoint_blocks(model),  # the top-level blocks: one gather / reduce unit each
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
    elif cfg.parallel.grad_reduce == "ddp":
        model = replicate_gradients(model)
    return model


def to_channels_last(model: nn.Module, mode: str) -> bool:
    """Make ``model``'s weights channels-last in place when ``mode`` (``training.channels_last``)
    is ``on``, or ``auto`` on CUDA; convolutions then produce channels-last activations and
    pick the faster kernels for them. 3-D models get ``channels_last_3d``; a model with both
    4-D and 5-D weights is left as it is. Returns whether it converted."""
    params = list(model.parameters())
    on_gpu = bool(params) and params[0].device.type == "cuda"
    if mode == "off" or (mode == "auto" and not on_gpu):
        return False
    ranks = {p.dim() for p in params} & {4, 5}
    if len(ranks) != 1:
        return False
    model.to(memory_format=torch.channels_last if ranks == {4} else torch.channels_last_3d)
    return True


def compile_options(cfg: Config) -> dict[str, bool]:
    """The ``parallelize`` options of ``training.compile_mode`` (none without
    ``training.compile``): they only change what ``torch.compile`` traces."""
    return COMPILE_MODES[cfg.training.compile_mode] if cfg.training.compile else {}


def compile_model(model: nn.Module, cfg: Config) -> None:
    """``torch.compile`` ``model`` in place when ``training.compile`` (parameters and
    ``state_dict`` keys stay the model's; under DDP the model inside the wrapper), with
    what it traces set by ``training.compile_mode`` at ``prepare_model``; called
    after ``prepare_model`` and after any start-up probe forwards (which need not compile
    every validation size)."""
    if cfg.training.compile:
        # Static shapes: the halo plans are built from concrete sizes (a symbolic width would
        # reach them when validation images differ from the training crop); each new image
        # size compiles once more instead.
        local_module(model).compile(backend=cfg.training.compile_backend, dynamic=False)
