"""End to end on gigapixel-style data: a TIFF folder dataset with percentile normalisation,
and the console ``loss=`` equal to the window mean that ``metrics.jsonl`` records."""

from __future__ import annotations

import re
import sys

from spconv_train.data import write_synthetic_dataset
from tests.test_train_e2e import launch, ok, read_metrics


def test_console_loss_is_the_logged_window_mean(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    write_synthetic_dataset(
        data, num_train=2, num_val=1, height=32, width=64, num_classes=4, fmt="tif"
    )
    sets = {
        "data.root": data,
        "run_dir": run,
        "training.steps": 4,
        "training.log_every": 2,
        "training.val_every": 4,
        "checkpoint.every": 4,
        "data.height": 32,
        "data.width": 48,
        "data.normalize.mode": "percentile",
        "logging.progress": "false",
        "logging.tensorboard": "false",
        "model.kwargs.base_width": 4,
        "model.kwargs.depth": 2,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = ok(launch([sys.executable, "-m", "spconv_train", "run", "configs/folder.yaml", *args]))
    printed = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"step (\d+)/4\s+loss=([0-9.e+-]+)", proc.stdout + proc.stderr)
    }
    logged = {r["step"]: r["loss"] for r in read_metrics(run) if r.get("split") == "train"}
    assert set(logged) == {2, 4} and set(printed) >= {2, 4}, (printed, logged)
    for step in (2, 4):  # the console shows 4 significant digits
        assert abs(printed[step] - logged[step]) <= 5e-4 * max(1.0, abs(logged[step]))
    assert (run / "data_cache.json").is_file()
