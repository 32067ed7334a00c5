"""The files of a checkpoint: checksums for its manifest and their verification, atomic
writes, plain messages for failed writes (a full disk above all), and the per-process RNG
states. Used by ``spconv_train.checkpoint`` (collectives and DCP live there).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointError",
    "check_files",
    "checkpoint_space",
    "digest_files",
    "disk_usage",
    "find_os_error",
    "remove_tree",
    "replace_atomic",
    "rng_state",
    "save_failure_message",
    "save_file",
    "set_rng_state",
    "tensor_bytes",
    "write_text_atomic",
]

_CHUNK = 1 << 22  # 4 MiB reads: hashing keeps up with the disk, memory stays flat


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (corrupt, truncated, missing files, none left) or cannot
    be written (e.g. no space left on device); the message names the file and the fix.
    ``code`` is the exit code it deserves: 2 for an unusable input, 1 for a failed run."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_files(folder: Path, names: Iterable[str]) -> dict[str, dict]:
    """``{name: {"size": bytes, "sha256": hex}}`` of the files ``names`` inside ``folder``."""
    return {n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}


def check_files(folder: Path, manifest: dict[str, dict], names: Iterable[str]) -> list[str]:
    """Problems of the files ``names`` of ``folder`` against their ``manifest`` entries
    (missing, truncated or grown, checksum mismatch), one line each naming the file."""
    problems = []
    for name in names:
        want, path = manifest[name], folder / name
        try:
            size = path.stat().st_size
            if size != want["size"]:
                problems.append(f"{path}: {size} bytes, the manifest says {want['size']}")
            elif _sha256(path) != want["sha256"]:
                problems.append(f"{path}: checksum mismatch (the file is corrupt)")
        except OSError as exc:
            problems.append(f"{path}: unreadable ({exc.strerror or exc})")
    return problems


def find_os_error(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``, its causes/contexts, and (for DCP's
    ``CheckpointException``) the per-rank failures it wraps."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e.__cause__, e.__context__]
    return None


def _size(n: float) -> str:
    """``n`` bytes with three significant digits: 812 bytes, 16.0 KB, 1.64 MB, 120 GB."""
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1024
        if n < 1000 or unit == "TB":
            break
    return f"{n:.{2 if n < 10 else 1 if n < 100 else 0}f} {unit}"


def _sizes(needed: int, free: int) -> tuple[str, str]:
    """Both sizes readable, and exact (in bytes) where rounding would make them equal."""
    a, b = _size(needed), _size(free)
    return (a, b) if a != b else (f"{needed:,} bytes", f"{free:,} bytes")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested containers; a DTensor counts its local
    shard, replicated tensors are written once): a lower bound of what saving it takes."""
    from torch.distributed.tensor import DTensor

    total = 0
    for leaf in torch.utils._pytree.tree_leaves(obj):
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if torch.is_tensor(leaf):
            total += leaf.numel() * leaf.element_size()
    return total


def checkpoint_space(folders: Iterable[Path], states: Any) -> tuple[int, bool]:
    """``(bytes, measured)``: the disk space a checkpoint of ``states`` takes. Measured on
    the first of the complete checkpoint ``folders`` (newest first: the same model and
    optimizer, whose sizes never change in a run), file overhead and block rounding
    included; without one the tensor bytes, a lower bound."""
    for folder in folders:
        try:
            return disk_usage(folder), True
        except OSError:  # pruned meanwhile
            continue
    return tensor_bytes(states), False


def disk_usage(folder: Path) -> int:
    """Bytes the files of ``folder`` take on disk (allocated blocks, as ``du``: what a new
    copy of them needs free, file-system rounding included)."""
    return sum(_usage(p.stat()) for p in folder.iterdir())


def _usage(st: os.stat_result) -> int:
    return getattr(st, "st_blocks", 0) * 512 or st.st_size


def save_failure_message(
    exc: BaseException, what: str, where: Path, needed: int, *, measured: bool = False
) -> str:
    """A one-line message for a failed write of ``what`` into folder ``where``.

    ``needed``: the bytes the write takes on disk if ``measured`` (the size of an earlier
    checkpoint of the same state), else a lower bound (the tensor bytes, without file
    overhead). A full disk is recognised from ``ENOSPC``/``EDQUOT`` anywhere in the
    exception (DCP wraps each rank's error) or, as torch's zip writer reports it only as
    "file write failed", from less free space than ``needed``: then it says so with both
    sizes, the free space measured after the partial files were removed. Otherwise the
    underlying error, unwrapped from DCP's per-rank dictionary.
    """
    os_error = find_os_error(exc)
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    full = os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT)
    if full or (free is not None and free < needed):
        if free is None:
            sizes = f"{_size(needed)} needed, free space unknown in {where}"
        elif measured or needed > free:
            need, have = _sizes(needed, free)
            sizes = f"{'' if measured else 'at least '}{need} needed, {have} free in {where}"
        else:  # the tensors alone would fit: the file overhead did not
            sizes = f"more than the {_size(free)} free in {where} needed"
        return (
            f"{what} failed: no space left on device ({sizes}); the partial files were "
            "removed and the previous checkpoint is kept. Free some space (or set "
            "checkpoint.keep_last lower) and resume with --resume"
        )
    cause = os_error if os_error is not None else exc
    if isinstance(cause, CheckpointException) and cause.failures:
        first = next(iter(cause.failures.values()))
        cause = first[0] if isinstance(first, tuple) else first
    return f"{what} failed: {type(cause).__name__}: {cause}"


def remove_tree(path: Path, attempts: int = 20) -> None:
    """Remove a folder; retry briefly, since file-system writers of other ranks (DCP's
    background writes on shared storage) may still be closing files in it."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.1)


def replace_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` then ``os.replace``: readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the pointer must not outlive a crash as an empty file

    replace_atomic(path, write)


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


def _release(exc: BaseException) -> None:
    """Drop the local variables of the finished frames in ``exc`` and the exceptions it
    chains: they hold torch's zip writer, which keeps the removed partial file open, so
    its space (and the free space the message reports) is only free once they are gone."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def save_file(path: Path, obj: Any, what: str) -> None:
    """``torch.save`` atomically; a failure (the partial file is removed) becomes a
    ``CheckpointError`` saying why, with needed and free space when the disk is full (the
    size of the file it replaces, else the tensor bytes as a lower bound)."""
    try:
        replace_atomic(path, lambda t: torch.save(obj, t))
    except Exception as exc:
        _release(exc)
        try:
            needed, measured = _usage(path.stat()), True
        except OSError:
            needed, measured = tensor_bytes(obj), False
        message = save_failure_message(exc, what, path.parent, needed, measured=measured)
        raise CheckpointError(message) from exc
