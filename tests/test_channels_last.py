"""``training.channels_last`` (train/model_setup.to_channels_last): which models it converts,
and that a parallelized model with channels-last weights still equals one device (fp64,
uneven widths, every gradient) and keeps its activations channels-last, their gradients
too (every halo convolution's backward gets a channels-last output gradient: no copy to
NCHW and back)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.train.model_setup import to_channels_last
from tests.dist_harness import device, mesh
from tests.reference import check_close, seeded

CL, CL3 = torch.channels_last, torch.channels_last_3d


def test_modes_and_model_ranks():
    conv2 = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert not to_channels_last(conv2, "auto")  # auto: only on CUDA
    assert not to_channels_last(conv2, "off")
    assert to_channels_last(conv2, "on") and conv2[0].weight.is_contiguous(memory_format=CL)
    conv3 = nn.Conv3d(2, 2, 3)
    assert to_channels_last(conv3, "on") and conv3.weight.is_contiguous(memory_format=CL3)
    mixed = nn.Sequential(nn.Conv2d(2, 2, 3), nn.Conv3d(2, 2, 3))
    assert not to_channels_last(mixed, "on")  # one format cannot serve both
    assert mixed[0].weight.is_contiguous()


class ConvGradLayouts(TorchDispatchMode):
    """Records the shapes of the NCHW output gradients that ``aten.convolution_backward``
    receives for kernels wider than one column, transposed ones aside (the halo
    convolutions, ``parallel/_halo_conv.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.nchw: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        conv_bwd = func is torch.ops.aten.convolution_backward.default
        if conv_bwd and args[2].shape[-1] > 1 and not args[7]:  # args[7]: transposed
            g = args[0]
            if g.dim() == 4 and min(g.shape[1:]) > 1 and not g.is_contiguous(memory_format=CL):
                self.nchw.append(tuple(g.shape))
        return func(*args, **(kwargs or {}))


def _sharded_equals_one_device(world: int, width: int) -> list[str]:
    dmesh, failures = mesh(world), []
    torch.manual_seed(0)
    model = create_model("unet", num_classes=3, depth=2, base_width=4).double().to(device())
    x = seeded(5, 1, 3, 16, width, dtype=torch.float64).to(device())
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    g = seeded(6, *yr.shape, dtype=torch.float64).to(device())
    yr.backward(g)
    par = parallelize(copy.deepcopy(model), dmesh)
    assert to_channels_last(par, "on")
    xs = distribute_tensor(x.clone(), dmesh, [Shard(3)]).requires_grad_()
    ys = par(xs)
    if not ys.to_local().is_contiguous(memory_format=CL):
        failures.append("the sharded logits are not channels-last")
    with ConvGradLayouts() as layouts:
        ys.backward(distribute_tensor(g, dmesh, [Shard(3)]))
    if layouts.nchw:
        failures.append(f"NCHW output gradients in the conv backward: {layouts.nchw}")
    check_close("output", ys, yr, 1e-10, failures)
    check_close("input grad", xs.grad, xr.grad, 1e-10, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{name}.grad", p.grad, pr.grad, 1e-10, failures)
    return failures


@pytest.mark.parametrize("world,width", [(3, 44)])  # 15 / 15 / 14 columns: a middle rank
def test_channels_last_sharded_model_equals_one_device(dist_pool, world, width):
    failures = dist_pool.run(world, _sharded_equals_one_device, world, width)[0]
    assert not failures, "\n".join(failures)
