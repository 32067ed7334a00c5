"""Regressions for the two silently wrong results of issue 9 (fp64, against one device).

1. A ``_StridedShard`` activation (``x.flatten(2).transpose(1, 2)`` of a width-sharded map,
   smp Segformer's MLP head) into ``nn.Linear``: the weight/bias gradients were not summed
   over the ranks because ``_StridedShard`` is not a ``Shard``.
2. A ``Conv2d`` whose ``padding``/``dilation``/``stride`` were edited after construction
   (smp ``make_dilated``): the sharded conv used the constructor's padding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, compare_module, seeded

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
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    g = seeded(2, *yr.shape, dtype=torch.float64)
    yr.backward(g)

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
