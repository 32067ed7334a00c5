"""Atomic, verified, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``run_dir/checkpoints``::

    step-000120/       a complete checkpoint: DCP files (.metadata, *.distcp: model and
                       optimizer), extra-rank{r}.json (optional per-rank state),
                       scheduler.json, and meta.json (the manifest, written last: step,
                       metric, rank-independent ``shared`` state such as the data position,
                       the size and sha256 of every other file, and a digest of itself)
    latest, best       text pointers naming a step folder (rewritten with os.replace)
    .tmp-step-000140/  a save in progress (or killed): ignored, removed by the next save
    corrupt-step-N/    a checkpoint that failed verification, moved aside by a resume

A save writes everything into ``.tmp-step-N``, all ranks agree it succeeded, the files are
hashed (spread over the ranks), rank 0 writes the manifest, renames the folder into place
and atomically rewrites ``latest``. An exception on any rank (or a kill) before that leaves
the previous checkpoint and ``latest`` untouched and the partial folder removed.
``newest_good`` verifies checkpoints against their manifests, newest first, so a resume
skips a corrupt or truncated one. The folders must live on a file system shared by all ranks.

Nothing read back runs code (a run folder may come from someone else): the state files are
JSON, DCP's metadata and values go through ``spconv_train.checkpoint.safe_load``, files the manifest
does not list are ignored with a warning.
"""

from __future__ import annotations

import math
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from spconv_train.checkpoint.export import export_model
from spconv_train.checkpoint.files import (
    CheckpointError,
    check_files,
    checkpoint_space,
    remove_tree,
    save_failure_message,
    write_text_atomic,
)
from spconv_train.checkpoint.manifest import META as _META
from spconv_train.checkpoint.manifest import (
    listed_files,
    manifest_text,
    read_manifest,
    read_state_file,
    state_file,
    write_state,
)
from spconv_train.checkpoint.safe_load import load_checkpoint_state
from spconv_train.checkpoint.sync import agree as _agree
from spconv_train.checkpoint.sync import attempt as _attempt
from spconv_train.checkpoint.sync import broadcast as _broadcast
from spconv_train.checkpoint.sync import digest_folder
from spconv_train.checkpoint.sync import gather as _gather
from spconv_train.checkpoint.sync import rank as _rank
from spconv_train.checkpoint.sync import world as _world

_STEP_RE = re.compile(r"^step-(\d+)$")
# 3: scheduler.json and extra-rank{r}.json (no pickles); meta.json carries its own digest.
# 2: meta.json holds a checksum of every file and the rank-independent ``shared`` state.
# 1 (no checksums, all state per rank) and 2 stay loadable: their scheduler.pt and
# extra-rank{r}.pt are read weights-only (one holding anything else is refused).
FORMAT_VERSION = 3


def _dcp_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter names (DCP's state_dict API)."""
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}


def read_meta(folder: str | Path) -> dict[str, Any] | None:
    """The ``meta.json`` of a checkpoint folder, or None if it is missing, unreadable or
    fails its digest (``checkpoint_manifest.read_manifest`` says which)."""
    return read_manifest(folder)[0]


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
    def folders(self, *, complete: bool = True) -> list[Path]:
        """Complete checkpoint folders (``step-N`` with a ``meta.json``), oldest step first;
        ``complete=False``: the ``step-N`` folders without one instead."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / _META).is_file() == complete:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def newest_step(self) -> tuple[str, int] | None:
        """``(folder, step)`` of the highest step any complete checkpoint with a sound
        manifest records (file system only), or None."""
        found = [(int(meta["step"]), str(p)) for p in self.folders() if (meta := read_meta(p))]
        step, folder = max(found, default=(0, ""))
        return (folder, step) if found else None

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

    # -- verifying -------------------------------------------------------------------------
    def verify(self, folder: str | Path) -> list[str]:
        """Problems of checkpoint ``folder`` (collective; the same list on every rank): a
        missing manifest, and every file that is missing, truncated or fails its checksum.
        The files are spread over the ranks, each hashes its share. The manifest is
        checked against its digest first. A checkpoint of format 1 has no checksums: only
        its manifest is checked."""
        folder = Path(folder)
        meta, problem = read_manifest(folder)
        files = None if meta is None else meta.get("files")
        if files is None:
            return [] if meta is not None else [str(problem)]
        names = sorted(files)[_rank() :: _world()]
        found = _gather(check_files(folder, files, names))
        return sorted(p for problems in found for p in problems)

    def newest_good(self) -> Path | None:
        """The newest checkpoint that passes ``verify`` (collective), or None if there is
        none at all. Newer bad ones are then moved aside to ``corrupt-step-N`` (out of the
        way of ``latest`` and pruning, kept for inspection) with a warning naming the bad
        file. If checkpoints exist but none is good, nothing is moved and
        ``CheckpointError`` (exit code 2) names every bad file. A ``step-N`` folder without
        a manifest (a save that never finished, or a damaged copy) is skipped with a
        warning naming it."""
        if _rank() == 0:
            for folder in self.folders(complete=False):
                warnings.warn(
                    f"skipping checkpoint folder {folder}: it has no {_META} (a save that never "
                    "finished, or a copy without its manifest)",
                    stacklevel=2,
                )
        latest = self.latest()
        candidates = [latest] if latest is not None else []
        candidates += [p for p in reversed(self.folders()) if p != latest]
        bad: list[tuple[Path, list[str]]] = []
        for folder in _broadcast(candidates):
            problems = self.verify(folder)
            if problems:
                bad.append((folder, problems))
                continue
            if _rank() == 0:
                for skipped, found in bad:
                    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                    warnings.warn(
                        f"checkpoint {skipped} is unusable: {found[0]}{more}; moved it to "
                        f"{self._move_aside(skipped)} and resuming from {folder} instead",
                        stacklevel=2,
                    )
            if bad and dist.is_initialized():
                dist.barrier()
            return folder
        if bad:
            raise CheckpointError(
                f"no usable checkpoint in {self.dir}: {'; '.join(p[0] for _, p in bad)}. "
                "Every checkpoint of this run failed verification; restore the files from a "
                "backup, or start over with --overwrite (this discards the run)",
                code=2,
            )
        return None

    def _move_aside(self, folder: Path) -> Path:
        """Rename a bad checkpoint to a free ``corrupt-step-N[.k]`` name (kept as is if the
        rename fails); returns where it is."""
        aside, k = self.dir / f"corrupt-{folder.name}", 0
        while aside.exists():
            k += 1
            aside = self.dir / f"corrupt-{folder.name}.{k}"
        try:
            folder.rename(aside)
        except OSError:
            return folder
        return aside

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        *,
        scheduler: Any = None,
        extra: dict | None = None,
        shared: dict | None = None,
        metric: float | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and return its folder (collective).

        Model and optimizer state go through DCP, ``extra`` (this rank's own state, if
        given) into ``extra-rank{r}.pt``, the scheduler into ``scheduler.pt``; ``shared``
        (JSON-able, the same on every rank, e.g. the data position) and the checksum of
        every file into the manifest ``meta.json``, written last. Then ``latest`` is
        repointed, folders beyond ``keep_last`` are pruned (never the newest, never the
        best), and a higher ``metric`` than the best so far moves ``best``.
        If anything fails on any rank (a full disk included), every rank raises
        ``CheckpointError`` saying why, the partial folder is removed, and the previous
        checkpoint and ``latest`` are unchanged.
        """
        name = f"step-{step:06d}"
        tmp = self.dir / f".tmp-{name}"
        main = _rank() == 0
        try:
            _agree(_attempt(self._prepare, tmp) if main else None, "preparing")
            _agree(_attempt(self._write, tmp, model, optimizer, scheduler, extra), "writing")
            files = digest_folder(tmp, exclude=_META)
            meta = dict(format=FORMAT_VERSION, step=step, world_size=_world())
            metric = None if metric is None else float(metric)
            meta.update(metric=metric, has_optimizer=optimizer is not None, saved_at=time.time())
            meta.update(shared=shared or {}, files=files)
            _agree(_attempt(self._write_meta, tmp, meta) if main else None, "writing meta.json")
        except (Exception, CheckpointException) as exc:
            # _agree raises on every rank at once, so all ranks are here: drop the partial
            # folder (a full disk stays full otherwise), and let nobody return before it is
            # gone; then say why in one line.
            if main:
                remove_tree(tmp)
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            states = [model.state_dict(), optimizer.state_dict() if optimizer is not None else {}]
            needed, measured = checkpoint_space(reversed(self.folders()), states)
            what = f"checkpoint {name}"
            message = save_failure_message(exc, what, self.dir, needed, measured=measured)
            raise CheckpointError(message) from exc
        _agree(_attempt(self._commit, tmp, name, metric) if main else None, "committing")
        return self.dir / name

    def _prepare(self, tmp: Path) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():  # folders of saves killed earlier
            if p.name.startswith((".tmp-step-", ".old-step-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
        tmp.mkdir()

    def _write(self, tmp, model, optimizer, scheduler, extra) -> None:
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=tmp)
        if extra is not None:
            write_state(state_file(tmp, f"extra-rank{_rank()}", FORMAT_VERSION), extra)
        if _rank() == 0 and scheduler is not None:
            write_state(state_file(tmp, "scheduler", FORMAT_VERSION), scheduler.state_dict())

    @staticmethod
    def _write_meta(tmp: Path, meta: dict) -> None:
        # Written last: a step folder without meta.json is never treated as complete.
        write_text_atomic(tmp / _META, manifest_text(meta))

    def _commit(self, tmp: Path, name: str, metric: float | None) -> None:
        final = self.dir / name
        old = None
        if final.exists():  # re-saving the same step (e.g. after a resume): swap it out
            old = self.dir / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        write_text_atomic(self.dir / "latest", name + "\n")
        if self.keep_best and metric is not None and math.isfinite(metric):  # NaN never best
            best = self.best_metric()
            if best is None or float(metric) > best:
                write_text_atomic(self.dir / "best", name + "\n")
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
        (collective; ``newest_good`` verifies a folder first). Returns ``(step, extra)``:
        the ``shared`` state of the manifest updated with this rank's ``extra`` (if the
        checkpoint has one for this rank).

        A checkpoint of format 1 keeps all its state per rank, so it is refused
        (``CheckpointError``) on a different number of ranks than it was saved with.
        Nothing is unpickled: a file that would need it is refused (``CheckpointError``,
        exit 2, naming it), and files the manifest does not list are ignored with a warning.
        """
        folder = Path(path)
        meta, problem = read_manifest(folder)
        if meta is None:
            raise CheckpointError(f"{folder} is not a usable checkpoint: {problem}", code=2)
        fmt, saved_world = meta.get("format", 1), meta.get("world_size")
        if fmt < 2 and saved_world != _world():
            raise CheckpointError(
                f"{folder} was written by an older spconv-train at {saved_world} ranks and "
                "keeps its data position per rank, which cannot be mapped to "
                f"{_world()} ranks; resume it with {saved_world} ranks "
                f"(torchrun --nproc-per-node {saved_world} ...)",
                code=2,
            )
        listed = listed_files(folder, meta, _rank())
        state = _dcp_state(model, optimizer)  # fresh state (optimizer's initialised) to fill
        load_checkpoint_state(state, folder)
        optims = optimizer if optimizer is not None else []
        set_state_dict(
            model, optims, model_state_dict=state["model"], optim_state_dict=state.get("optim", {})
        )
        if scheduler is not None:
            sched_file = state_file(folder, "scheduler", fmt)
            if sched_file.name not in listed:
                raise FileNotFoundError(f"{folder} holds no scheduler state ({sched_file.name})")
            scheduler.load_state_dict(read_state_file(sched_file, fmt))
        extra = dict(meta.get("shared") or {})
        extra_file = state_file(folder, f"extra-rank{_rank()}", fmt)
        if extra_file.name in listed:
            extra.update(read_state_file(extra_file, fmt))
        elif any(name.startswith("extra-rank") for name in listed):
            warnings.warn(
                f"{folder} has no per-rank state for rank {_rank()} (saved with "
                f"{saved_world} ranks); this rank's extra state starts fresh",
                stacklevel=2,
            )
        return int(meta["step"]), extra

    # -- export ----------------------------------------------------------------------------
    export = staticmethod(export_model)
