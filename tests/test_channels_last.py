"""``training.channels_last`` (train/model_setup.to_channels_last): which models it converts,
and that a parallelized model with channels-last weights still equals one device (fp64,
uneven widths, every gradient) and keeps its activations channels-last, their gradients
too: no op of the forward or backward converts an activation between NCHW and
channels-last (halo windows, transposed convolutions' crops, skip ``torch.cat``, max
pooling, nearest up-sampling, batch norm; a batch of 1, whose strides DTensor's views
disturb, ``parallel/_layout.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._layout import empty_as, grad_in_layout, in_layout
from spconv_train.train.model_setup import to_channels_last
from tests.dist_harness import device, mesh
from tests.reference import check_close, reference_backward, seeded

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


def test_batch_one_strides_and_buffers():
    """DTensor's ``view_as`` gives a channels-last batch of 1 the batch stride C, which torch
    reads as NCHW (``torch.cat`` of two such returns NCHW); ``in_layout`` restores it,
    ``grad_in_layout`` does the same for the gradient, ``empty_as`` keeps the dim order."""
    x = torch.randn(1, 4, 5, 6).contiguous(memory_format=CL)
    broken = x.view_as(x)
    assert broken.stride(0) == 4 and not torch.cat([broken, broken]).is_contiguous(memory_format=CL)
    fixed = in_layout(broken)
    assert fixed.stride() == x.stride() and torch.equal(fixed, x)
    assert torch.cat([fixed, fixed], 1).is_contiguous(memory_format=CL)
    leaf, seen = x.clone().requires_grad_(), []
    leaf.register_hook(lambda g: seen.append(g.stride()))  # before AccumulateGrad restrides
    y = grad_in_layout(leaf)
    y.backward(broken)
    assert torch.equal(y, x) and seen == [x.stride()]
    assert empty_as(x, (1, 4, 5, 9)).is_contiguous(memory_format=CL)
    moved = empty_as(x.movedim(2, -1), (1, 4, 6, 7)).movedim(-1, 2)  # a view _tiles.along makes
    assert moved.shape == (1, 4, 7, 6) and moved.is_contiguous(memory_format=CL)


class LayoutConversions(TorchDispatchMode):
    """Records every op (forward and backward) that turns a dense channels-last activation
    into a dense NCHW one or back: an input and an output (or two inputs) of at least 4x4
    pixels and more than one channel in different memory orders (``copy_`` into an NCHW
    window, ``torch.cat`` or ``max_pool2d`` returning NCHW for channels-last inputs, a
    convolution fed an NCHW activation ...). Thin halos and 3x3 weights are below the
    size; a gather on a channels-moved-last view is dense NHWC in and out (no change)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    @staticmethod
    def _order(t) -> str | None:
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            return None  # (a DTensor's strides are its global shape's, not its memory's)
        if t.dim() != 4 or t.shape[1] < 2:
            return None
        if min(t.shape[2:]) < 4:
            return None
        cl, nchw = t.is_contiguous(memory_format=CL), t.is_contiguous()
        return "CL" if cl and not nchw else "NCHW" if nchw and not cl else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))]
        outs = out if isinstance(out, (list, tuple)) else (out,)
        orders = {self._order(t) for t in (*flat, *outs)} - {None}
        factory = func in (torch.ops.aten.new_empty.default, torch.ops.aten.new_zeros.default)
        if len(orders) > 1 and not func.is_view and not factory:
            shapes = [(tuple(t.shape), t.stride()) for t in (*flat, *outs) if self._order(t)]
            self.found.append(f"{func}: {shapes}")
        return out


class SmpLikeBlock(nn.Module):
    """An smp Unet encoder step and decoder block in small: a stride-2 3x3 conv, BN, ReLU;
    then nearest up-sampling x2, ``torch.cat`` with the skip, 3x3 conv, BN, ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.down = nn.Sequential(
            nn.Conv2d(c, 2 * c, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU()
        )
        self.up = nn.Sequential(
            nn.Conv2d(3 * c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.down(x), scale_factor=2, mode="nearest")
        return self.up(torch.cat([x, y], dim=1))


def _cl_dtensor(t: torch.Tensor, dmesh) -> DTensor:
    """``t`` sharded along the width, each rank's part channels-last (as a channels-last
    data pipeline hands it over)."""
    local = distribute_tensor(t, dmesh, [Shard(3)]).to_local().contiguous(memory_format=CL)
    return DTensor.from_local(local, dmesh, [Shard(3)], shape=t.shape, stride=t.stride())


def _sharded_equals_one_device(world: int, width: int) -> list[str]:
    dmesh, failures = mesh(world), []
    torch.manual_seed(0)
    unet = create_model("unet", num_classes=3, depth=2, base_width=4)
    model = nn.Sequential(unet, SmpLikeBlock(3)).double().to(device())
    x = seeded(5, 1, 3, 16, width, dtype=torch.float64).to(device())
    ref, xr, yr, g = reference_backward(model, x, 6)
    par = parallelize(copy.deepcopy(model), dmesh)
    assert to_channels_last(par, "on")
    xs = _cl_dtensor(x, dmesh).requires_grad_()
    gs = _cl_dtensor(g, dmesh)
    with LayoutConversions() as conversions:
        ys = par(xs)
        ys.backward(gs)
    if not ys.to_local().is_contiguous(memory_format=CL):
        failures.append("the sharded logits are not channels-last")
    if conversions.found:
        failures.append("NCHW <-> channels-last conversions:\n  " + "\n  ".join(conversions.found))
    check_close("output", ys, yr, 1e-10, failures)
    check_close("input grad", xs.grad, xr.grad, 1e-10, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{name}.grad", p.grad, pr.grad, 1e-10, failures)
    return failures


@pytest.mark.parametrize("world,width", [(3, 44)])  # 15 / 15 / 14 columns: a middle rank
def test_channels_last_sharded_model_equals_one_device(dist_pool, world, width):
    failures = dist_pool.run(world, _sharded_equals_one_device, world, width)[0]
    assert not failures, "\n".join(failures)
