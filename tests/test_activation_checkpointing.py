"""Activation checkpointing on a width-sharded U-Net (issue 11 item 4): the activations
kept alive after the forward shrink to <= 0.4x (block granularity; layer granularity and
every-other-block save less), and the gradients (reduced by the bucketed
``GradReducer`` while checkpointed blocks are recomputed) still equal one device's."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._step_meters import LiveBytes
from spconv_train.train.optim import enable_activation_checkpointing
from tests.dist_harness import mesh
from tests.reference import check_close, seeded


def checkpoint_compare(world: int) -> dict:
    dmesh = mesh(world)
    torch.manual_seed(0)
    ref = create_model("unet", num_classes=3, depth=3, base_width=8, norm="batch")
    x = seeded(1, 1, 3, 32, 128)
    target = seeded(2, 1, 3, 32, 128)
    ((ref(x) - target) ** 2).mean().backward()
    live, failures = {}, []
    for ck in (None, ("blocks", 1), ("layers", 1), ("blocks", 2)):
        par = parallelize(copy.deepcopy(ref), dmesh)
        par.zero_grad(set_to_none=True)
        if ck:  # as the training loop does: after parallelize
            enable_activation_checkpointing(par, *ck)
        with LiveBytes() as meter:
            y = par(distribute_tensor(x, dmesh, [Shard(3)]))
            loss = ((y - distribute_tensor(target, dmesh, [Shard(3)])) ** 2).mean()
        live[ck] = meter.live()
        loss.backward()
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            check_close(f"checkpointing={ck} {name} grad", p.grad, q.grad, 1e-5, failures)
    return {"failures": failures, **{k: live[k] / live[None] for k in live if k}}


def test_checkpointing_saves_activations_and_keeps_grads_exact(dist_pool):
    for rank, res in enumerate(dist_pool.run(2, checkpoint_compare, 2)):
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"])
        # 0.36 on this U-Net: the issue-11 target is <= 0.4. (A Python weakref to the output
        # tensor once made the meter miss storages and read 0.39-0.67 by test order.)
        assert res[("blocks", 1)] <= 0.4, res
        # finer or sparser checkpointing keeps more alive, but still saves
        assert res[("blocks", 1)] < res[("layers", 1)] < 1, res
        assert res[("blocks", 1)] < res[("blocks", 2)] < 1, res
