"""Atomic, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``run_dir/checkpoints``::

    step-000120/       a complete checkpoint: DCP files (.metadata, *.distcp: model and
                       optimizer), extra-rank{r}.pt (per-rank RNG states, data position),
                       scheduler.pt, and meta.json (step, metric; written last)
    latest, best       text pointers naming a step folder (rewritten with os.replace)
    .tmp-step-000140/  a save in progress (or killed): ignored, removed by the next save

A save writes everything into ``.tmp-step-N``, all ranks agree it succeeded, then rank 0
renames the folder into place and atomically rewrites ``latest``. An exception on any
rank (or a kill) before that leaves the previous checkpoint and ``latest`` untouched.
The folders must live on a file system shared by all ranks.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

_STEP_RE = re.compile(r"^step-(\d+)$")
_META = "meta.json"
FORMAT_VERSION = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _agree(error: BaseException | None, what: str) -> None:
    """Synchronise all ranks (acts as a barrier) and raise on every rank if any failed, so a
    failure on one rank never leaves the others waiting in a later collective."""
    msg = None if error is None else f"rank {_rank()}: {type(error).__name__}: {error}"
    if _world() > 1:
        gathered: list[Any] = [None] * _world()
        dist.all_gather_object(gathered, msg)
        failed = [m for m in gathered if m is not None]
    else:
        failed = [msg] if msg is not None else []
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint {what} failed on another rank: " + "; ".join(failed))


def _dcp_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter names (DCP's state_dict API)."""
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}


def _attempt(fn: Callable, *args: Any) -> Exception | None:
    """Run ``fn``; return its exception instead of raising (``_agree`` reports it)."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - every failure reaches every rank via _agree
        return exc
    return None


def _remove_tree(path: Path, attempts: int = 20) -> None:
    """Remove a folder; retry briefly, since file-system writers of other ranks (DCP's
    background writes on shared storage) may still be closing files in it."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.1)


def _replace_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` then ``os.replace``: readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_text_atomic(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the pointer must not outlive a crash as an empty file

    _replace_atomic(path, write)


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model under DDP (``.module``) or ``torch.compile`` (``._orig_mod``)."""
    ddp = nn.parallel.DistributedDataParallel
    while isinstance(model, ddp) or isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model.module if isinstance(model, ddp) else model._orig_mod
    return model


def rng_state() -> dict[str, Any]:
    """This process's random number generator states (torch CPU/CUDA, python, numpy), to be
    stored in a checkpoint's per-rank ``extra`` and restored with ``set_rng_state``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states captured by ``rng_state`` (missing entries are skipped)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def read_meta(folder: str | Path) -> dict[str, Any] | None:
    """The ``meta.json`` of a checkpoint folder, or None if it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / _META).read_text())
    except (OSError, ValueError):
        return None


class CheckpointManager:
    """Saves, finds, prunes and loads the checkpoints of one run directory.

    ``save`` and ``load`` are collective (every rank calls them); ``latest``/``best`` only
    read the file system. ``keep_last`` recent folders are kept, plus the one with the
    highest ``metric`` if ``keep_best``.
    """

    def __init__(self, run_dir: str | Path, *, keep_last: int = 2, keep_best: bool = True):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep_last = keep_last
        self.keep_best = keep_best

    # -- finding ---------------------------------------------------------------------------
    def folders(self) -> list[Path]:
        """Complete checkpoint folders (``step-N`` with a ``meta.json``), oldest step first."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / _META).is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def _pointer(self, name: str) -> Path | None:
        try:
            target = (self.dir / name).read_text().strip()
        except OSError:
            return None
        ok = _STEP_RE.match(target) and (self.dir / target / _META).is_file()
        return self.dir / target if ok else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the one ``latest`` names, else (pointer missing or
        stale) the complete folder with the highest step; None if there is none."""
        found = self._pointer("latest")
        if found is not None:
            return found
        folders = self.folders()
        return folders[-1] if folders else None

    def best(self) -> Path | None:
        """The checkpoint with the highest metric so far (None without ``keep_best``)."""
        return self._pointer("best") if self.keep_best else None

    def best_metric(self) -> float | None:
        """The metric recorded with ``best()``, or None."""
        folder = self.best()
        return None if folder is None else (read_meta(folder) or {}).get("metric")

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        scheduler: Any = None,
        extra: dict | None = None,
        metric: float | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and return its folder (collective).

        Model and optimizer state go through DCP, ``extra`` (this rank's RNG states, data
        position...) into ``extra-rank{r}.pt``, the scheduler and ``step`` into small files.
        Then ``latest`` is repointed, folders beyond ``keep_last`` are pruned (never the
        newest, never the best), and a higher ``metric`` than the best so far moves ``best``.
        If anything fails on any rank, every rank raises and the previous checkpoint and
        ``latest`` are unchanged.
        """
        name = f"step-{step:06d}"
        tmp = self.dir / f".tmp-{name}"
        main = _rank() == 0
        _agree(_attempt(self._prepare, tmp) if main else None, "preparing")
        error = _attempt(self._write, tmp, step, model, optimizer, scheduler, extra, metric)
        try:
            _agree(error, "writing")
        except BaseException:
            # _agree raises on every rank at once, so all ranks are here: drop the partial
            # folder, and let nobody return before it is gone.
            if main:
                _remove_tree(tmp)
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            raise
        _agree(_attempt(self._commit, tmp, name, metric) if main else None, "committing")
        return self.dir / name

    def _prepare(self, tmp: Path) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():  # folders of saves killed earlier
            if p.name.startswith((".tmp-step-", ".old-step-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
        tmp.mkdir()

    def _write(self, tmp, step, model, optimizer, scheduler, extra, metric) -> None:
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=tmp)
        torch.save(extra or {}, tmp / f"extra-rank{_rank()}.pt")
        if _rank() == 0:
            if scheduler is not None:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            metric = None if metric is None else float(metric)
            meta = dict(format=FORMAT_VERSION, step=step, metric=metric, world_size=_world())
            meta.update(has_optimizer=optimizer is not None, saved_at=time.time())
            # Written last: a step folder without meta.json is never treated as complete.
            _write_text_atomic(tmp / _META, json.dumps(meta, indent=1) + "\n")

    def _commit(self, tmp: Path, name: str, metric: float | None) -> None:
        final = self.dir / name
        old = None
        if final.exists():  # re-saving the same step (e.g. after a resume): swap it out
            old = self.dir / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _write_text_atomic(self.dir / "latest", name + "\n")
        if self.keep_best and metric is not None and math.isfinite(metric):  # NaN never best
            best = self.best_metric()
            if best is None or float(metric) > best:
                _write_text_atomic(self.dir / "best", name + "\n")
        self._prune(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self, newest: Path) -> None:
        folders = self.folders()
        keep = set(folders[-self.keep_last :]) | {newest, self.best()}
        for p in folders:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------------
    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        scheduler: Any = None,
    ) -> tuple[int, dict]:
        """Restore ``model``, ``optimizer`` (exact state: moments, momentum buffers, step
        counts, param groups) and ``scheduler`` in place from checkpoint folder ``path``
        (collective). Returns ``(step, this rank's extra dict)``; the extra dict is empty if
        the checkpoint was written by fewer ranks."""
        folder = Path(path)
        meta = read_meta(folder)
        if meta is None:
            raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {_META})")
        state = _dcp_state(model, optimizer)  # fresh state (optimizer's initialised) to fill
        dcp.load(state, checkpoint_id=folder)
        optims = optimizer if optimizer is not None else []
        set_state_dict(
            model, optims, model_state_dict=state["model"], optim_state_dict=state.get("optim", {})
        )
        if scheduler is not None:
            sched_file = folder / "scheduler.pt"
            if not sched_file.is_file():
                raise FileNotFoundError(f"{folder} holds no scheduler state ({sched_file.name})")
            scheduler.load_state_dict(torch.load(sched_file, weights_only=False))
        extra_file = folder / f"extra-rank{_rank()}.pt"
        if extra_file.is_file():  # our own file; RNG states are python objects: not weights_only
            return int(meta["step"]), torch.load(extra_file, weights_only=False)
        warnings.warn(
            f"{folder} has no per-rank state for rank {_rank()} (saved with "
            f"{meta.get('world_size')} ranks); RNG states and data position start fresh",
            stacklevel=2,
        )
        return int(meta["step"]), {}

    # -- export ----------------------------------------------------------------------------
    @staticmethod
    def export(model: nn.Module, path: str | Path, *, config: Any = None) -> None:
        """Write a single-device ``.pt`` file ``{"model": state_dict, "config": config}`` with
        the model's own parameter names, loadable with
        ``model.load_state_dict(torch.load(path)["model"])`` into the unparallelized model.

        Rank 0 writes (atomically); other ranks return. If a parameter is a DTensor its full
        value is gathered, which is collective: then every rank must call this.
        """
        state = {}
        for key, value in _unwrap(model).state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            state[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
        if _rank() == 0:
            _replace_atomic(Path(path), lambda t: torch.save({"model": state, "config": config}, t))


def export_checkpoint(folder: str | Path, path: str | Path, *, config: Any = None) -> None:
    """Convert checkpoint ``folder`` into a single-device ``.pt`` like ``export`` without
    building the model or a process group (run it in one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmpdir:
        full = Path(tmpdir) / "full.pt"
        dcp_to_torch_save(folder, full)
        model_sd = torch.load(full, weights_only=False)["model"]
    _replace_atomic(Path(path), lambda t: torch.save({"model": model_sd, "config": config}, t))
