"""RunLogger writes real TensorBoard events and metrics.jsonl on rank 0 only; rich tables
name the classes; overlay panels have the documented shape."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from spconv_train.logging import RunLogger, class_colors, overlay_panel


def recording_console() -> Console:
    return Console(record=True, file=io.StringIO(), width=120, force_terminal=False)


def read_events(logdir) -> EventAccumulator:
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    return ea


def test_tensorboard_and_jsonl(tmp_path):
    console = recording_console()
    with RunLogger(tmp_path, enabled=True, total_steps=4, console=console) as log:
        for step in range(1, 5):
            log.scalars(step, {"loss": 1.0 / step, "lr": torch.tensor(0.1 * step)})
        log.scalars(4, {"mIoU": 0.25, "acc": float("nan")}, prefix="val")
        log.images(4, "val/panel_0", torch.rand(3, 8, 20))
        log.text(4, "config", "model: unet")
        log.hparams({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 0}, {"mIoU": 0.25})
    ea = read_events(tmp_path / "tensorboard")
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert [e.value for e in ea.Scalars("train/lr")] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert ea.Scalars("val/mIoU")[0].value == pytest.approx(0.25)
    (img,) = ea.Images("val/panel_0")
    assert (img.step, img.width, img.height) == (4, 20, 8)
    assert "config/text_summary" in ea.Tags()["tensors"]
    assert (tmp_path / "tensorboard" / "hparams").is_dir()

    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "split": "train", "loss": 1.0, "lr": pytest.approx(0.1)}
    assert lines[-1] == {"step": 4, "split": "val", "mIoU": 0.25, "acc": None}  # strict JSON
    assert len(lines) == 5


def test_resume_drops_later_lines(tmp_path):
    with RunLogger(tmp_path, enabled=True, tensorboard=False, console=recording_console()) as log:
        for step in range(1, 6):
            log.scalars(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "spl')  # a torn line from a killed run
    with RunLogger(
        tmp_path, enabled=True, tensorboard=False, resume_step=3, console=recording_console()
    ) as log:
        log.scalars(4, {"loss": 40.0})
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_disabled_rank_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    log = RunLogger(run_dir, enabled=False, total_steps=3)
    log.progress_start(3)
    log.scalars(1, {"loss": 1.0})
    log.images(1, "x", torch.rand(3, 4, 4))
    log.text(1, "t", "hello")
    log.hparams({"a": 1}, {"m": 1.0})
    log.progress_update(1, loss=1.0)
    log.summary("Run", {"steps": 3})
    log.per_class_table(["a"], [0.5], [0.5], [0.5])
    log.info("hello")
    log.flush()
    log.progress_stop()
    log.close()
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_tables_and_plain_progress(tmp_path):
    console = recording_console()
    log = RunLogger(tmp_path, enabled=True, tensorboard=False, console=console, log_every=2)
    log.progress_start(total=5)  # not a terminal: plain lines every 2 steps and at the end
    for step in range(1, 6):
        log.progress_update(step, loss=1.0 / step)
    log.progress_stop()
    names = ["background", "disc", "stripes"]
    log.per_class_table(names, [0.9, 0.5, math.nan], [0.95, 0.6, math.nan], [0.97, 0.4, math.nan])
    log.summary("Final", [("mIoU", "0.700"), ("steps", 5)])
    log.close()
    text = console.export_text()
    assert [ln.split()[1] for ln in text.splitlines() if ln.startswith("step ")] == [
        "2/5",
        "4/5",
        "5/5",
    ]
    for word in names + ["IoU", "Dice", "mean (macro)", "0.7", "Final", "mIoU", "0.700"]:
        assert word in text, word
    assert "—" in text  # the absent class


def test_rich_progress_bar_on_a_terminal(tmp_path):
    console = Console(record=True, file=io.StringIO(), width=100, force_terminal=True)
    with RunLogger(tmp_path, enabled=True, tensorboard=False, console=console) as log:
        log.progress_start(total=4, initial=1)
        assert log._progress is not None
        for step in range(2, 5):
            log.progress_update(step, loss=0.5)
    assert "4/4" in console.export_text()


def test_overlay_panel():
    torch.manual_seed(0)
    h, w, k = 37, 50, 4
    image = torch.rand(3, h, w)
    pred = torch.randint(0, k, (h, w))
    target = torch.randint(0, k, (h, w))
    target[:, :10] = 255
    panel = overlay_panel(image, pred, target, k, downsample=4)
    assert panel.dtype == torch.uint8 and panel.shape == (3, 10, 3 * 13 + 4)
    left, label = panel[:, :, :13], panel[:, :, 13 + 2 + 13 + 2 :]
    # ignored columns keep the image, labelled columns are tinted
    assert torch.equal(label[:, :, :2], left[:, :, :2])
    assert not torch.equal(label[:, :, 3:], left[:, :, 3:])
    # grey normalised input, logits as prediction, no downsampling
    grey = torch.randn(1, h, w) * 3
    logits = torch.randn(k, h, w)
    panel = overlay_panel(grey, logits, target, k, downsample=1)
    assert panel.shape == (3, h, 3 * w + 4) and panel.dtype == torch.uint8
    assert len(set(class_colors(25))) == 25
