"""``spconv-train verify`` (issue 5, items 1, 2 and 4).

``run_verify`` is called directly on the ranks of the shared gloo worker pool (the tiny U-Net
at 2 and 3 ranks in float64, fp32 and bf16, a data-parallel x spatial mesh, the reference on
rank 0 only, LR-ASPP MobileNetV3 at 2 ranks); a deliberately broken halo exchange must make
it fail; one real ``spconv-train verify --nproc 2`` goes through torchrun.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from spconv_train.verify._compare import Check, Collector, floors, resolve_tolerances
from spconv_train.verify._report import VerifyReport
from tests.background_jobs import job
from tests.processes import launch

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_classes=3",
    "model.kwargs={depth: 2, base_width: 4}",
    "data.height=32",
    "data.width=64",
    "data.num_train=4",
    "data.num_val=2",
    "schedule.warmup_steps=2",
    "run_dir=/nonexistent/verify-never-written",
]
TINY_YAML = """\
model: {name: unet, num_classes: 3, kwargs: {depth: 2, base_width: 4}}
data: {height: 32, width: 64, num_train: 4, num_val: 2}
schedule: {warmup_steps: 2}
"""


# --- in the worker pool ---------------------------------------------------------------------


def _verify(overrides: list[str], **kw) -> dict:
    from rich.console import Console

    from spconv_train.config import load_config
    from spconv_train.verify import run_verify

    out = io.StringIO()
    cfg = load_config(None, overrides)
    report = run_verify(cfg, console=Console(file=out, width=150), **kw)
    d = report.to_dict()
    d["printed"] = out.getvalue()
    return d


def verify_cases(cases: list[tuple[list[str], dict]]) -> list[dict]:
    """Several verifications in one distributed call (the pool spawns once per world)."""
    return [_verify(overrides, **kw) for overrides, kw in cases]


def _drop_one_halo_column(original):
    """A halo exchange that zeroes the first column received from a neighbour."""

    def broken(local, plan, rank, group, pad_lo=0, pad_hi=0, value=0.0):
        out = original(local, plan, rank, group, pad_lo, pad_hi, value)
        offset = pad_lo
        for owner, s, e in plan.pieces(rank):
            if owner != rank:
                keep = torch.ones(out.shape[-1], dtype=out.dtype)
                keep[offset] = 0
                return out * keep
            offset += e - s
        return out

    return broken


def _zero_first_received_column(original):
    """The split halo convolution's exchange (``post_p2p``): the first column received
    from a neighbour is zeroed once it has arrived."""

    def broken(group, sends, recvs, stats):
        pending = original(group, sends, recvs, stats)
        if recvs:
            wait = pending.wait

            def wait_and_break() -> None:
                wait()
                recvs[0][1][..., 0] = 0

            pending.wait = wait_and_break
        return pending

    return broken


@contextlib.contextmanager
def broken_halo():
    """Every halo path drops one received column: the window exchange (pools, transposed
    and non-zero-padded convs) and the split convolution's exchange."""
    import spconv_train.parallel._halo_conv as halo_conv
    import spconv_train.parallel._window as window

    originals = window.gather_columns, halo_conv.post_p2p
    window.gather_columns = _drop_one_halo_column(originals[0])
    halo_conv.post_p2p = _zero_first_received_column(originals[1])
    try:
        yield
    finally:
        window.gather_columns, halo_conv.post_p2p = originals


def verify_with_broken_halo(overrides: list[str]) -> dict:
    with broken_halo():
        return _verify(overrides, steps=1)


def _failed(report: dict) -> str:
    return report["verdict"] + "\n" + "\n".join(str(f) for f in report["failures"][:10])


# --- tests ----------------------------------------------------------------------------------


def test_unet_two_ranks_every_precision(dist_pool):
    cases = [
        (TINY, {"steps": 2}),  # float64: the exact check
        (TINY, {"steps": 1, "dtype": "config"}),  # fp32
        (
            TINY + ["training.precision=bf16", "training.loss=ce+dice"],
            {"steps": 1, "dtype": "config"},
        ),
        (TINY + ["optimizer.name=sgd", "training.class_weights=[1.0, 2.0, 0.5]"], {"steps": 1}),
        (TINY, {"steps": 2, "resync": False}),  # two independent runs
    ]
    reports = dist_pool.run(2, verify_cases, cases)
    for a, b in zip(*reports, strict=True):  # the same report on every rank
        assert a["checks"] == b["checks"] and a["verdict"] == b["verdict"]
    for report, (_, kw) in zip(reports[0], cases, strict=True):
        assert report["passed"], _failed(report)
        assert report["mesh"] == {"dp": 1, "sp": 2}
        kinds = {c["kind"] for c in report["checks"]}
        assert kinds == {"input", "loss", "logits", "grad", "param", "buffer"}
        assert len({c["step"] for c in report["checks"]}) == kw["steps"]
        comms = report["comms"][0]["max_per_rank"]
        assert comms["p2p"]["count"] > 0 and comms["reduce"]["count"] > 0
        assert "gather" not in comms and not report["activation_sized_collectives"]
        assert "PASS" in report["printed"] and "max rel err" in report["printed"]
        assert len(report["memory"]) == 2 and report["memory"][1]["sharded_mb"] > 0
    assert [r["precision"] for r in reports[0]] == ["fp64", "fp32", "bf16", "fp64", "fp64"]
    assert "each step starts both runs from the same state" in " ".join(reports[0][0]["notes"])
    assert "two independent runs" in " ".join(reports[0][4]["notes"])
    # float64 leaves only rounding: far below the tolerance.
    assert max(c["max_rel_err"] for c in reports[0][0]["checks"]) < 1e-11


def test_unet_three_ranks_data_parallel_and_reference_on_rank0(dist_pool):
    cases = [
        (TINY + ["data.width=67"], {"steps": 2}),  # strips 23, 23, 21
        (TINY + ["data.width=67"], {"steps": 1, "reference": "rank0"}),
        # sp=1: three data-parallel replicas, each with its own image of the global batch
        (TINY + ["parallel.sp=1"], {"steps": 2, "reference": "rank0"}),
    ]
    reports = dist_pool.run(3, verify_cases, cases)[0]
    for report in reports:
        assert report["passed"], _failed(report)
    assert [r["mesh"] for r in reports] == [{"dp": 1, "sp": 3}] * 2 + [{"dp": 3, "sp": 1}]
    assert reports[2]["batch_shape"] == [3, 3, 32, 64]
    assert reports[1]["memory"][1]["reference_mb"] is None  # rank 1 ran no reference
    # Both ways compare the same tensors.
    first = [c["name"] for c in reports[0]["checks"] if c["step"] == 1]
    assert first == [c["name"] for c in reports[1]["checks"]]


def test_lraspp_mobilenet_two_ranks(dist_pool):
    overrides = [
        "model.name=lraspp_mobilenet_v3_large",
        "model.num_classes=3",
        "data.height=32",
        "data.width=160",
        "data.num_train=2",
        "data.num_val=1",
    ]
    report = dist_pool.run(2, verify_cases, [(overrides, {"steps": 2})])[0][0]
    assert report["passed"], _failed(report)


def test_broken_halo_fails(dist_pool):
    """A halo exchange that silently drops one column must not pass."""
    report = dist_pool.run(2, verify_with_broken_halo, TINY)[0]
    assert not report["passed"]
    assert report["verdict"].startswith("FAIL")
    failed = {(f["step"], f["kind"]) for f in report["failures"]}
    assert (1, "logits") in failed and (1, "grad") in failed
    assert "FAIL" in report["printed"]


# --- the command line -----------------------------------------------------------------------


@job("verify_torchrun")
def _verify_torchrun_job(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m spconv_train verify CONFIG --nproc 2`` (it re-launches itself through
    torchrun); its result and report file."""
    config = folder / "tiny.yaml"
    config.write_text(TINY_YAML, encoding="utf-8")
    report_path = folder / "report.json"
    args = ["verify", str(config), "--nproc", "2", "--steps", "1", "--json", str(report_path)]
    return launch([sys.executable, "-m", "spconv_train", *args]), report_path


@pytest.mark.job("verify_torchrun")
def test_verify_command_through_torchrun(background_jobs):
    """``spconv-train verify CONFIG --nproc 2`` re-launches itself through torchrun (a
    process in the background: ``_verify_torchrun_job``)."""
    proc, report_path = background_jobs.result("verify_torchrun")
    out, err = proc.stdout, proc.stderr  # the workers write to the command's stdout / stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "PASS" in out
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["world_size"] == 2 and report["steps"] == 1
    assert report["mesh"] == {"dp": 1, "sp": 2}


def test_verify_cli_exit_codes(tmp_path):
    from spconv_train.cli import app

    runner = CliRunner()
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_YAML, encoding="utf-8")
    result = runner.invoke(app, ["verify", "--help"])
    assert result.exit_code == 0
    for word in ("CONFIG", "--steps", "--nproc", "--json", "--rtol", "--atol", "--dtype"):
        assert word in result.output
    bad = runner.invoke(app, ["verify", str(config), "--set", "training.stepz=3", "--nproc", "1"])
    assert bad.exit_code == 2
    # One rank in this process; zero tolerance in fp32: rounding alone fails it -> exit 1.
    out = tmp_path / "r.json"
    args = ["verify", str(config), "--nproc", "1", "--steps", "1", "--dtype", "config"]
    failed = runner.invoke(app, [*args, "--rtol", "0", "--json", str(out)])
    assert failed.exit_code == 1, failed.output
    assert json.loads(out.read_text())["passed"] is False
    passed = runner.invoke(app, [*args, "--json", str(out)])
    assert passed.exit_code == 0, passed.output


# --- pieces ---------------------------------------------------------------------------------


def test_relative_error_uses_a_floor_per_kind():
    tols = resolve_tolerances("fp32")
    col = Collector(1, tols, floors("fp32"))
    f64 = dict(dtype=torch.float64)
    col.add(
        "grad", "big", torch.tensor([1.0, -2.0 + 1e-5], **f64), torch.tensor([1.0, -2.0], **f64)
    )
    # A mathematically-zero gradient: both sides hold rounding noise only.
    col.add("grad", "zero", torch.tensor([3e-12], **f64), torch.tensor([-1e-12], **f64))
    col.add("grad", "shape", torch.zeros(2), torch.zeros(3))
    big, zero, shape = col.reduce(torch.device("cpu"))
    assert big.rel_err == pytest.approx(1e-5 / 2.0) and big.passed
    assert zero.scale == pytest.approx(2e-6) and zero.rel_err == pytest.approx(2e-6) and zero.passed
    assert not shape.passed and "shape" in shape.note
    nan = Check(1, "loss", "loss", math.nan, 1.0, 1.0, 1e-4, 1.0)
    assert not nan.passed
    assert resolve_tolerances("bf16")["grad"] == (1e-1, 0.0)
    assert resolve_tolerances("fp64", {"rtol": 1e-3, "logits": {"atol": 0.5}})["logits"] == (
        1e-3,
        0.5,
    )
    with pytest.raises(ValueError):
        resolve_tolerances("fp32", {"rtool": 1})


def test_activation_sized_collective_fails_the_report():
    check = Check(1, "loss", "loss", 0.0, 1.0, 1.0, 1e-4, 0.0)
    kw = dict(steps=1, world_size=2, dp=1, sp=2, model="m", precision="fp32", batch_shape=(1,))
    kw.update(reference="all", tolerances=resolve_tolerances("fp32"))
    assert VerifyReport([check], **kw).passed
    flagged = VerifyReport(
        [check], flagged=["step 1 rank 0: all_gather of shape (1, 8, 32, 64)"], **kw
    )
    assert not flagged.passed and "activation-sized" in flagged.verdict()
    assert not VerifyReport([], **kw).passed
