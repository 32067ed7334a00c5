"""Corrupt checkpoints are detected and skipped; failed saves (a full disk) clean up.

* Every file of a checkpoint has its size and sha256 in the manifest; a bit flip of the
  same size, a truncated or a missing file makes ``newest_good`` skip to the previous
  checkpoint with a warning naming the file; no good one left: ``CheckpointError`` (exit 2)
  naming every bad file. Format-1 checkpoints (no checksums) still load.
* A save that fails inside DCP (its ``CheckpointException`` is no ``Exception``) removes its
  partial folder and says "no space left on device (... MB needed, ... MB free)"; on a real
  full tmpfs too, for checkpoints and for the ``model.pt`` export.
* End to end: ``spconv-train run --resume`` on a run whose newest checkpoint was bit-flipped
  resumes from the previous one and ends with exactly the uninterrupted run's weights; under
  a real ``torchrun`` restart too, in
  ``tests/test_train_e2e.py::test_torchrun_restart_resumes_automatically``.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import spconv_train.checkpoint.manager as ckpt
from spconv_train.checkpoint import CheckpointError, CheckpointManager
from spconv_train.checkpoint.manifest import read_state
from tests.reference import seeded

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

SIZE = r"[\d.,]+ (bytes|[KMGT]B)"
NO_SPACE = re.compile(rf"no space left on device \((at least )?{SIZE} needed, {SIZE} free")


def small_net(seed: int, width: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.Conv2d(width, 2, 1))


def states_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def step_model(model: nn.Module, opt, seed: int) -> None:
    loss = model(seeded(seed, 2, 3, 6, 7)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def flip_bit(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


def corruption_case(root: str) -> list[str]:
    """Three checkpoints; damage the newest two in turn (bit flip of the same size in a
    .distcp, a truncated scheduler-free file, a missing extra file): the resume point falls
    back to the newest good one, whose state loads exactly; all bad: CheckpointError."""
    rank, failures = dist.get_rank(), []
    model = small_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cm = CheckpointManager(root, keep_last=3)
    states = {}
    for step in (1, 2, 3):
        step_model(model, opt, step)
        cm.save(step, model, opt, extra={"rank": rank}, shared={"data": {"epoch": 0, "at": step}})
        states[step] = small_net(9)
        states[step].load_state_dict(model.state_dict())
    meta = ckpt.read_meta(cm.dir / "step-000003")
    if meta["format"] != ckpt.FORMAT_VERSION or sorted(meta["files"]) != sorted(
        p.name for p in (cm.dir / "step-000003").iterdir() if p.name != "meta.json"
    ):
        failures.append(f"manifest lists {sorted(meta['files'])}")
    dist.barrier()
    if rank == 0:
        distcp = sorted((cm.dir / "step-000003").glob("*.distcp"))
        biggest = max(distcp, key=lambda p: p.stat().st_size)
        flip_bit(biggest, biggest.stat().st_size // 2)  # same size, one bit
        extra = cm.dir / "step-000002" / "extra-rank1.json"
        extra.write_bytes(extra.read_bytes()[:10])  # truncated
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        good = cm.newest_good()
    if good != cm.dir / "step-000001":
        failures.append(f"newest_good() = {good}")
    said = " ".join(str(w.message) for w in caught)
    if rank == 0 and not (biggest.name in said and "extra-rank1.json" in said):
        failures.append(f"warnings do not name the bad files: {said!r}")
    for step in (2, 3):
        if not (cm.dir / f"corrupt-step-00000{step}").is_dir() or cm.latest() != good:
            failures.append(f"step {step} not moved aside; latest() = {cm.latest()}")
    fresh = small_net(5)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    step, extra = cm.load(good, fresh, opt2)
    if (step, extra) != (1, {"data": {"epoch": 0, "at": 1}, "rank": rank}):
        failures.append(f"loaded {step}, {extra}")
    if not states_equal(fresh, states[1]):
        failures.append("the fallback checkpoint's weights differ from those saved")

    # The last good one goes missing a file: nothing usable left, every bad file named.
    dist.barrier()
    if rank == 0:
        (good / "scheduler.pt").write_bytes(b"")  # not in the manifest: ignored
        next(good.glob("*.distcp")).unlink()
    dist.barrier()
    try:
        cm.newest_good()
        failures.append("no error with every checkpoint bad")
    except CheckpointError as exc:
        if exc.code != 2 or "step-000001" not in str(exc) or "unreadable" not in str(exc):
            failures.append(f"error {exc} (code {exc.code})")
    if not good.is_dir():  # nothing good to resume from: nothing is moved either
        failures.append("the last checkpoint was moved aside although none is good")
    return failures


def legacy_case(root: str) -> list[str]:
    """A format-1 checkpoint (no checksums, per-rank state only) loads on its own world
    size and is refused, with the world size to use, on another."""
    failures = []
    model = small_net(0)
    cm = CheckpointManager(root)
    folder = cm.save(4, model, None, extra={"data": {"epoch": 1, "position": 2}})
    dist.barrier()
    if dist.get_rank() == 0:
        meta = ckpt.read_meta(folder)
        for key in ("files", "shared", "digest"):
            del meta[key]
        meta.update(format=1, world_size=dist.get_world_size() + 1)
        (folder / "meta.json").write_text(json.dumps(meta))
        for state in folder.glob("extra-rank*.json"):  # format 1 kept it in torch files
            torch.save(read_state(state), state.with_suffix(".pt"))
            state.unlink()
    dist.barrier()
    if cm.verify(folder) or cm.newest_good() != folder:
        failures.append("a format-1 checkpoint did not verify")
    try:
        cm.load(folder, small_net(1), None)
        failures.append("format 1 loaded on another world size")
    except CheckpointError as exc:
        if "--nproc-per-node 3" not in str(exc):
            failures.append(f"message {exc}")
    dist.barrier()
    if dist.get_rank() == 0:
        meta.update(world_size=dist.get_world_size())
        (folder / "meta.json").write_text(json.dumps(meta))
    dist.barrier()
    fresh = small_net(1)
    step, extra = cm.load(folder, fresh, None)
    if (step, extra) != (4, {"data": {"epoch": 1, "position": 2}}) or not states_equal(
        fresh, model
    ):
        failures.append(f"format 1 on its world size: {step}, {extra}")
    return failures


def injected_full_disk_case(root: str) -> list[str]:
    """DCP fails on the last rank after a real partial write with ENOSPC, wrapped in its
    CheckpointException (a BaseException): the partial folder goes, the previous checkpoint
    stays, every rank raises CheckpointError saying the disk is full."""
    world, failures = dist.get_world_size(), []
    model = small_net(0)
    cm = CheckpointManager(root)
    good = cm.save(1, model, None)
    real_save = ckpt.dcp.save

    def full_disk(*args, **kwargs):
        real_save(*args, **kwargs)
        error = OSError(28, "No space left on device")
        raise CheckpointException("write failed", {world - 1: (error, None)})

    big = 1 << 50  # more than any disk has free: the message must say the disk is full
    with (
        mock.patch.object(ckpt.dcp, "save", full_disk),
        mock.patch.object(ckpt, "checkpoint_space", lambda folders, states: (big, True)),
    ):
        try:
            cm.save(2, model, None)
            failures.append("save did not raise")
        except CheckpointError as exc:
            if not NO_SPACE.search(str(exc)) or "step-000002" not in str(exc):
                failures.append(f"message: {exc}")
    dist.barrier()
    left = sorted(p.name for p in cm.dir.iterdir())
    if left != ["latest", "step-000001"] or cm.latest() != good or cm.verify(good):
        failures.append(f"left {left}, latest {cm.latest()}")
    return failures


def test_corrupt_checkpoints_fall_back_to_the_newest_good_one(dist_pool, tmp_path):
    for rank, failures in enumerate(dist_pool.run(2, corruption_case, str(tmp_path))):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_format_1_checkpoints_still_load(dist_pool, tmp_path):
    for rank, failures in enumerate(dist_pool.run(2, legacy_case, str(tmp_path))):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_failed_dcp_save_removes_its_folder_and_says_disk_full(dist_pool, tmp_path):
    for rank, failures in enumerate(dist_pool.run(2, injected_full_disk_case, str(tmp_path))):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


# --- a real full disk: a small tmpfs (needs root; skipped where mount is not allowed) ------


@pytest.fixture
def tiny_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(where)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def real_full_disk_case(root: str) -> list[str]:
    """A ~400 KB checkpoint fits on the 768 KB disk once, not twice: the second save fails
    with ENOSPC for real, its partial folder is removed (the space is free again), and the
    first checkpoint verifies and loads."""
    failures = []
    model = small_net(0, width=8)
    model.add_module("big", nn.Conv2d(64, 64, 5, bias=False))  # 400 KB of weights
    cm = CheckpointManager(root, keep_last=1)
    good = cm.save(1, model, None)
    try:
        cm.save(2, model, None)
        failures.append("the second save fitted on the tiny disk")
    except CheckpointError as exc:
        if not NO_SPACE.search(str(exc)):
            failures.append(f"message: {exc}")
    dist.barrier()
    left = sorted(p.name for p in cm.dir.iterdir())
    if left != ["latest", "step-000001"] or cm.verify(good):
        failures.append(f"left {left}")
    fresh = small_net(1, width=8)
    fresh.add_module("big", nn.Conv2d(64, 64, 5, bias=False))
    cm.load(cm.newest_good(), fresh, None)
    if not states_equal(fresh, model):
        failures.append("the kept checkpoint does not load")
    return failures


def test_full_disk_keeps_the_previous_checkpoint(dist_pool, tiny_disk):
    for rank, failures in enumerate(dist_pool.run(2, real_full_disk_case, str(tiny_disk))):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_full_disk_export_leaves_no_partial_model_pt(tiny_disk):
    model = nn.Conv2d(64, 64, 5, bias=False)  # 400 KB: fits once, not twice
    target = tiny_disk / "model.pt"
    CheckpointManager.export(model, target)
    before = target.read_bytes()
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match=NO_SPACE.pattern):
        CheckpointManager.export(model, target)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["model.pt"]
    assert target.read_bytes() == before


# --- end to end: the CLI resumes past a bit-flipped checkpoint -----------------------------

TINY = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 1, base_width: 4}}}}
data: {{height: 16, width: 32, num_train: 4, num_val: 1, hflip: 0.5}}
optimizer: {{name: adamw, lr: 3.0e-3}}
training: {{steps: 4, val_every: 100, log_every: 1}}
checkpoint: {{every: 2, keep_last: 2}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def spconv_run(*args: object) -> tuple[int, str]:
    """``spconv-train run ARGS`` in this process (one rank): the exit code and everything it
    printed, warnings included."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["run", *map(str, args)], env={"COLUMNS": "200"})
    return result.exit_code, result.output + "\n".join(str(w.message) for w in caught)


def test_cli_resume_skips_a_bit_flipped_checkpoint(tmp_path):
    config = tmp_path / "run.yaml"
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
    config.write_text(TINY.format(run_dir=run_dir))
    code, out = spconv_run(config)
    assert code == 0, out[-3000:]
    want = torch.load(run_dir / "model.pt", weights_only=True)["model"]
    bad = max(
        (run_dir / "checkpoints/step-000004").glob("*.distcp"), key=lambda p: p.stat().st_size
    )
    flip_bit(bad, 1000)
    code, out = spconv_run(config, "--resume")
    assert code == 0, out[-3000:]
    assert f"{bad.name}: checksum mismatch" in out and "step-000002" in out
    assert "--overwrite" not in out  # a good checkpoint exists: never suggest discarding
    got = torch.load(run_dir / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(want[k], got[k]) for k in want)  # resumed == uninterrupted

    for folder in (run_dir / "checkpoints").glob("step-*"):  # now every one is bad
        flip_bit(max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size), 1000)
    code, out = spconv_run(config, "--resume")
    assert code == 2, out[-3000:]
    assert "no usable checkpoint" in out and "checksum mismatch" in out
