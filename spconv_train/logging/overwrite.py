"""``--overwrite``: all or nothing (no torch).

Everything a previous run left (``run_folder.RUN_FILES``) is inspected before anything is
deleted: a symbolic link is only unlinked, never followed (its target is kept); a folder
is walked without following links; a mount point, an immutable or append-only entry
(``chattr +i`` / ``+a``, which stop root too), a folder whose entries this user may not
remove (write and search permission, the sticky bit) or an entry that cannot be inspected
is found first, and then nothing is deleted at all (``ConfigError``, exit 2, naming every
such path). Only when every entry can go is it deleted, and each removal is described for
the console.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spconv_train.config import ConfigError

__all__ = ["Removal", "check_removable", "inspect_removal", "remove_run_files"]

# Linux inode flags (``FS_IOC_GETFLAGS``, <linux/fs.h>): entries no one may delete or rename.
_FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
_IMMUTABLE, _APPEND = 0x10, 0x20
_SHOWN = 8  # problems listed in the error; the rest are counted


@dataclass(frozen=True)
class Removal:
    """One entry of the run folder that ``--overwrite`` deletes.

    Attributes:
        name: the entry's name inside the run folder.
        kind: ``"file"``, ``"folder"`` or ``"link"`` (a symbolic link, removed alone).
        files: the number of entries inside a folder (0 otherwise).
        target: where a link points (it is kept).
    """

    name: str
    kind: str
    files: int = 0
    target: str = ""

    def describe(self) -> str:
        """What removing it did, for the console."""
        if self.kind == "link":
            return f"removed the link {self.name} -> {self.target} (the target was kept)"
        if self.kind == "folder":
            return f"removed {self.name}/ ({self.files} entries)"
        return f"removed {self.name}"


def _inode_flags(path: Path, mode: int) -> int:
    """The Linux inode flags of a regular file or folder (0 where they cannot be read)."""
    if not sys.platform.startswith("linux") or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0  # unreadable to this user: deleting it needs no read permission
    try:
        buf = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(struct.calcsize("l")))
        return struct.unpack("l", buf)[0] & 0xFFFFFFFF
    except OSError:  # a file system without inode flags
        return 0
    finally:
        os.close(fd)


def _flag_problem(path: Path, st: os.stat_result) -> str | None:
    flags = _inode_flags(path, st.st_mode)
    if flags & _IMMUTABLE:
        return f"{path} is immutable (chattr +i; clear it with chattr -i)"
    if flags & _APPEND:
        return f"{path} is append-only (chattr +a; clear it with chattr -a)"
    return None


def _folder_problem(folder: Path, st: os.stat_result) -> str | None:
    """Why this user cannot remove entries of ``folder`` (None if it can)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder}: no permission to delete entries in it (needs write and search rights)"
    return _flag_problem(folder, st)


def _sticky_problem(path: Path, st: os.stat_result, parent: os.stat_result) -> str | None:
    """In a sticky folder (like /tmp) only the owners of the entry or folder may delete it."""
    uid = os.geteuid()
    if not parent.st_mode & stat.S_ISVTX or uid == 0 or uid in (st.st_uid, parent.st_uid):
        return None
    return f"{path}: owned by user {st.st_uid} in a sticky folder; only its owner may delete it"


def _mount_points() -> set[str]:
    """Every mount point of this process (bind mounts on the same file system included,
    which ``os.path.ismount`` cannot tell); empty where ``/proc`` does not say."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    # field 5 is the mount point, with spaces and the like written as octal escapes
    fields = [line.split() for line in lines]
    return {re.sub(r"\\([0-7]{3})", _octal, f[4]) for f in fields if len(f) > 4}


def _octal(match: re.Match) -> str:
    return chr(int(match[1], 8))


def _walk(top: Path, problems: list[str]) -> int:
    """Check every entry under the real folder ``top`` (links are not followed); returns
    the number of entries."""
    count, mounts = 0, _mount_points()

    def unreadable(exc: OSError) -> None:
        problems.append(f"{exc.filename}: cannot be inspected ({exc.strerror})")

    for dirpath, dirnames, filenames in os.walk(top, onerror=unreadable):
        folder = Path(dirpath)
        try:
            here = os.lstat(folder)
        except OSError as exc:
            unreadable(exc)
            continue
        if os.path.ismount(folder) or os.path.realpath(folder) in mounts:
            # rmtree would empty the mounted file system, then fail on the mount point
            problems.append(f"{folder} is a mount point (unmount it first)")
            dirnames.clear()
            continue
        if dirnames or filenames:
            problems += filter(None, [_folder_problem(folder, here)])
        for name in (*dirnames, *filenames):
            count += 1
            entry = folder / name
            try:
                st = os.lstat(entry)
            except OSError as exc:
                unreadable(exc)
                continue
            problems += filter(None, [_flag_problem(entry, st), _sticky_problem(entry, st, here)])
    return count


def inspect_removal(run_dir: str | Path, names: Sequence[str]) -> tuple[list[Removal], list[str]]:
    """What deleting ``names`` inside ``run_dir`` would remove, and every reason it cannot
    (reads only). Missing names are skipped; links are described, never followed."""
    run_dir = Path(run_dir)
    removals: list[Removal] = []
    problems: list[str] = []
    present = [name for name in names if os.path.lexists(run_dir / name)]
    if not present:
        return removals, problems
    try:
        parent = os.stat(run_dir)
    except OSError as exc:
        return removals, [f"{run_dir}: cannot be inspected ({exc.strerror})"]
    problems += filter(None, [_folder_problem(run_dir, parent)])
    for name in present:
        path = run_dir / name
        try:
            st = os.lstat(path)
        except OSError as exc:
            problems.append(f"{path}: cannot be inspected ({exc.strerror})")
            continue
        problems += filter(None, [_sticky_problem(path, st, parent)])
        if stat.S_ISLNK(st.st_mode):
            removals.append(Removal(name, "link", target=os.readlink(path)))
            continue
        problems += filter(None, [_flag_problem(path, st)])
        if stat.S_ISDIR(st.st_mode):
            removals.append(Removal(name, "folder", files=_walk(path, problems)))
        else:
            removals.append(Removal(name, "file"))
    return removals, list(dict.fromkeys(problems))  # a folder may be named twice


def check_removable(run_dir: str | Path, names: Sequence[str]) -> list[Removal]:
    """What ``--overwrite`` would remove; ``ConfigError`` naming every entry that cannot be
    removed (then nothing may be deleted)."""
    removals, problems = inspect_removal(run_dir, names)
    if problems:
        shown = "; ".join(problems[:_SHOWN])
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ConfigError(
            "--overwrite",
            f"cannot delete the previous run in {run_dir}, so nothing was deleted: "
            f"{shown}{more}. Fix these, delete the run yourself, or choose another folder "
            "with --set run_dir=...",
        )
    return removals


def remove_run_files(run_dir: str | Path, names: Sequence[str]) -> list[str]:
    """Delete ``names`` inside ``run_dir`` once every one is known to be removable (checked
    again here: the folder may have changed since the start was planned); returns one line
    per removed entry. A link is removed, never what it points to."""
    removals = check_removable(run_dir, names)
    done: list[Removal] = []
    for item in removals:
        path = Path(run_dir) / item.name
        try:
            if item.kind == "folder":
                shutil.rmtree(path)  # never follows links inside (fd-based on Linux)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        except OSError as exc:  # the folder changed between the check and the removal
            so_far = ", ".join(d.name for d in done) or "nothing"
            raise ConfigError(
                "--overwrite",
                f"could not delete {exc.filename or path}: {exc.strerror}; removed so far: "
                f"{so_far}. Delete the rest of the previous run yourself and start again",
            ) from exc
        done.append(item)
    return [d.describe() for d in done]
