"""The train loss logged after a restart equals the uninterrupted run's (issue 21, item 7).

The logged train loss is the mean over the steps since the previous log line. A run that
crashed after the checkpoint of step 2 and resumed logged, at step 4 (``log_every: 4``),
the mean of steps 3 and 4 only. The open window (its loss sum and step count) is now kept
in the checkpoint's JSON state, so the resumed run logs the same mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4}}}}
data: {{source: synthetic, height: 32, width: 64, num_train: 4, num_val: 1}}
training: {{steps: 4, val_every: 4, log_every: 4}}
checkpoint: {{every: 2}}
logging: {{tensorboard: false, progress: false}}
"""


def _run(tmp_path: Path, name: str, *args: str) -> tuple[int, str, Path]:
    from typer.testing import CliRunner

    from spconv_train.cli import app

    run_dir = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config), *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output, run_dir


def _train_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


def test_logged_train_loss_after_a_restart_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    import spconv_train.train.loop as loop

    code, out, whole = _run(tmp_path, "whole")
    assert code == 0, out[-3000:]
    want = _train_losses(whole)
    assert list(want) == [4]

    original = loop.train_step

    def crash_at_step_3(*args, step, **kwargs):
        if step == 2:  # 0-based: after the checkpoint of step 2
            raise RuntimeError("simulated crash")
        return original(*args, step=step, **kwargs)

    monkeypatch.setattr(loop, "train_step", crash_at_step_3)
    code, out, crashed = _run(tmp_path, "crashed")
    assert code != 0 and (crashed / "checkpoints" / "step-000002").is_dir(), out[-3000:]
    monkeypatch.setattr(loop, "train_step", original)
    code, out, crashed = _run(tmp_path, "crashed", "--resume")
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    assert _train_losses(crashed) == want  # the mean over steps 1-4, bit for bit
