"""Checkpoints move between FSDP and plain layouts (issue 25 item 3).

Real ``train()`` runs on gloo groups: a 4-rank FSDP run (dp 2 x sp 2) saves at step 3 and
resumes on 2 ranks without FSDP (dp 2 x sp 1); a 2-rank plain run resumes on 4 ranks with
FSDP. Both end, after 6 steps, with the parameters of an uninterrupted 2-rank run (the same
global batches: dp is 2 throughout), up to fp32 summation order, and of an uninterrupted
4-rank FSDP run; ``model.pt`` is a plain state dict of full tensors in every case.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SAVED, TOTAL = 3, 6
# fp32 training: layouts differ only in summation order (one step moves a parameter by
# ~lr = 1e-2; rounding differences stay far below that)
TOL = 2e-5
CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4}}}}
data: {{height: 16, width: 48, num_train: 7, num_val: 3, batch_size: 1, hflip: 0.5}}
optimizer: {{name: adamw, lr: 1.0e-2, grad_clip: 0.5}}
schedule: {{name: constant, warmup_steps: 0}}
parallel: {{sp: {sp}, fsdp: {fsdp}}}
training: {{steps: {steps}, val_every: 2, log_every: 100, seed: 5}}
checkpoint: {{every: 3, keep_last: 2}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def run(root: str, name: str, sp: int, fsdp: bool, steps: int, resume: bool) -> dict:
    """``train()`` on this worker group; returns rank 0's ``model.pt`` state (CPU)."""
    from spconv_train.config import load_config
    from spconv_train.train import loop

    run_dir = Path(root) / name
    path = Path(root) / f"{name}-{dist.get_world_size()}-{steps}.yaml"
    if dist.get_rank() == 0:
        text = CONFIG.format(run_dir=run_dir, sp=sp, fsdp=str(fsdp).lower(), steps=steps)
        path.write_text(text)
    dist.barrier()
    loop.train(load_config(path, []), resume=resume)
    dist.barrier()
    return torch.load(run_dir / "model.pt", weights_only=True)["model"]


def _plain_full(state: dict) -> None:
    assert state and all(type(v) is torch.Tensor for v in state.values()), {
        k: type(v).__name__ for k, v in state.items()
    }


def _diff(got: dict, want: dict) -> float:
    """The largest relative difference over the floating-point entries."""
    assert got.keys() == want.keys()
    worst = 0.0
    for k, w in want.items():
        if w.is_floating_point():
            scale = max(w.abs().max().item(), 1e-3)
            worst = max(worst, (got[k] - w).abs().max().item() / scale)
    return worst


def _close(got: dict, want: dict) -> float:
    """``_diff``, with the integer entries (BatchNorm's step counts) equal."""
    for k, w in want.items():
        if not w.is_floating_point():
            assert torch.equal(got[k], w), k
    return _diff(got, want)


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory) -> tuple[Path, dict]:
    """Uninterrupted references and the two saved halves: {name: model.pt state}."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    out = {
        "plain2": dist_pool.run(2, run, str(root), "plain2", 1, False, TOTAL, False)[0],
        "fsdp4": dist_pool.run(4, run, str(root), "fsdp4", 2, True, TOTAL, False)[0],
        "fsdp4-half": dist_pool.run(4, run, str(root), "fsdp4-half", 2, True, SAVED, False)[0],
        "plain2-half": dist_pool.run(2, run, str(root), "plain2-half", 1, False, SAVED, False)[0],
    }
    return root, out


def test_fsdp_training_equals_plain_training(runs):
    _, out = runs
    for state in out.values():
        _plain_full(state)
    assert _close(out["fsdp4"], out["plain2"]) < TOL


@pytest.mark.parametrize(
    "saved, world, sp, fsdp",
    [("fsdp4-half", 2, 1, False), ("plain2-half", 4, 2, True)],
    ids=["fsdp-4-ranks-to-plain-2-ranks", "plain-2-ranks-to-fsdp-4-ranks"],
)
def test_checkpoint_resumes_across_fsdp_and_layouts(
    dist_pool, runs, tmp_path, saved, world, sp, fsdp
):
    root, out = runs
    shutil.copytree(root / saved, tmp_path / "run")
    state = dist_pool.run(world, run, str(tmp_path), "run", sp, fsdp, TOTAL, True)[0]
    _plain_full(state)
    assert _close(state, out["plain2"]) < TOL
    assert _close(state, out["fsdp4"]) < TOL
    # the half run really was resumed: its step-3 weights differ from the final ones
    assert _diff(out[saved], out["plain2"]) > 100 * TOL
