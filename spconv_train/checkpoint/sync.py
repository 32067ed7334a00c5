"""Collectives of the checkpoint layer: every rank learns of every rank's failure, and all
ranks act on rank 0's view of a folder. Each helper degrades to a no-op without a process
group (a plain single-process run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from spconv_train.checkpoint.files import digest_files

__all__ = ["agree", "attempt", "broadcast", "digest_folder", "gather", "rank", "world"]


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(error: BaseException | None, what: str) -> None:
    """Synchronise all ranks (acts as a barrier) and raise on every rank if any failed, so a
    failure on one rank never leaves the others waiting in a later collective."""
    msg = None if error is None else f"rank {rank()}: {type(error).__name__}: {error}"
    if world() > 1:
        gathered: list[Any] = [None] * world()
        dist.all_gather_object(gathered, msg)
        failed = [m for m in gathered if m is not None]
    else:
        failed = [msg] if msg is not None else []
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint {what} failed on another rank: " + "; ".join(failed))


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (so that all ranks act on one listing of a folder)."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def attempt(fn: Callable, *args: Any) -> Exception | None:
    """Run ``fn``; return its exception instead of raising (``agree`` reports it)."""
    try:
        fn(*args)
    # DCP's CheckpointException is a BaseException: without it a failed dcp.save skipped
    # the clean-up of the partial folder.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported via agree
        return exc
    return None


def digest_folder(folder: Path, *, exclude: str) -> dict[str, dict]:
    """Size and sha256 of every file in ``folder`` but ``exclude`` (collective: rank 0
    lists the folder, each rank hashes its share, reading back what the ranks wrote)."""
    names = broadcast(sorted(p.name for p in folder.iterdir() if p.name != exclude))
    mine: dict | Exception | None = None
    try:
        mine = digest_files(folder, names[rank() :: world()])
    except OSError as exc:
        mine = exc
    agree(mine if isinstance(mine, Exception) else None, "hashing")
    files: dict[str, dict] = {}
    for part in gather(mine):
        files.update(part)
    return files
