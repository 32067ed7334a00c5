"""Regressions for the two silently wrong results of issue 9 (fp64, against one device).

1. A ``_StridedShard`` activation (``x.flatten(2).transpose(1, 2)`` of a width-sharded map,
   smp Segformer's MLP head) into ``nn.Linear``: the weight/bias gradients were not summed
   over the ranks because ``_StridedShard`` is not a ``Shard``.
2. A ``Conv2d`` whose ``padding``/``dilation``/``stride`` were edited after construction
   (smp ``make_dilated``): the sharded conv used the constructor's padding.
3. A model built from a different random state on each rank (no seed before building):
   every strip ran with other weights. ``parallelize`` now broadcasts rank 0's state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, compare_module, reference_backward, seeded

TOL = 1e-10


class _TokenHead(nn.Module):
    """Segformer-style head: conv, tokens ``[N, H*W, C]``, Linear over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.linear = nn.Linear(4, 5)

    def forward(self, x):
        return self.linear(self.conv(x).flatten(2).transpose(1, 2))


def strided_linear(world: int) -> list[str]:
    torch.manual_seed(0)
    model = _TokenHead().double()
    x = seeded(1, 2, 3, 5, 4 * world + 1, dtype=torch.float64)
    ref, xr, yr, g = reference_backward(model, x, 2)

    dmesh = mesh(world)
    par = parallelize(copy.deepcopy(model), dmesh)
    xs = distribute_tensor(x.clone(), dmesh, [Shard(3)]).requires_grad_()
    ys = par(xs)
    failures: list[str] = []
    check_close("output", ys, yr, TOL, failures)
    # a Replicate gradient: distribute_tensor cannot build a _StridedShard one directly
    ys.backward(distribute_tensor(g, dmesh, [Replicate()]))
    check_close("input grad", xs.grad, xr.grad, TOL, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{name}.grad", p.grad, pr.grad, TOL, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_linear_on_strided_shard_tokens(dist_pool, world):
    for failures in dist_pool.run(world, strided_linear, world):
        assert not failures, "\n".join(failures)


def _edited_convs() -> list[tuple[str, nn.Conv2d]]:
    """Convs whose geometry is changed after construction, as smp's make_dilated does."""
    torch.manual_seed(3)
    cases = []
    conv = nn.Conv2d(3, 4, 3, padding=1)
    conv.padding, conv.dilation = (2, 2), (2, 2)  # make_dilated
    cases.append(("dilated", conv))
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
    conv.stride, conv.padding, conv.dilation = (1, 1), (3, 3), (3, 3)
    cases.append(("stride removed", conv))
    conv = nn.Conv2d(3, 4, 4, padding=0)
    conv.padding = "same"
    cases.append(("padding='same' set later", conv))
    conv = nn.Conv2d(3, 4, (3, 5), padding=(1, 2))
    conv.padding, conv.stride = (0, 1), (2, 1)
    cases.append(("asymmetric", conv))
    return cases


def edited_conv(world: int) -> list[str]:
    failures: list[str] = []
    for i, (label, conv) in enumerate(_edited_convs()):
        x = seeded(10 + i, 2, 3, 7, 7 * world + (1 if world > 1 else 0), dtype=torch.float64)
        compare_module(conv.double(), x, mesh(world), [Shard(3)], "shard", label, failures, TOL)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3])
def test_conv_with_edited_geometry(dist_pool, world):
    failures = dist_pool.run(world, edited_conv, world)[0]
    assert not failures, "\n".join(failures)


class _Net(nn.Module):
    """Conv + train-mode BatchNorm (a buffer too) + conv: weights, buffers and statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(), nn.Conv2d(5, 2, 3)
        )

    def forward(self, x):
        return self.body(x)


def unseeded_build(world: int, sync: bool) -> tuple[list[str], float]:
    """Each rank builds the model from its own seed; the reference is rank 0's model."""
    torch.manual_seed(0)
    ref = _Net().double()
    ref.body[1].running_mean.normal_()  # a buffer that differs too
    rank = torch.distributed.get_rank()
    torch.manual_seed(100 + rank)
    model = _Net().double()
    if rank == 0:
        model.load_state_dict(ref.state_dict())
    else:
        model.body[1].running_mean.normal_()
    dmesh = mesh(world)
    par = parallelize(model, dmesh, sync_state=sync)
    failures: list[str] = []
    if sync:
        for (name, t), tr in zip(par.state_dict().items(), ref.state_dict().values(), strict=True):
            check_close(name, t, tr, 0.0, failures)
    x = seeded(1, 2, 3, 6, 5 * world + 2, dtype=torch.float64)
    ys, yr = par(distribute_tensor(x, dmesh, [Shard(3)])), ref(x)
    check_close("output", ys, yr, TOL, failures)
    diff = float((ys.full_tensor() - yr).abs().max())
    return failures, diff


@pytest.mark.parametrize("world", [2, 3])
def test_parallelize_syncs_state_built_from_other_seeds(dist_pool, world):
    for failures, _ in dist_pool.run(world, unseeded_build, world, True):
        assert not failures, "\n".join(failures)
    # the test can fail: without the broadcast the stitched output is wrong
    off = dist_pool.run(world, unseeded_build, world, False)
    assert all(diff > 1e-3 for _, diff in off), off
