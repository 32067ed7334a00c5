"""End to end on gigapixel-style data: a TIFF folder dataset with percentile normalisation,
and the console: the ``loss=`` equal to the window mean that ``metrics.jsonl`` records,
seconds per step and an ETA on progress lines, one line per validation with every class's
IoU, and the summary's best step and whole paths (one short 1-process run shared, the
command run in this process)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.data import write_synthetic_dataset
from tests.processes import REPO
from tests.test_train_e2e import read_metrics

# torchrun's error recorder around the command cannot register faulthandler on the
# in-process runner's captured output (no file descriptor); nothing to see there
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@pytest.fixture(scope="module")
def console_run(tmp_path_factory):
    """``(run folder, printed text)`` of a 4-step run validating at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("console")
    # a deep folder: the summary's paths are longer than any console width
    data, run = tmp / "data", tmp / ("a_rather_long_folder_name_" * 4) / "run"
    write_synthetic_dataset(
        data, num_train=2, num_val=1, height=32, width=64, num_classes=4, fmt="tif"
    )
    sets = {
        "data.root": data,
        "run_dir": run,
        "training.steps": 4,
        "training.log_every": 2,
        "training.val_every": 2,
        "checkpoint.every": 2,
        "data.height": 32,
        "data.width": 48,
        "data.normalize.mode": "percentile",
        "logging.progress": "false",
        "logging.tensorboard": "false",
        "model.kwargs.base_width": 4,
        "model.kwargs.depth": 2,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    # the command in this process (no interpreter to start), on an 80-column console as a
    # process writing to a pipe gets
    config = str(REPO / "configs" / "folder.yaml")
    result = CliRunner().invoke(app, ["run", config, *args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return run, result.output


def test_console_loss_is_the_logged_window_mean(console_run):
    run, text = console_run
    printed = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"step (\d+)/4\s+loss=([0-9.e+-]+)", text)
    }
    logged = {r["step"]: r["loss"] for r in read_metrics(run) if r.get("split") == "train"}
    assert set(logged) == {2, 4} and set(printed) >= {2, 4}, (printed, logged)
    for step in (2, 4):  # the console shows 4 significant digits
        assert abs(printed[step] - logged[step]) <= 5e-4 * max(1.0, abs(logged[step]))
    assert (run / "data_cache.json").is_file()


def test_progress_lines_show_seconds_per_step_and_eta(console_run):
    _, text = console_run
    lines = re.findall(
        r"^step (\d+)/4 .* ([0-9.e+-]+) s/step  ETA (\d+):(\d\d):(\d\d)$", text, re.M
    )
    assert {int(m[0]) for m in lines} >= {2, 4}, text
    for step, per_step, h, m, s in lines:
        assert float(per_step) > 0
        eta = int(h) * 3600 + int(m) * 60 + int(s)
        assert abs(eta - float(per_step) * (4 - int(step))) <= 1  # the pace over steps left


def test_every_validation_prints_its_per_class_iou(console_run):
    run, text = console_run
    logged = {r["step"]: r for r in read_metrics(run) if r.get("split") == "val_iou"}
    assert set(logged) == {2, 4}
    for step, record in logged.items():
        found = re.findall(rf"^val step {step}: loss=\S+  mIoU=\S+ .*\| IoU (.*)$", text, re.M)
        assert len(found) == 1, text
        printed = dict(item.split("=") for item in found[0].split("  "))
        names = [k for k in record if k not in ("step", "split")]
        assert list(printed) == names  # every class by name, in class order
        for name in names:
            if record[name] is None:  # NaN (class absent) is shown as —
                assert printed[name] == "—"
            else:
                assert float(printed[name]) == pytest.approx(record[name], rel=5e-4, abs=1e-4)


def test_summary_names_the_best_step_and_whole_paths(console_run):
    run, text = console_run
    best = (run / "checkpoints" / "best").read_text().strip()
    step = int(best.split("-")[1])
    assert re.search(rf"^best step: {step} \(val mIoU [0-9.]+\)$", text, re.M), text
    lines = dict(re.findall(r"^(best checkpoint|run folder|exported model): (.*)$", text, re.M))
    assert lines["best checkpoint"] == str((run / "checkpoints" / best).resolve())
    assert lines["run folder"] == str(run.resolve())
    assert lines["exported model"] == str((run / "model.pt").resolve())
    assert len(lines["best checkpoint"]) > 120  # longer than a console line, still whole
