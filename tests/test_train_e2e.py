"""End to end: ``spconv-train run`` under a real torchrun with 2 CPU ranks (gloo).

A tiny U-Net (depth 2, width 4) on 32x64 images trains 8 steps (the shared uninterrupted
run of ``tests/conftest.py``); the run's artifacts are checked (exit code, checkpoints,
metrics.jsonl, TensorBoard events, the exported model), and a run that crashed and was
restarted by torchrun must end with exactly the same parameters (a run stopped by SIGTERM and
resumed: tests/test_faults_e2e.py; a finished run resumed with more steps:
tests/test_resume_config.py). Also (real ``train()`` on the shared worker groups, no
process start-up): activation checkpointing and compile change nothing, a folder dataset
of PNG files trains data-parallel in bf16; and a bad config exits 2, an image too narrow
for the network exits 2 under torchrun, a diverging run exits 1.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from spconv_train.checkpoint import FORMAT_VERSION
from spconv_train.cli import app
from spconv_train.models import create_model
from tests.background_jobs import job
from tests.conftest import REFERENCE, REFERENCE_STEPS
from tests.dist_harness import train_on_group
from tests.processes import hook_env, torchrun

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

TINY = """\
run_dir: {run_dir}
model:
  name: unet
  num_classes: 3
  kwargs: {{depth: 2, base_width: 4}}
data: {{height: 32, width: 64, num_train: 4, num_val: 2, hflip: 0.5}}
optimizer: {{name: adamw, lr: 3.0e-3}}
# constant after warm-up: the lr of a step must not depend on training.steps, so that a run
# of 2 steps resumed to 4 can equal a run of 4 steps
schedule: {{name: constant, warmup_steps: 3}}
training: {{steps: 4, val_every: 2, log_every: 1}}
checkpoint: {{every: 2, keep_last: 2}}
logging: {{num_val_images: 1, image_downsample: 2, progress: false}}
"""


# --- pieces of the loop, in-process ---------------------------------------------------------


def test_lr_schedule():
    from spconv_train.config import ScheduleConfig
    from spconv_train.train.optim import lr_factor

    def f(step, **kw):
        return lr_factor(step, ScheduleConfig(**kw), total_steps=20, peak_lr=1.0)

    assert [f(s, warmup_steps=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, warmup_steps=4) == 1.0  # decay starts at the peak
    assert f(19, warmup_steps=4, min_lr=0.1) == pytest.approx(0.1)  # cosine ends at min_lr
    assert f(19, warmup_steps=4, name="poly") == pytest.approx(0.0)
    assert f(11, warmup_steps=0, name="poly", power=1.0) == pytest.approx(1 - 11 / 19)
    assert f(19, warmup_steps=2, name="constant") == 1.0


def test_activation_checkpointing_is_exact_on_one_device():
    """Same parameters, gradients and BatchNorm running statistics (updated once, not twice
    by the recomputation) after two steps."""
    from spconv_train.train.optim import checkpoint_blocks, enable_activation_checkpointing

    torch.manual_seed(0)
    ref = create_model("unet", num_classes=3, in_channels=3, depth=3, base_width=4)
    ac = create_model("unet", num_classes=3, in_channels=3, depth=3, base_width=4)
    ac.load_state_dict(ref.state_dict())
    blocks = enable_activation_checkpointing(ac)
    assert blocks == checkpoint_blocks(ac) and len(blocks) == 5  # inc, 2 downs, 2 ups
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ac)]
    for step in range(2):
        x = torch.rand(2, 3, 16, 24, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((ref, ac), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(ref.state_dict().items(), ac.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():  # evaluation runs the blocks directly
        x = torch.rand(1, 3, 16, 24)
        assert torch.equal(ref.eval()(x), ac.eval()(x))


@pytest.mark.parametrize("width", [37, 64])
@pytest.mark.parametrize("factor", [1, 2, 3, 4])
def test_downsampled_strips_stitch_to_the_downsampled_image(width, factor):
    from spconv_train.data import strip_bounds
    from spconv_train.train.val_items import downsample_strip

    full = torch.rand(3, 10, width)
    for parts in (1, 2, 3, 4):
        strips = []
        for rank in range(parts):
            a, b = strip_bounds(width, parts, rank)
            strips.append(downsample_strip(full[..., a:b], a, factor))
        assert torch.equal(torch.cat(strips, dim=-1), full[..., ::factor, ::factor])


# --- torchrun runs --------------------------------------------------------------------------


def tiny_config(folder: Path, name: str = "run") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(TINY.format(run_dir=folder / name), encoding="utf-8")
    return path


def plain(*args: object) -> subprocess.CompletedProcess:
    """``spconv-train run ARGS`` on one rank, in this process (no interpreter to start): the
    exit code, and the console output as both stdout and stderr, with the warnings and an
    uncaught exception's traceback (as a process would print them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["run", *map(str, args)], env={"COLUMNS": "200"})
    out = result.output + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        out += "Traceback (most recent call last):\n" + "".join(
            traceback.format_exception(result.exception)
        )
    return subprocess.CompletedProcess(["spconv-train", "run", *args], result.exit_code, out, out)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


# The tests below check the shared uninterrupted run (``uninterrupted_run``, tests/conftest.py:
# the tiny config stretched to REFERENCE_STEPS = 8 steps, validation and a checkpoint every
# 2 steps, keep_last 2) and compare other runs with it.
EVERY_2 = list(range(2, REFERENCE_STEPS + 1, 2))
ALL_STEPS = list(range(1, REFERENCE_STEPS + 1))


def test_run_leaves_checkpoints_config_and_metrics(uninterrupted_run):
    ckpt = uninterrupted_run / "checkpoints"
    best = (ckpt / "best").read_text().strip()
    assert best in {f"step-{s:06d}" for s in EVERY_2}
    kept = {"step-000006", "step-000008", best}  # keep_last 2, and the best one
    assert sorted(p.name for p in ckpt.glob("step-*")) == sorted(kept)
    assert (ckpt / "latest").read_text().strip() == "step-000008"
    for step in ckpt.glob("step-*"):
        meta = json.loads((step / "meta.json").read_text())  # manifest: files, data position
        assert set(meta["files"]) == {p.name for p in step.iterdir()} - {"meta.json"}
        assert meta["shared"]["data"]["epoch"] >= 0 and meta["format"] == FORMAT_VERSION
    from spconv_train.config import load_config

    assert load_config(uninterrupted_run / "config.yaml").training.steps == REFERENCE_STEPS
    lines = read_metrics(uninterrupted_run)
    train = [m for m in lines if m["split"] == "train"]
    val = [m for m in lines if m["split"] == "val"]
    assert [m["step"] for m in train] == ALL_STEPS
    assert [m["step"] for m in val] == EVERY_2
    for m in train:
        assert math.isfinite(m["loss"]) and m["throughput_mpx_s"] > 0 and m["lr"] > 0
        assert m["halo_s_per_step"] > 0  # two spatial ranks exchange halos
    for m in val:
        assert 0 <= m["miou"] <= 1 and 0 <= m["pixel_accuracy"] <= 1 and 0 <= m["mean_dice"] <= 1
    memory = [m for m in lines if m["split"] == "memory"]
    assert memory and all(m["peak_mb_rank0"] > 0 and m["peak_mb_rank1"] > 0 for m in memory)
    assert {m["split"] for m in lines} >= {"val_iou", "val_dice"}


def test_tensorboard_events(uninterrupted_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((uninterrupted_run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(uninterrupted_run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/throughput_mpx_s",
        "train/halo_s_per_step",
        "memory/peak_mb_max",
        "val/miou",
        "val/pixel_accuracy",
        "val/mean_dice",
        "val/loss",
    ):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == ALL_STEPS
    assert [e.step for e in acc.Scalars("val/miou")] == EVERY_2
    assert "val/panel_0" in tags["images"]
    panel = acc.Images("val/panel_0")[-1]
    # input | prediction | label, each downsampled by 2 from 32x64, 2-pixel gaps
    assert (panel.height, panel.width) == (16, 3 * 32 + 2 * 2)


def test_export_loads_into_the_plain_model(uninterrupted_run):
    model = create_model("unet", num_classes=3, in_channels=3, depth=2, base_width=4)
    model.load_state_dict(exported(uninterrupted_run))  # strict: the plain parameter names
    with torch.no_grad():
        assert model.eval()(torch.rand(1, 3, 32, 64)).shape == (1, 3, 32, 64)


INJECT = """\
import os
# Test hook: on the first attempt only, rank 1 bit-flips the step-2 checkpoint and crashes in
# the middle of step 3.
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    from pathlib import Path

    import spconv_train.train.step as step_module

    calls, clip = [0], step_module.clip_gradients

    def failing_clip(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            folder = Path({run_dir!r}) / "checkpoints" / "step-000002"
            bad = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
            data = bytearray(bad.read_bytes())
            data[len(data) // 2] ^= 0x10
            bad.write_bytes(bytes(data))
            raise RuntimeError("injected failure on rank 1")
        return clip(*args, **kwargs)

    step_module.clip_gradients = failing_clip
"""


@job("torchrun_restart")
def _restart_job(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """The job of ``test_torchrun_restart_resumes_automatically``, over an older run."""
    run_dir = folder / "run"
    stale = run_dir / "checkpoints" / "step-000009"  # an older run, overwritten
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text('{"step": 9}')
    every_1 = ("--set", "checkpoint.every=1")
    env = hook_env(folder, INJECT.format(run_dir=str(run_dir)))
    config = tiny_config(folder)
    return torchrun(config, "--overwrite", *REFERENCE, *every_1, restarts=1, env=env), folder


@pytest.mark.job("torchrun_restart")
def test_torchrun_restart_resumes_automatically(uninterrupted_run, background_jobs):
    """One rank crashes in step 3, after bit-flipping the step-2 checkpoint: the other exits
    instead of hanging, torchrun restarts both, and the run resumes on its own
    (checkpoint.resume=auto) from the newest good checkpoint (step 1: the checksum of step 2
    fails) and ends exactly like the uninterrupted run; the first attempt's --overwrite is
    not repeated by the restart (the job: ``_restart_job``, run in the background)."""
    proc, folder = background_jobs.result("torchrun_restart")
    ok(proc)
    run_dir = folder / "run"
    stale = run_dir / "checkpoints" / "step-000009"
    out = proc.stdout + proc.stderr
    assert "injected failure on rank 1" in out
    # The restart resumes what attempt 0 wrote: --overwrite is not applied a second time.
    assert "torchrun restart 1: resuming" in out and "resumed from" in out
    assert not stale.exists()
    # The bit-flipped step 2 is detected, set aside and skipped
    assert "checksum mismatch" in out and "step-000002 is unusable" in out
    flat = "".join(proc.stdout.split())  # the console wraps long lines
    assert re.search(r"resumedfrom[^;]*step-000001;", flat), proc.stdout[-3000:]
    assert (run_dir / "checkpoints" / "corrupt-step-000002").is_dir()
    want, got = exported(uninterrupted_run), exported(run_dir)
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_activation_checkpointing_and_compile_change_nothing(
    dist_pool, uninterrupted_run, tmp_path
):
    """One run with both (as ``prepare_model`` stacks them: checkpointed blocks, then
    compiled; tests/test_activation_checkpointing.py and tests/test_compile.py check each
    alone at the module level) ends with the parameters of the plain run. Real ``train()``
    on the shared 2-rank worker group (what ``spconv-train run`` runs on every rank)."""
    sets = [f"training.steps={REFERENCE_STEPS}", "training.activation_checkpointing=true"]
    sets += ["training.compile=true"]
    sets += ["training.compile_backend=eager"]
    dist_pool.run(2, train_on_group, str(tiny_config(tmp_path)), sets)
    want, got = exported(uninterrupted_run), exported(tmp_path / "run")
    assert want.keys() == got.keys()  # compiled in place: the same state_dict keys
    for key in want:
        # Not bit for bit: recomputation changes the order in which autograd sums gradient
        # contributions of the halo exchange (one process is bit for bit identical).
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_folder_dataset_data_parallel_bf16(dist_pool, tmp_path):
    """A folder of PNG files trains data-parallel (2 ranks, ``parallel.sp=1``) in bf16, on
    the shared worker group."""
    data = tmp_path / "data"
    args = ["--num-train", "4", "--num-val", "3", "--height", "32", "--width", "64"]
    made = CliRunner().invoke(app, ["make-data", str(data), *args, "--classes", "3"])
    assert made.exit_code == 0, made.output
    sets = ["data.source=folder", f"data.root={data}", "parallel.sp=1"]
    sets += ["training.precision=bf16", "training.loss=ce+dice", "optimizer.name=sgd"]
    sets += ["schedule.name=poly", "data.scale=[0.8, 1.25]"]
    out = dist_pool.run(2, train_on_group, str(tiny_config(tmp_path)), sets)[0]
    assert "mesh dp=2 x sp=1" in out, out  # rank 0's console
    val = [m for m in read_metrics(tmp_path / "run") if m["split"] == "val"]
    assert [m["step"] for m in val] == [2, 4] and all(math.isfinite(m["loss"]) for m in val)
    assert len(exported(tmp_path / "run")) > 0


def test_bad_config_exits_2_before_starting(tmp_path):
    config = tiny_config(tmp_path)
    proc = plain(config, "--set", "optimizer.lrr=1")
    assert proc.returncode == 2
    assert "optimizer.lrr: unknown key; did you mean 'lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@job("too_narrow")
def _too_narrow_job(folder: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """3 columns over 2 ranks pass the config check (strips of 2 and 1) but the first
    max-pool leaves one output column: rank 1 would get none."""
    config = tiny_config(folder)
    return torchrun(config, "--set", "data.width=3", "--set", "parallel.sp=2"), folder


@pytest.mark.job("too_narrow")
def test_image_too_narrow_for_the_network_exits_2_naming_the_layer(background_jobs):
    # Found at the first forward, on every rank together; torchrun itself then exits 1.
    proc, folder = background_jobs.result("too_narrow")
    assert proc.returncode != 0
    assert "exitcode  : 2" in proc.stderr
    assert "downs.0.0 (MaxPool2d" in proc.stderr and "parallel.sp" in proc.stderr
    assert not (folder / "run" / "checkpoints").exists()


def test_non_finite_loss_stops_with_exit_1_and_no_new_checkpoint(tmp_path):
    proc = plain(
        tiny_config(tmp_path),
        *("--set", "optimizer.name=sgd", "--set", "optimizer.lr=1e30"),
        *("--set", "optimizer.grad_clip=0", "--set", "model.kwargs.norm=none"),
        *("--set", "checkpoint.every=1", "--set", "schedule.warmup_steps=0"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "non-finite loss" in proc.stderr and "Traceback" not in proc.stderr
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-000001"  # the last finite state
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000001"]
