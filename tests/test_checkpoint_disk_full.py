"""A full disk is reported with the real sizes: what a checkpoint takes on disk (measured on
the previous one: file overhead and block rounding included, not just the tensor bytes)
and what is free once the partial files are gone, never two sizes that say it would fit.

Real small tmpfs disks (needs root; skipped where mounting is not allowed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from spconv_train.checkpoint import CheckpointError, CheckpointManager
from spconv_train.checkpoint.files import tensor_bytes

UNITS = {"bytes": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
SIZE = r"([\d.,]+) (bytes|KB|MB|GB|TB)"
SIZES = re.compile(rf"\((at least )?{SIZE} needed, {SIZE} free in ")
MORE_THAN = re.compile(rf"\(more than the {SIZE} free in .* needed\)")


def as_bytes(number: str, unit: str) -> float:
    return float(number.replace(",", "")) * UNITS[unit]


def usage(folder: Path) -> int:
    """Allocated bytes of the files in ``folder`` (as ``du``)."""
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir())


def close(reported: float, real: float) -> bool:
    """Equal to the three significant digits the message prints."""
    return abs(reported - real) <= 0.005 * real + 1


@contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    where.mkdir()
    size = -(-size // 4096) * 4096  # whole pages
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    done = subprocess.run(mount, capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """About 1.6 MB of checkpoint (weights and AdamW moments) in a few files."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 5, bias=False), nn.Conv2d(64, 64, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 64, 8, 8)).sum().backward()
    opt.step()
    return model, opt


def save(cm: CheckpointManager, step: int, model, opt) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single ..."
        cm.save(step, model, opt)


def checkpoint_usage(tmp_path: Path) -> int:
    """What one checkpoint of ``trained()`` takes on disk (saved on the ordinary disk)."""
    cm = CheckpointManager(tmp_path / "probe")
    save(cm, 1, *trained())
    return usage(cm.dir / "step-000001")


def test_second_save_reports_the_measured_size_and_the_real_free_space(tmp_path):
    model, opt = trained()
    one = checkpoint_usage(tmp_path)
    with tmpfs(tmp_path / "disk", one + 64 * 1024) as disk:
        cm = CheckpointManager(disk, keep_last=1)
        save(cm, 1, model, opt)
        with pytest.raises(CheckpointError) as info:
            save(cm, 2, model, opt)
        message = str(info.value)
        found = SIZES.search(message)
        assert found and not found.group(1), message  # measured: no "at least"
        needed, free = as_bytes(*found.group(2, 3)), as_bytes(*found.group(4, 5))
        real_needed = usage(cm.dir / "step-000001")
        real_free = shutil.disk_usage(disk).free
        assert close(needed, real_needed) and close(free, real_free), (message, real_needed)
        assert needed > free and "step-000002" in message
        assert sorted(p.name for p in cm.dir.iterdir()) == ["latest", "step-000001"]


def test_a_first_save_that_does_not_fit_never_claims_it_would(tmp_path):
    """The disk holds the tensor bytes but not the files: no "X needed, Y free" with X <= Y
    (the old message said "1.6 MB needed, 1.6 MB free")."""
    model, opt = trained()
    estimate = tensor_bytes([model.state_dict(), opt.state_dict()])
    one = checkpoint_usage(tmp_path)
    assert one - estimate > 16 * 1024  # file overhead and page rounding
    with tmpfs(tmp_path / "disk", (estimate + one) // 2) as disk:
        cm = CheckpointManager(disk)
        with pytest.raises(CheckpointError) as info:
            save(cm, 1, model, opt)
        message = str(info.value)
        assert "no space left on device" in message, message
        found, more = SIZES.search(message), MORE_THAN.search(message)
        real_free = shutil.disk_usage(disk).free
        if found:
            assert as_bytes(*found.group(2, 3)) > as_bytes(*found.group(4, 5)), message
        else:
            assert more and close(as_bytes(*more.group(1, 2)), real_free), message
        assert not (cm.dir / "step-000001").exists()


def test_a_failed_export_reports_the_space_freed_by_its_partial_file(tmp_path):
    """torch's zip writer kept the removed partial file open (its space still taken) while
    the message measured the free space: it said 0 MB free."""
    model = nn.Conv2d(64, 64, 5, bias=False)  # 400 KB: fits once, not twice
    with tmpfs(tmp_path / "disk", 768 * 1024) as disk:
        target = disk / "model.pt"
        CheckpointManager.export(model, target)
        with pytest.raises(CheckpointError) as info:
            CheckpointManager.export(model, target)
        message = str(info.value)
        found = SIZES.search(message)
        assert found and not found.group(1), message
        needed, free = as_bytes(*found.group(2, 3)), as_bytes(*found.group(4, 5))
        real_free = shutil.disk_usage(disk).free
        assert close(needed, target.stat().st_blocks * 512) and close(free, real_free), message
        assert free > 100 * 1024 and needed > free
