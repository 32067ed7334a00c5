"""``scripts/gpu_check.sh --device cpu`` (issue 25 item 6): the device check's CPU mode runs
end to end, so the script cannot rot between the runs on a GPU: the bf16 channels-last
training step (plain and FSDP) against one device, the conv, step and local-kernel
benchmarks, and the report with every table and a PASS verdict. The op grids are the
suite's own test files (run here with ``--skip-grids``: the suite runs them already); the
test files the script names must exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.background_jobs import environ, job

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

REPO = Path(__file__).resolve().parents[1]


@job("gpu_check_cpu")
def _gpu_check_cpu_job(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``scripts/gpu_check.sh --device cpu --out FOLDER --skip-grids``."""
    env = dict(environ(), PYTHON=sys.executable)
    env.pop("SPCONV_TEST_DEVICE", None)
    script = str(REPO / "scripts" / "gpu_check.sh")
    done = subprocess.run(
        ["bash", script, "--device", "cpu", "--out", str(folder), "--skip-grids"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, folder


@pytest.mark.job("gpu_check_cpu")
def test_gpu_check_cpu_mode_passes_and_writes_every_table(background_jobs):
    """The script's CPU mode (run in the background: ``_gpu_check_cpu_job``)."""
    done, tmp_path = background_jobs.result("gpu_check_cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    assert report.rstrip().endswith("verdict: PASS"), report
    assert "skipped (--skip-grids)" in report
    step = [line for line in report.splitlines() if line.startswith(("| 2 | False", "| 2 | True"))]
    assert len(step) == 2 and all(line.endswith("| pass |") for line in step), report
    assert "| 2 | halo (spconv) |" in report  # bench_conv
    assert "| unet | 2 | off | off |" in report  # bench_step
    assert "| conv3x3 | bf16 | channels_last |" in report  # bench_kernels


def test_gpu_check_names_existing_grid_files():
    """Every test file the op-grid section runs (CUDA and CPU lists) exists."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    lists = re.findall(r"GRIDS=\((.*?)\)", script, flags=re.S)
    assert len(lists) == 2, lists
    files = [f for block in lists for f in block.split()]
    assert files and all(f.startswith("tests/test_") for f in files), files
    missing = [f for f in files if not (REPO / f).is_file()]
    assert not missing, f"scripts/gpu_check.sh names missing test files: {missing}"


def test_gpu_check_refuses_an_unknown_device():
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "tpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--device must be cuda or cpu" in done.stderr
