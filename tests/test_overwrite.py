"""``--overwrite`` deletes all of the previous run or nothing (``spconv_train.logging.overwrite``).

A symlinked ``checkpoints/`` (before: a traceback, ``config.yaml`` already gone, the old
``model.pt`` and ``job.json`` kept) is unlinked and its target kept. Entries that cannot be
deleted are found before anything is: the tests run as root, which permissions do not
stop, so they use what stops root too (``chattr +i`` / ``+a`` on ext4, and a mount point),
and check write permission as an unprivileged user in a forked child.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.config import ConfigError
from spconv_train.logging.overwrite import check_removable, inspect_removal, remove_run_files
from spconv_train.logging.run_folder import JOB_FILE, RUN_FILES, JobRecord, read_job, write_job
from tests.test_train_e2e import ok, plain, tiny_config

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): file digests, link targets."""
    out = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


def _old_run(run_dir: Path, checkpoints: Path | None = None) -> Path:
    """A finished earlier run in ``run_dir``; its checkpoints in ``checkpoints`` (a folder
    elsewhere, linked as ``run_dir/checkpoints``) when given. Returns the checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = checkpoints or run_dir / "checkpoints"
    step = ckpts / "step-000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2}))
    (step / "__0_0.distcp").write_bytes(bytes(range(256)) * 3)
    (ckpts / "latest").write_text("step-000002\n")
    if checkpoints is not None:
        (run_dir / "checkpoints").symlink_to(checkpoints, target_is_directory=True)
    (run_dir / "config.yaml").write_text("run_dir: old\n")
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 1.25}\n')
    (run_dir / "model.pt").write_bytes(b"old weights \x00\x01")
    write_job(run_dir, JobRecord(job="old-job", decision="fresh", finished=True))
    return step


# --- links ------------------------------------------------------------------------------------


def test_overwrite_over_a_symlinked_checkpoints_folder_keeps_the_target(tmp_path):
    """A real run with --overwrite: the link is removed (its target untouched), the rest
    of the old run too, the console lists every removal, and the new run is complete."""
    scratch = tmp_path / "scratch" / "ckpts"
    run_dir = tmp_path / "run"
    _old_run(run_dir, checkpoints=scratch)
    before = _tree(scratch)
    proc = ok(plain(tiny_config(tmp_path), "--overwrite"))
    assert _tree(scratch) == before
    said = " ".join(proc.stdout.split())  # the console wraps long lines
    assert f"removed the link checkpoints -> {scratch} (the target was kept)" in said, said
    for name in ("config.yaml", "metrics.jsonl", "model.pt", JOB_FILE):
        assert f"removed {name}" in said, said
    ckpts = run_dir / "checkpoints"
    assert ckpts.is_dir() and not ckpts.is_symlink()
    assert (ckpts / "latest").read_text().strip() == "step-000004"  # the new run's
    assert (run_dir / "model.pt").read_bytes() != b"old weights \x00\x01"
    assert read_job(run_dir).decision == "overwrite"


def test_links_are_unlinked_never_followed(tmp_path):
    """A dangling link, and links inside the checkpoints to files elsewhere: removed, the
    files they point to kept."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"keep me")
    run_dir = tmp_path / "run"
    step = _old_run(run_dir)
    (step / "extra.bin").symlink_to(outside / "weights.bin")
    (step / "shared").symlink_to(outside, target_is_directory=True)
    (run_dir / "tensorboard").symlink_to(tmp_path / "gone")  # dangling
    removals = check_removable(run_dir, RUN_FILES)
    assert {r.name: r.kind for r in removals} == {
        "config.yaml": "file",
        "checkpoints": "folder",
        "tensorboard": "link",
        "metrics.jsonl": "file",
        "model.pt": "file",
        JOB_FILE: "file",
    }
    lines = remove_run_files(run_dir, RUN_FILES)
    assert f"removed the link tensorboard -> {tmp_path / 'gone'} (the target was kept)" in lines
    assert "removed checkpoints/ (6 entries)" in lines  # step-*/, latest, 2 files, 2 links
    assert list(run_dir.iterdir()) == []
    assert _tree(outside) == {"weights.bin": hashlib.sha256(b"keep me").hexdigest()}


# --- entries that cannot be deleted: found first, nothing deleted -----------------------------


def _chattr(flag: str, path: Path) -> None:
    result = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"chattr {flag} is not available here: {result.stderr.strip()}")


@pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs)")
@pytest.mark.parametrize(
    ("flag", "which", "says"),
    [("+i", "file", "is immutable (chattr +i"), ("+a", "folder", "is append-only (chattr +a")],
)
def test_an_entry_that_cannot_be_deleted_stops_the_run_before_anything_is(
    tmp_path, flag, which, says
):
    """One checkpoint file immutable, or the step folder append-only (root cannot delete
    either): exit 2 naming it, and every byte of the old run is still there (before: the
    files before it were deleted, then a traceback)."""
    run_dir = tmp_path / "run"
    step = _old_run(run_dir)
    stuck = step / "__0_0.distcp" if which == "file" else step
    config = tiny_config(tmp_path)
    before = _tree(run_dir)
    _chattr(flag, stuck)
    try:
        result = CliRunner().invoke(app, ["run", str(config), "--overwrite"])
        after = _tree(run_dir)
    finally:
        _chattr(flag.replace("+", "-"), stuck)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"{stuck} {says}" in said and "nothing was deleted" in said, said
    assert after == before


def test_a_mount_point_is_never_emptied():
    """rmtree would delete a mounted file system's files, then fail on the mount point.
    Checked on a real one (only inspected: the check reads, never deletes)."""
    if not os.path.ismount("/dev/shm"):
        pytest.skip("/dev/shm is not a mount point here")
    removals, problems = inspect_removal("/dev", ["shm"])
    assert [r.kind for r in removals] == ["folder"]
    assert "/dev/shm is a mount point (unmount it first)" in problems


def test_a_bind_mount_inside_the_checkpoints_is_found_first(tmp_path):
    """A folder bind-mounted into a checkpoint (same file system: ``os.path.ismount`` does
    not see it): rmtree would have emptied the mounted folder. Exit 2 and nothing deleted;
    needs the right to mount (root), else skipped."""
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "image.png").write_bytes(b"keep me")
    run_dir = tmp_path / "run"
    mounted = _old_run(run_dir) / "data"
    mounted.mkdir()
    bind = subprocess.run(["mount", "--bind", str(data), str(mounted)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bind.stderr.decode().strip()}")
    try:
        before = _tree(run_dir)
        with pytest.raises(ConfigError) as err:
            remove_run_files(run_dir, RUN_FILES)
        assert f"{mounted} is a mount point" in str(err.value)
        assert _tree(run_dir) == before
    finally:
        subprocess.run(["umount", str(mounted)], check=True)
    assert (data / "image.png").read_bytes() == b"keep me"


def _problems_as(uid: int | None, run_dir: Path) -> list[str]:
    """``inspect_removal`` of every run file, run as user ``uid`` in a forked child."""
    if uid is None:
        return inspect_removal(run_dir, RUN_FILES)[1]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, inspect, report, leave without cleanup
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, json.dumps(inspect_removal(run_dir, RUN_FILES)[1]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_a_folder_without_write_permission_is_found_first():
    """As an unprivileged user (a forked child when the tests run as root): a checkpoint
    folder without write permission cannot be emptied, which the check reports."""
    base = Path(tempfile.mkdtemp(prefix="spconv-overwrite-", dir="/tmp"))
    try:
        base.chmod(0o755)
        run_dir = base / "run"
        step = _old_run(run_dir)
        uid = 65534 if os.geteuid() == 0 else None  # nobody
        if uid is not None:
            for p in (run_dir, *run_dir.rglob("*")):
                os.lchown(p, uid, uid)
        assert _problems_as(uid, run_dir) == []
        step.chmod(0o555)
        want = f"{step}: no permission to delete entries in it (needs write and search rights)"
        assert _problems_as(uid, run_dir) == [want]
    finally:
        for p in base.rglob("*"):
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(base)
