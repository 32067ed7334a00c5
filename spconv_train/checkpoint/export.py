"""Single-device ``.pt`` exports of a model or of a checkpoint folder (``{"model":
state_dict, "config": config}``, loadable weights-only into the unparallelized model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spconv_train.checkpoint.files import save_file
from spconv_train.checkpoint.safe_load import read_full_state
from spconv_train.checkpoint.sync import rank as _rank

__all__ = ["export_checkpoint", "export_model"]


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model under DDP (``.module``) or ``torch.compile`` (``._orig_mod``)."""
    ddp = nn.parallel.DistributedDataParallel
    while isinstance(model, ddp) or isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model.module if isinstance(model, ddp) else model._orig_mod
    return model


def export_model(model: nn.Module, path: str | Path, *, config: Any = None) -> None:
    """Write a single-device ``.pt`` file ``{"model": state_dict, "config": config}`` with
    the model's own parameter names, loadable with
    ``model.load_state_dict(torch.load(path)["model"])`` into the unparallelized model.

    Rank 0 writes (atomically); other ranks return. If a parameter is a DTensor its full
    value is gathered, which is collective: then every rank must call this. A failed
    write (e.g. a full disk) leaves no partial file and raises ``CheckpointError``.
    """
    state = {}
    for key, value in _unwrap(model).state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        state[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    if _rank() == 0:
        save_file(Path(path), {"model": state, "config": config}, f"exporting {path}")


def export_checkpoint(folder: str | Path, path: str | Path, *, config: Any = None) -> None:
    """Convert checkpoint ``folder`` into a single-device ``.pt`` like ``export`` without
    building the model or a process group (run it in one process). Read through
    ``safe_load`` like a resume: a file that could run code is refused."""
    model_sd = read_full_state(folder)["model"]
    save_file(Path(path), {"model": model_sd, "config": config}, f"exporting {path}")
