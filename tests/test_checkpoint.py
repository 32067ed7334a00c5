"""Checkpoints: exact resume (model, AdamW/SGD state, scheduler, RNG), atomic saves,
keep-last-K + best pruning, single-device export. Runs on gloo groups of 1 and 2 ranks."""

from __future__ import annotations

import os
import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import Shard, distribute_tensor

import spconv_train.checkpoint.manager as ckpt
from spconv_train.checkpoint import CheckpointManager, export_checkpoint, rng_state, set_rng_state
from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

WIDTH = 13  # uneven over 2 ranks


def tiny_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 2, 1)
    )


def make_opt(name: str, model: nn.Module):
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))
    return opt, sched


def train(model, opt, sched, dmesh, start: int, steps: int) -> None:
    """Deterministic data per step, plus noise from the global torch/python/numpy RNGs so a
    resume only matches if the RNG states were restored too."""
    for step in range(start, start + steps):
        noise = torch.randn(1, 3, 6, WIDTH) * random.uniform(0.05, 0.1) * np.random.uniform(1, 2)
        x = seeded(step, 1, 3, 6, WIDTH) + noise
        target = seeded(1000 + step, 1, 2, 6, WIDTH)
        if dmesh is not None:
            x, target = (distribute_tensor(t, dmesh, [Shard(3)]) for t in (x, target))
        # a sum (a partial reduction) over the uneven strips, not DTensor's mean (a gather)
        loss = ((model(x) - target) ** 2).sum() / target.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def snapshot(model, opt, sched) -> dict:
    clone = lambda t: t.detach().clone() if torch.is_tensor(t) else t  # noqa: E731
    return {
        "model": {k: clone(v) for k, v in model.state_dict().items()},
        "optim": torch.utils._pytree.tree_map(clone, opt.state_dict()),
        "sched": dict(sched.state_dict()),
    }


def same(label: str, a, b, failures: list[str]) -> None:
    """Exact recursive equality of nested state (tensors bit for bit)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)):
            failures.append(f"{label}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            failures.append(f"{label}: keys {sorted(map(str, a))} != {sorted(map(str, b))}")
        for k in set(a) & set(b):
            same(f"{label}.{k}", a[k], b[k], failures)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(f"{label}[{i}]", x, y, failures)
    elif a != b:
        failures.append(f"{label}: {a!r} != {b!r}")


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def resume_case(root: str, world: int) -> list[str]:
    """3 steps + save + 3 steps == load into fresh objects + 3 steps, exactly; the loaded
    state equals the saved one; parallelized and plain models have the same keys; the
    exported .pt reproduces the model on one device."""
    dmesh, rank, failures = mesh(world), dist.get_rank(), []
    for opt_name in ("adamw", "sgd"):
        run = Path(root) / opt_name
        seed_all(0)
        model = parallelize(tiny_net(0), dmesh)
        opt, sched = make_opt(opt_name, model)
        train(model, opt, sched, dmesh, 0, 3)
        cm = CheckpointManager(run)
        saved = cm.save(3, model, opt, scheduler=sched, extra={"rng": rng_state(), "rank": rank})
        at_save = snapshot(model, opt, sched)
        train(model, opt, sched, dmesh, 3, 3)
        uninterrupted = snapshot(model, opt, sched)

        seed_all(99)  # a different init and RNG state: all must come from the checkpoint
        fresh = parallelize(tiny_net(1), dmesh)
        opt2, sched2 = make_opt(opt_name, fresh)
        assert cm.latest() == saved
        step, extra = cm.load(cm.latest(), fresh, opt2, scheduler=sched2)
        set_rng_state(extra["rng"])
        if (step, extra["rank"]) != (3, rank):
            failures.append(f"{opt_name}: loaded step/extra {step}, {extra['rank']}")
        same(f"{opt_name} loaded", snapshot(fresh, opt2, sched2), at_save, failures)
        train(fresh, opt2, sched2, dmesh, 3, 3)
        same(f"{opt_name} resumed", snapshot(fresh, opt2, sched2), uninterrupted, failures)

        # The parallelized model checkpoints under the plain model's names.
        plain = tiny_net(0)
        plain_opt, _ = make_opt(opt_name, plain)
        plain_dir = CheckpointManager(Path(root) / f"{opt_name}-plain").save(0, plain, plain_opt)
        keys = set(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
        plain_keys = set(FileSystemReader(str(plain_dir)).read_metadata().state_dict_metadata)
        if keys != plain_keys:
            failures.append(f"{opt_name}: keys {sorted(keys ^ plain_keys)} differ")
        if not {f"model.{k}" for k in plain.state_dict()} <= keys:
            failures.append(f"{opt_name}: model keys missing from {sorted(keys)}")

        # Export: rank 0 writes; a fresh unparallelized model reproduces the outputs.
        pt = Path(root) / f"{opt_name}.pt"
        CheckpointManager.export(fresh, pt)
        if rank == 0:
            export_checkpoint(saved, Path(root) / f"{opt_name}-step3.pt")
        dist.barrier()
        for path, want in ((pt, fresh), (Path(root) / f"{opt_name}-step3.pt", None)):
            single = tiny_net(5)
            single.load_state_dict(torch.load(path)["model"])
            if want is None:
                same(
                    f"{opt_name} export_checkpoint", single.state_dict(), at_save["model"], failures
                )
                continue
            x = seeded(7, 1, 3, 6, WIDTH)
            y_single = single(x)
            if not torch.equal(y_single, fresh(x)):  # same weights, same single-device math
                failures.append(f"{opt_name} export: outputs differ from the trained model")
            y_par = fresh(distribute_tensor(x, dmesh, [Shard(3)])).full_tensor()
            check_close(f"{opt_name} export vs sharded", y_single, y_par, 1e-5, failures)
        dist.barrier()
    return failures


def atomic_case(root: str, world: int) -> list[str]:
    """A save that fails midway (after a real partial write, on one rank only) raises on every
    rank and leaves `latest` and the previous folder intact; killed leftovers are ignored."""
    rank, failures = dist.get_rank(), []
    # Every rank must train the same replica: DCP writes a plain (replicated) tensor once,
    # from one rank, so unseeded per-rank noise made "after failures" differ on a rank
    # whenever this test ran first in its worker group (e.g. alone with -k failed).
    seed_all(0)
    model = tiny_net(0)
    opt, sched = make_opt("adamw", model)
    train(model, opt, sched, None, 0, 2)
    cm = CheckpointManager(root)
    good = cm.save(2, model, opt, scheduler=sched, extra={"n": 2})
    good_files = sorted(os.listdir(good))
    good_state = snapshot(model, opt, sched)
    train(model, opt, sched, None, 2, 1)
    real_save, real_write_state = ckpt.dcp.save, ckpt.write_state

    def save_then_fail(*args, **kwargs):
        out = real_save(*args, **kwargs)  # a real, complete DCP write into the temp folder
        if rank == world - 1:
            raise OSError("disk full (simulated)")
        return out

    def extra_fails(path, obj):
        if rank == 0 and Path(path).name.startswith("extra-rank"):
            raise OSError("boom (simulated)")
        return real_write_state(path, obj)

    for where, patch in (
        ("dcp.save", mock.patch.object(ckpt.dcp, "save", save_then_fail)),
        ("extra", mock.patch.object(ckpt, "write_state", extra_fails)),
    ):
        try:
            with patch:
                cm.save(3, model, opt, scheduler=sched, extra={"n": 3})
            failures.append(f"{where}: save did not raise")
        except (OSError, RuntimeError) as exc:
            if rank != world - 1 and where == "dcp.save" and "another rank" not in str(exc):
                failures.append(f"{where}: unexpected error {exc!r}")
        dist.barrier()
        # A temp folder may linger a moment on shared storage; it is ignored by latest()
        # and removed by the next save (both checked below), so it is not counted here.
        names = sorted(n for n in os.listdir(cm.dir) if not n.startswith(".tmp-"))
        if cm.latest() != good or (cm.dir / "latest").read_text().strip() != good.name:
            failures.append(f"{where}: latest moved to {cm.latest()}")
        if names != ["latest", good.name] or sorted(os.listdir(good)) != good_files:
            failures.append(f"{where}: folder left as {names}, {sorted(os.listdir(good))}")

    # A save killed earlier leaves a temp folder (and maybe a torn step folder): ignored.
    dist.barrier()  # every rank has listed the folder above before rank 0 litters it
    if rank == 0:
        (cm.dir / ".tmp-step-000009").mkdir()
        (cm.dir / ".tmp-step-000009" / "__0_0.distcp").write_bytes(b"partial")
        (cm.dir / "step-000010").mkdir()
    dist.barrier()
    if cm.latest() != good:
        failures.append(f"leftovers: latest() = {cm.latest()}")
    if rank == 0:
        (cm.dir / "latest").unlink()
    dist.barrier()
    if cm.latest() != good:  # pointer lost: fall back to the newest complete folder
        failures.append(f"no pointer: latest() = {cm.latest()}")
    fresh = tiny_net(3)
    opt2, sched2 = make_opt("adamw", fresh)
    step, extra = cm.load(good, fresh, opt2, scheduler=sched2)
    same("after failures", snapshot(fresh, opt2, sched2), good_state, failures)
    if (step, extra) != (2, {"n": 2}):
        failures.append(f"loaded {step}, {extra}")
    cm.save(4, model, opt, scheduler=sched)
    if rank == 0 and (cm.dir / ".tmp-step-000009").exists():
        failures.append("the next save did not remove the killed save's temp folder")
    if cm.latest() != cm.dir / "step-000004":
        failures.append(f"after a good save latest() = {cm.latest()}")
    dist.barrier()
    return failures


def prune_case(root: str) -> list[str]:
    """keep_last=2 plus the best; a new best frees the old one; keep_best=False; re-save."""
    failures = []
    model = tiny_net(0)
    opt, _ = make_opt("sgd", model)
    cm = CheckpointManager(Path(root) / "a", keep_last=2)
    for step, metric in ((1, 0.1), (2, 0.5), (3, 0.3), (4, None), (5, 0.4)):
        cm.save(step, model, opt, metric=metric)
    steps = lambda m: [p.name for p in m.folders()]  # noqa: E731
    if steps(cm) != ["step-000002", "step-000004", "step-000005"]:
        failures.append(f"kept {steps(cm)}")
    if cm.best() != cm.dir / "step-000002" or cm.best_metric() != 0.5:
        failures.append(f"best {cm.best()} {cm.best_metric()}")
    cm.save(6, model, opt, metric=0.9)
    if steps(cm) != ["step-000005", "step-000006"] or cm.best() != cm.dir / "step-000006":
        failures.append(f"after new best: kept {steps(cm)}, best {cm.best()}")
    cm.save(6, model, opt)  # same step again (e.g. after a resume): replaced in place
    if steps(cm) != ["step-000005", "step-000006"] or cm.latest() != cm.dir / "step-000006":
        failures.append(f"after re-save: kept {steps(cm)}, latest {cm.latest()}")
    nb = CheckpointManager(Path(root) / "b", keep_last=1, keep_best=False)
    for step, metric in ((1, 0.9), (2, 0.1)):
        nb.save(step, model, None, metric=metric)
    if steps(nb) != ["step-000002"] or nb.best() is not None:
        failures.append(f"keep_best=False: kept {steps(nb)}, best {nb.best()}")
    fresh = tiny_net(4)
    nb.load(nb.latest(), fresh, None)  # model only
    same("model-only load", fresh.state_dict(), model.state_dict(), failures)
    return failures


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_exact(dist_pool, tmp_path, world):
    for rank, failures in enumerate(dist_pool.run(world, resume_case, str(tmp_path), world)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2])
def test_failed_save_keeps_last_good(dist_pool, tmp_path, world):
    for rank, failures in enumerate(dist_pool.run(world, atomic_case, str(tmp_path), world)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_prune_keeps_last_and_best(dist_pool, tmp_path):
    (failures,) = dist_pool.run(1, prune_case, str(tmp_path))
    assert not failures, "\n".join(failures)


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    assert CheckpointManager(tmp_path).latest() is None
