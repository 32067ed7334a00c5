"""The ``spconv-train`` command line: help, show-config, config errors, run-dir rules,
make-data. Everything here fails (or finishes) before any process group exists, so it runs
in-process with Typer's ``CliRunner``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spconv_train.cli import RUN_FILES, app, plan_start
from spconv_train.config import ConfigError, config_to_dict, load_config
from spconv_train.logging.run_folder import JOB_FILE, JobRecord, write_job

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

REPO = Path(__file__).resolve().parents[1]
UNET = REPO / "configs" / "unet.yaml"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, expect",
    [
        ((), ["run", "show-config", "make-data", "verify", "predict"]),
        (("run",), ["CONFIG", "--set", "--resume", "--overwrite", "torchrun", "Exit codes"]),
        (("show-config",), ["CONFIG", "--set", "--world-size"]),
        (("make-data",), ["OUT", "--num-train", "--num-val", "--height", "--width", "--classes"]),
    ],
    ids=["app", "run", "show-config", "make-data"],
)
def test_help(command, expect):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    for word in expect:
        assert word in result.output, (word, result.output)


def test_python_dash_m_entry_point():
    """``python -m spconv_train --help`` works, and the command line starts without the
    parallel layer (DTensor, Dynamo: seconds of CPU in every process that never builds a
    model), as ``-X importtime`` of the same process shows."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spconv_train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "show-config" in out.stdout and "Usage: spconv-train" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    for heavy in ("spconv_train.parallel", "torch._dynamo", "torch.distributed.tensor"):
        assert heavy not in imported, f"spconv-train --help imports {heavy}"


def test_no_arguments_shows_help_with_usage_exit_code():
    result = invoke()
    assert result.exit_code == 2
    assert "Usage" in result.output


def test_placeholders_exit_1_with_a_message():
    for name in ("verify", "predict"):
        try:
            if hasattr(importlib.import_module(f"spconv_train.{name}"), "register"):
                continue  # the real command exists: its own tests cover it
        except ModuleNotFoundError:
            pass
        result = invoke(name, "anything", "--x")
        assert result.exit_code == 1
        assert "not available" in result.output


# --- show-config ---------------------------------------------------------------------------


def test_show_config_prints_the_resolved_config(tmp_path):
    result = invoke("show-config", UNET, "--set", "training.steps=7", "-s", "optimizer.lr=1e-2")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    want = load_config(UNET, ["training.steps=7", "optimizer.lr=1e-2"])
    assert shown == config_to_dict(want)
    assert shown["training"]["steps"] == 7 and shown["optimizer"]["lr"] == 0.01
    # The printed YAML is itself a valid config giving the same result.
    assert load_config(write(tmp_path / "shown.yaml", result.stdout)) == want


def test_show_config_world_size_shows_the_mesh():
    result = invoke("show-config", UNET, "--set", "parallel.sp=2", "--world-size", "4")
    assert result.exit_code == 0, result.output
    assert "dp=2 x sp=2" in result.output
    bad = invoke("show-config", UNET, "--set", "parallel.sp=3", "--world-size", "4")
    assert bad.exit_code == 2
    assert "parallel.sp" in bad.output


# --- config errors: exit 2, naming the key, no traceback ------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optimizer.lrr=3"], "optimizer.lrr"),
        (["training.steps=many"], "training.steps"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["schedule.name=linear"], "schedule.name"),
        (["data.source=folder"], "data.root"),
        (["model.num_classes=3", "data.class_names=[a, b]"], "data.class_names"),
        (["steps"], "steps"),
    ],
)
@pytest.mark.parametrize("command", ["run", "show-config"])
def test_config_errors_exit_2_naming_the_key(command, overrides, key, tmp_path):
    args = [command, UNET, "--set", f"run_dir={tmp_path / 'run'}"]
    for o in overrides:
        args += ["--set", o]
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert f"{key}:" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing written for a bad config


def test_config_file_errors(tmp_path):
    missing = invoke("run", tmp_path / "nope.yaml")
    assert missing.exit_code == 2 and "nope.yaml" in missing.output
    broken = write(tmp_path / "broken.yaml", "model: [unclosed\n")
    result = invoke("run", broken)
    assert result.exit_code == 2 and "invalid YAML" in result.output


def test_world_size_from_the_launcher_is_checked_before_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    result = invoke("run", UNET, "--set", "parallel.sp=3", "--set", f"run_dir={tmp_path}/r")
    assert result.exit_code == 2 and "parallel.sp" in result.output


def test_model_option_errors_exit_2_with_the_key(tmp_path):
    # Model options are only checked when the model is built: still before any process group.
    result = invoke(
        "run", UNET, "--set", f"run_dir={tmp_path / 'r'}", "--set", "model.kwargs.depthh=2"
    )
    assert result.exit_code == 2, result.output
    assert "model.kwargs:" in result.output and "depthh" in result.output
    result = invoke("run", UNET, "--set", f"run_dir={tmp_path / 'r'}", "--set", "model.name=unett")
    assert result.exit_code == 2 and "model.name:" in result.output


# --- the run directory ----------------------------------------------------------------------


@pytest.mark.parametrize("leftover", ["config.yaml", "checkpoints", "metrics.jsonl"])
def test_existing_run_is_refused(tmp_path, leftover):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = run_dir / leftover
    target.mkdir() if leftover == "checkpoints" else target.write_text("x")
    result = invoke("run", UNET, "--set", f"run_dir={run_dir}")
    assert result.exit_code == 2, result.output
    assert "run_dir:" in result.output and "--resume" in result.output
    assert "--overwrite" in result.output
    assert target.exists()  # nothing deleted


def test_resume_and_overwrite_together_is_a_usage_error(tmp_path):
    result = invoke("run", UNET, "--set", f"run_dir={tmp_path}", "--resume", "--overwrite")
    assert result.exit_code == 2 and "--resume" in result.output


def _cfg(run_dir: Path, resume: str = "auto"):
    return load_config(UNET, [f"run_dir={run_dir}", f"checkpoint.resume={resume}"])


def test_plan_start_rules(tmp_path):
    run_dir = tmp_path / "run"
    fresh = plan_start(_cfg(run_dir), resume=False, overwrite=False, restarts=0)
    assert (fresh.resume, fresh.remove) == (False, ())
    # --resume with nothing to resume starts fresh, with a note (job scripts may always pass it)
    plan = plan_start(_cfg(run_dir), resume=True, overwrite=False, restarts=0)
    assert plan.resume and any("no checkpoint" in n for n in plan.notes)
    run_dir.mkdir()
    (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError) as err:
        plan_start(_cfg(run_dir), resume=False, overwrite=False, restarts=0)
    assert err.value.key == "run_dir"
    over = plan_start(_cfg(run_dir), resume=False, overwrite=True, restarts=0)
    assert not over.resume and set(over.remove) == {"checkpoints", "metrics.jsonl"}
    assert set(over.remove) <= set(RUN_FILES)  # never anything else in the folder
    again = plan_start(_cfg(run_dir), resume=True, overwrite=False, restarts=0)
    assert (
        again.resume and again.remove == () and not any("no checkpoint" in n for n in again.notes)
    )


def test_plan_start_after_a_torchrun_restart(tmp_path):
    """A restart follows its own job's record (tests/test_run_folder.py has the details)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("")
    # No record of this job: its first attempt was refused, so the restart is refused too.
    with pytest.raises(ConfigError):
        plan_start(_cfg(run_dir, "never"), resume=False, overwrite=False, restarts=1, job="j")
    write_job(run_dir, JobRecord(job="j", decision="overwrite", attempt=0))
    # checkpoint.resume=auto: a restarted worker continues without --resume, not refused,
    # even though the first attempt was launched with --overwrite (must not wipe its work).
    auto = plan_start(_cfg(run_dir, "auto"), resume=False, overwrite=True, restarts=1, job="j")
    assert auto.resume and auto.remove == ()
    # checkpoint.resume=never: start over, deleting the job's own files.
    never = plan_start(_cfg(run_dir, "never"), resume=False, overwrite=True, restarts=1, job="j")
    assert not never.resume and set(never.remove) == {"checkpoints", "config.yaml", JOB_FILE}


def test_plan_start_notes_config_changes_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from spconv_train.config import dump_config

    dump_config(
        load_config(UNET, [f"run_dir={run_dir}", "training.steps=2"]), run_dir / "config.yaml"
    )
    plan = plan_start(
        load_config(UNET, [f"run_dir={run_dir}", "training.steps=4"]),
        resume=True,
        overwrite=False,
        restarts=0,
    )
    assert any("training.steps: 2 -> 4" in n for n in plan.notes), plan.notes


# --- make-data ------------------------------------------------------------------------------


def test_make_data_writes_a_folder_dataset(tmp_path):
    out = tmp_path / "data"
    result = invoke(
        "make-data",
        out,
        "--num-train",
        "3",
        "--num-val",
        "2",
        "--height",
        "8",
        "--width",
        "12",
        "--classes",
        "3",
        "--seed",
        "5",
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "images" / "train").iterdir()) == [
        "0000.png",
        "0001.png",
        "0002.png",
    ]
    assert len(list((out / "masks" / "val").glob("*.png"))) == 2
    assert (out / "classes.txt").read_text().count("\n") == 3
    from spconv_train.data import FolderDataset

    ds = FolderDataset(out, "train", num_classes=3)
    image, mask = ds[0]
    assert image.shape == (3, 8, 12) and mask.shape == (8, 12)
    assert int(mask.max()) < 3
    # The printed hint is a config that validates against the written folder.
    assert f"data.root={out}" in result.output
    folder_cfg = REPO / "configs" / "folder.yaml"
    load_config(folder_cfg, [f"data.root={out}", "model.num_classes=3"])


def test_make_data_bad_options_exit_2(tmp_path):
    assert invoke("make-data", tmp_path / "d", "--classes", "0").exit_code == 2
    assert invoke("make-data", tmp_path / "d", "--format", "jpg").exit_code == 2
    assert not (tmp_path / "d").exists()
