"""What makes a training run reproducible on any mesh layout, resumes included.

* **One global sample stream.** Epoch ``e`` visits the samples in the order
  ``epoch_order(n, seed, e)`` (the permutation ``DistributedSampler`` draws). A step of a
  ``(dp, sp)`` mesh consumes the next ``batch_size * dp`` samples of that order; replica
  ``r`` takes every ``dp``-th of them from the ``r``-th, exactly the batches that
  ``DistributedSampler(dp, r)`` and ``batch_size`` would give. The data position is then one
  rank-independent pair ``(epoch, samples of the epoch consumed)``: a run resumed on another
  ``dp`` continues the same stream at the same sample, each replica taking its share.
* **RNG by step.** The global generators (dropout masks) are re-seeded from
  ``(training.seed, step)`` before every step, the same on every rank, so they do not depend
  on the history of a process or on the layout: nothing per rank needs saving.
"""

from __future__ import annotations

import torch

from spconv_train.distributed import seed_everything

__all__ = ["epoch_order", "replica_steps", "seed_for_step"]


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The global visiting order of epoch ``epoch`` (``DistributedSampler``'s shuffle)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def replica_steps(
    order: list[int], offset: int, batch_size: int, dp: int, dp_rank: int
) -> list[tuple[list[int], int]]:
    """The rest of an epoch for replica ``dp_rank`` of ``dp``, from global ``offset``.

    Returns one ``(sample indices of this replica, offset after the step)`` per step. Every
    step takes the next ``batch_size * dp`` samples of ``order``; the epoch's last step
    takes what is left, padded to a multiple of ``dp`` with samples from the start of the
    order (as ``DistributedSampler`` pads) so that every replica gets the same count.
    """
    if not 0 <= offset <= len(order):
        raise ValueError(f"offset {offset} outside an epoch of {len(order)} samples")
    steps, per_step = [], batch_size * dp
    while offset < len(order):
        chunk = order[offset : offset + per_step]
        offset += len(chunk)
        pad = -len(chunk) % dp
        if pad:
            chunk = chunk + (order * (pad // len(order) + 1))[:pad]
        steps.append((chunk[dp_rank::dp], offset))
    return steps


def seed_for_step(seed: int, step: int) -> None:
    """Seed torch, python and numpy for training step ``step`` (0-based), identically on
    every rank and independently of what ran before."""
    seed_everything((seed * 1_000_003 + step + 1) % 2**63)
