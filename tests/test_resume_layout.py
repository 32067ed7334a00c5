"""Resuming on another number of ranks / another ``(dp, sp)`` layout never mixes images.

Real ``train()`` runs on gloo groups (the shared harness): 2 ranks train and checkpoint,
then the run resumes at 1, 3 and 4 ranks with ``(dp, sp)`` changing too. Every rank records
what its data feed loaded (epoch, sample indices, columns) and the RNG seed of the step.
Checked on every step of every run:

* all spatial ranks of a replica load the same samples, and their strips tile the image
  (the bug: a rank without per-rank state restarted its data position at 0 and mixed
  strips of different images);
* the global batches are those of the one global sample stream (epoch order of the seed,
  ``batch_size * dp`` samples a step, the epoch's last step padded like
  ``DistributedSampler``), so the resumed run continues at exactly the sample where the
  saved one stopped, as an uninterrupted run at the new layout through that position sees
  it; with ``dp`` unchanged, step for step equal to a real uninterrupted run at the new
  layout, RNG seeds included.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

N_TRAIN, BATCH, SEED = 7, 2, 5  # 7 samples: epochs end on padded, uneven last steps
CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 1, base_width: 4}}}}
data: {{height: 16, width: 48, num_train: 7, num_val: 1, batch_size: 2, hflip: 0.5}}
optimizer: {{name: sgd, lr: 1.0e-3}}
parallel: {{sp: {sp}}}
training: {{steps: {steps}, val_every: 100, log_every: 100, seed: 5}}
checkpoint: {{every: 100, keep_last: 1}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def run_recorded(root: str, name: str, sp: int, steps: int, resume: bool) -> list[tuple]:
    """``train()`` on this worker group; returns this rank's per-step records
    ``(step, rng seed, epoch, indices, cols, global width)``."""
    from spconv_train.config import load_config
    from spconv_train.data import strip_bounds
    from spconv_train.train import data_feed, loop

    run_dir = Path(root) / name
    path = Path(root) / f"{name}-{dist.get_world_size()}.yaml"
    if dist.get_rank() == 0:
        path.write_text(CONFIG.format(run_dir=run_dir, sp=sp, steps=steps))
    dist.barrier()
    cfg = load_config(path, [])
    records: list[tuple] = []
    real = data_feed.load_train_strips

    def recording(source, cfg_, coords, epoch, indices):
        image, mask, hw = real(source, cfg_, coords, epoch, indices)
        cols = strip_bounds(hw[1], coords.sp, coords.sp_rank)
        records.append((torch.initial_seed(), epoch, list(indices), cols, hw[1]))
        return image, mask, hw

    data_feed.load_train_strips = recording
    try:
        loop.train(cfg, resume=resume)
    finally:
        data_feed.load_train_strips = real
    dist.barrier()
    return records


def global_batches(per_rank: list[list[tuple]], sp: int, first_step: int) -> list[tuple]:
    """Per step ``(rng seed, epoch, global batch)``: replicas' samples in dp-rank order.
    Asserts that the spatial ranks of every replica agree and tile the image."""
    dp, out = len(per_rank) // sp, []
    for k in range(len(per_rank[0])):
        batch, seeds = [], set()
        for r in range(dp):
            group = [per_rank[r * sp + s][k] for s in range(sp)]
            seed, epoch, indices, _, width = group[0]
            for s, (seed_s, epoch_s, indices_s, _, width_s) in enumerate(group):
                assert (epoch_s, indices_s, width_s) == (epoch, indices, width), (
                    f"step {first_step + k}: replica {r} mixes images: sp rank {s} loaded "
                    f"epoch {epoch_s} samples {indices_s}, sp rank 0 epoch {epoch} {indices}"
                )
                seeds.add(seed_s)
            edges = [group[s][3] for s in range(sp)]
            assert edges[0][0] == 0 and edges[-1][1] == width, edges
            assert all(a[1] == b[0] for a, b in zip(edges, edges[1:], strict=False)), edges
            batch += [(epoch, i) for i in indices]
        assert len(seeds) == 1, f"step {first_step + k}: ranks in different RNG states"
        out.append((seeds.pop(), batch))
    return out


def stream(dp: int, start: tuple[int, int], steps: int) -> list[list[tuple[int, int]]]:
    """Reference: the global batches of ``steps`` steps at data-parallel size ``dp`` from
    position ``(epoch, offset)`` of the global stream (written independently of the feed)."""
    epoch, offset = start
    out = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(SEED + epoch)
        order = torch.randperm(N_TRAIN, generator=g).tolist()
        chunk = order[offset : offset + BATCH * dp]
        offset += len(chunk)
        pad = 0
        while len(chunk) % dp:  # the epoch's last step: padded from the start of the order
            chunk.append(order[pad % N_TRAIN])
            pad += 1
        per_replica = [chunk[r::dp] for r in range(dp)]
        out.append([(epoch, i) for rep in per_replica for i in rep])
        if offset == N_TRAIN:
            epoch, offset = epoch + 1, 0
    return out


def position_after(dp: int, steps: int) -> tuple[int, int]:
    """(epoch, offset) of the global stream after ``steps`` steps at ``dp`` from the start."""
    epoch, offset = 0, 0
    for _ in range(steps):
        offset = min(offset + BATCH * dp, N_TRAIN)
        if offset == N_TRAIN:
            epoch, offset = epoch + 1, 0
    return epoch, offset


def seeds_ok(batches: list[tuple], first_step: int) -> None:
    """RNG by step: step k runs under the same seed on any layout, resumed or not."""
    from spconv_train.train.determinism import seed_for_step

    for k, (seed, _) in enumerate(batches):
        seed_for_step(SEED, first_step + k)
        assert seed == torch.initial_seed(), f"step {first_step + k}: rng seed {seed}"


SAVED_STEPS, TOTAL = 3, 6
# (layout saved at 2 ranks) -> (world, sp) resumed on
# 2 -> 3 with sp 2 -> 3 is the reported bug (rank 2 restarted at sample 0, mixing images).
CASES = [((2, 1), (1, 1)), ((1, 2), (3, 3)), ((1, 2), (4, 1))]


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory) -> dict:
    """Runs of SAVED_STEPS steps at 2 ranks, one per saved layout: {sp: (folder, records)}."""
    root = tmp_path_factory.mktemp("layout")
    out = {}
    for sp in sorted({s for (_, s), _ in CASES}):
        records = dist_pool.run(2, run_recorded, str(root), f"saved-sp{sp}", sp, SAVED_STEPS, False)
        out[sp] = (root / f"saved-sp{sp}", records)
    return out


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"dp{c[0][0]}sp{c[0][1]}-to-w{c[1][0]}sp{c[1][1]}"
)
def test_resume_on_a_new_layout_continues_the_same_samples(dist_pool, saved, tmp_path, case):
    (dp0, sp0), (world, sp) = case
    dp = world // sp
    folder, records = saved[sp0]
    first = global_batches(records, sp0, 0)
    assert [b for _, b in first] == stream(dp0, (0, 0), SAVED_STEPS)
    seeds_ok(first, 0)

    shutil.copytree(folder, tmp_path / "run")
    resumed = dist_pool.run(world, run_recorded, str(tmp_path), "run", sp, TOTAL, True)
    after = global_batches(resumed, sp, SAVED_STEPS)
    assert len(after) == TOTAL - SAVED_STEPS
    want = stream(dp, position_after(dp0, SAVED_STEPS), TOTAL - SAVED_STEPS)
    assert [b for _, b in after] == want
    seeds_ok(after, SAVED_STEPS)
    if dp == dp0:  # the same replicas: step for step an uninterrupted run at the new layout
        ref = dist_pool.run(world, run_recorded, str(tmp_path), "ref", sp, TOTAL, False)
        assert global_batches(ref, sp, 0)[SAVED_STEPS:] == after


def test_global_stream_gives_the_distributed_sampler_batches():
    """On an unchanged layout the feed's batches are exactly those of the previous
    per-replica ``DistributedSampler`` + ``batch_size`` (format-1 positions stay valid, and
    ``verify``'s reference batches still match); the offsets count real samples only."""
    from spconv_train.data import make_dp_sampler
    from spconv_train.train.determinism import epoch_order, replica_steps

    for n in range(1, 10):
        for batch in (1, 2, 3):
            for dp in (1, 2, 3, 4):
                order = epoch_order(n, SEED, 3)
                for r in range(dp):
                    sampler = make_dp_sampler(n, dp=dp, dp_rank=r, seed=SEED)
                    sampler.set_epoch(3)
                    mine = list(sampler)
                    want = [mine[i : i + batch] for i in range(0, len(mine), batch)]
                    steps = replica_steps(order, 0, batch, dp, r)
                    assert [s for s, _ in steps] == want, (n, batch, dp, r)
                    assert [o for _, o in steps] == [
                        min((k + 1) * batch * dp, n) for k in range(len(want))
                    ]
