"""Config changes on ``--resume`` are applied or refused, never recorded falsely.

The per-key table (``spconv_train.config.RESUME_POLICY``), the refusal with exit 2 before
anything is touched, ``apply_hyperparameters`` putting a changed lr / weight decay / betas /
schedule in force after the optimizer and scheduler states were loaded, and a real resumed
run (one process) whose optimizer steps with the new learning rate and schedule.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.config import (
    Config,
    ConfigError,
    OptimizerConfig,
    ScheduleConfig,
    check_resume_changes,
    config_to_dict,
    dump_config,
    load_config,
    resume_policy,
)
from spconv_train.config._resume import RESUME_POLICY
from spconv_train.train.optim import (
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    lr_factor,
)
from tests.test_train_e2e import ok, plain, read_metrics, tiny_config

REPO = Path(__file__).resolve().parents[1]
UNET = REPO / "configs" / "unet.yaml"


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [prefix + k]
    return out


# --- the policy table -----------------------------------------------------------------------


def test_every_setting_has_a_resume_rule():
    """Every key of the schema is covered by an entry (its own or its section's), so no
    setting falls through to the default refusal unnoticed."""
    keys = _flat_keys(config_to_dict(Config()))
    assert len(keys) > 30
    for key in keys:
        parts = key.split(".")
        covered = any(".".join(parts[:n]) in RESUME_POLICY for n in range(1, len(parts) + 1))
        assert covered, key
    assert resume_policy("model.kwargs.depth")[0] == "refuse"
    assert resume_policy("brand_new_section.x") == ("refuse", "no resume rule for this setting")


@pytest.mark.parametrize(
    ("key", "policy"),
    [
        ("optimizer.lr", "apply"),
        ("optimizer.weight_decay", "apply"),
        ("optimizer.betas", "apply"),
        ("optimizer.name", "refuse"),
        ("schedule.name", "apply"),
        ("training.steps", "apply"),
        ("training.val_every", "apply"),
        ("training.seed", "refuse"),
        ("checkpoint.keep_last", "apply"),
        ("logging.progress", "apply"),
        ("parallel.sp", "apply"),  # resumable on another layout (never refused)
        ("model.num_classes", "refuse"),
        ("model.kwargs.base_width", "refuse"),
        ("data.width", "refuse"),
        ("data.root", "refuse"),
        ("data.batch_size", "refuse"),
        ("data.hflip", "apply"),
    ],
)
def test_resume_policy_per_key(key, policy):
    assert resume_policy(key)[0] == policy


def test_check_resume_changes_notes_applied_and_names_refused_keys():
    old = config_to_dict(load_config(UNET, ["optimizer.lr=0.003"]))
    new = config_to_dict(load_config(UNET, ["optimizer.lr=0.01", "training.steps=500"]))
    notes = check_resume_changes(old, new)
    assert any("optimizer.lr: 0.003 -> 0.01" in n for n in notes), notes
    assert any("training.steps" in n for n in notes) and len(notes) == 2
    bad = config_to_dict(
        load_config(UNET, ["optimizer.lr=0.01", "model.num_classes=7", "training.seed=3"])
    )
    with pytest.raises(ConfigError) as err:
        check_resume_changes(old, bad)
    msg = str(err.value)
    assert err.value.key == "model.num_classes"
    assert "training.seed" in msg and "optimizer.lr" not in msg  # all refused keys, only those
    assert "run_dir" in msg and f"--set model.num_classes={old['model']['num_classes']}" in msg


# --- refusal at the command line ------------------------------------------------------------


def _folder_with_checkpoint(run_dir: Path, *sets: str) -> None:
    dump_config(load_config(UNET, [f"run_dir={run_dir}", *sets]), run_dir / "config.yaml")
    step = run_dir / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2}))


@pytest.mark.parametrize(
    "change", ["model.kwargs.base_width=8", "data.width=256", "optimizer.name=sgd"]
)
def test_refused_change_on_resume_exits_2_naming_the_key(tmp_path, change):
    run_dir = tmp_path / "run"
    _folder_with_checkpoint(run_dir)
    saved = (run_dir / "config.yaml").read_bytes()
    args = ["run", str(UNET), "--set", f"run_dir={run_dir}", "--set", change, "--resume"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    key = change.split("=")[0]
    assert f"{key}:" in result.output and "cannot change when resuming" in result.output
    assert (run_dir / "config.yaml").read_bytes() == saved  # nothing recorded


# --- applying after the checkpoint load -----------------------------------------------------


def _trained_states(opt_cfg: OptimizerConfig, sched: ScheduleConfig, steps: int):
    """A tiny conv net trained ``steps`` steps; returns (model, optimizer, scheduler)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1))
    opt = build_optimizer(model, opt_cfg)
    scheduler = build_scheduler(opt, sched, 10, opt_cfg.lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(2, 2, 6, 5, generator=gen)).square().mean().backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    return model, opt, scheduler


def _resumed(model, opt, scheduler, opt_cfg: OptimizerConfig, sched: ScheduleConfig):
    """Fresh optimizer/scheduler from the new config, loaded from the saved states (as
    ``CheckpointManager.load`` does)."""
    model = copy.deepcopy(model)
    new_opt = build_optimizer(model, opt_cfg)
    new_sched = build_scheduler(new_opt, sched, 10, opt_cfg.lr)
    new_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    new_sched.load_state_dict(copy.deepcopy(scheduler.state_dict()))
    return model, new_opt, new_sched


def test_apply_hyperparameters_puts_the_new_values_in_force():
    sched = ScheduleConfig(name="cosine", warmup_steps=2, min_lr=1e-4)
    old = OptimizerConfig(name="adamw", lr=3e-3, weight_decay=1e-4)
    model, opt, scheduler = _trained_states(old, sched, steps=3)
    new = OptimizerConfig(name="adamw", lr=2e-2, weight_decay=0.05, betas=[0.8, 0.99])
    _, new_opt, new_sched = _resumed(model, opt, scheduler, new, sched)
    assert new_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # the bug: old lr
    apply_hyperparameters(new_opt, new_sched, new)
    want = 2e-2 * lr_factor(3, sched, 10, 2e-2)
    assert [g["lr"] for g in new_opt.param_groups] == [want, want]
    assert new_sched.get_last_lr() == [want, want]
    assert [g["initial_lr"] for g in new_opt.param_groups] == [2e-2, 2e-2]
    assert [g["weight_decay"] for g in new_opt.param_groups] == [0.05, 0.0]  # biases/norms: 0
    assert all(g["betas"] == (0.8, 0.99) for g in new_opt.param_groups)
    new_sched.step()  # the schedule continues from the new peak
    assert new_opt.param_groups[0]["lr"] == 2e-2 * lr_factor(4, sched, 10, 2e-2)


def test_apply_hyperparameters_with_an_unchanged_config_changes_nothing():
    sched = ScheduleConfig(name="cosine", warmup_steps=2, min_lr=1e-4)
    cfg = OptimizerConfig(name="sgd", lr=3e-3, momentum=0.9)
    model, opt, scheduler = _trained_states(cfg, sched, steps=5)
    _, new_opt, new_sched = _resumed(model, opt, scheduler, cfg, sched)
    apply_hyperparameters(new_opt, new_sched, cfg)
    for a, b in zip(opt.param_groups, new_opt.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {
            k: v for k, v in b.items() if k != "params"
        }
    assert new_sched.get_last_lr() == scheduler.get_last_lr()


def test_the_optimizer_steps_with_the_new_lr_after_resume():
    sched = ScheduleConfig(name="constant", warmup_steps=0)
    old = OptimizerConfig(name="sgd", lr=1e-3, momentum=0.0, weight_decay=0.0)
    model, opt, scheduler = _trained_states(old, sched, steps=2)
    new = OptimizerConfig(name="sgd", lr=0.25, momentum=0.0, weight_decay=0.0)
    model, new_opt, new_sched = _resumed(model, opt, scheduler, new, sched)
    apply_hyperparameters(new_opt, new_sched, new)
    x = torch.randn(2, 2, 6, 5, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    weight = model[0].weight
    before, grad = weight.detach().clone(), weight.grad.clone()
    new_opt.step()
    torch.testing.assert_close(weight.detach(), before - 0.25 * grad, rtol=0, atol=1e-7)
    assert (weight.detach() - before).abs().max() > 100 * 1e-3 * grad.abs().max()


def test_resumed_run_trains_with_the_changed_lr_and_schedule(tmp_path):
    """A real run (one process): 2 steps at lr 3e-3 (constant), resumed to 4 steps with
    lr 2e-2 and a cosine schedule. The optimizer's lr at steps 3 and 4 is the new one, and
    config.yaml / model.pt record what was used."""
    config = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    ok(plain(config, "--set", "training.steps=2"))
    changes = ["optimizer.lr=2.0e-2", "schedule.name=cosine", "schedule.warmup_steps=1"]
    changes += ["schedule.min_lr=1.0e-4"]
    sets = [a for c in ["training.steps=4", *changes] for a in ("--set", c)]
    resumed = ok(plain(config, "--resume", *sets))
    assert "resumed from" in resumed.stdout and "optimizer.lr: 0.003 -> 0.02" in resumed.stdout
    assert "training.steps: 2 -> 4" in resumed.stdout  # a finished run, extended
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.optimizer.lr == 2e-2 and cfg.schedule.name == "cosine"
    lrs = {m["step"]: m["lr"] for m in read_metrics(run_dir) if m["split"] == "train"}
    assert lrs[1] == pytest.approx(3e-3 / 3) and lrs[2] == pytest.approx(3e-3 * 2 / 3)
    for step in (3, 4):
        want = 2e-2 * lr_factor(step - 1, cfg.schedule, 4, 2e-2)
        assert lrs[step] == pytest.approx(want, rel=1e-12), (step, lrs)
    exported = torch.load(run_dir / "model.pt", weights_only=True)
    assert exported["config"]["optimizer"]["lr"] == 2e-2
