"""Sharded normalisation on torch's fused kernels: bf16 inputs with fp32 statistics and
affine (autocast's case) against the plain layer, which path each dtype takes, and how many
activation-sized tensors one batch norm forward + backward writes next to torch's own."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.parallel import parallelize
from tests.dist_harness import device, mesh
from tests.reference import compare_module, seeded

C = 6


def _input(seed: int, n: int, w: int, dtype, channels_last: bool) -> torch.Tensor:
    """Channels with large, different means and scales (as in tests/test_norm.py)."""
    shift = torch.linspace(-4.0, 9.0, C).view(1, C, 1, 1)
    scale = torch.linspace(3.0, 0.2, C).view(1, C, 1, 1)
    x = (shift + scale * seeded(seed, n, C, 5, w)).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _affine(model: nn.Module, seed: int) -> nn.Module:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(seeded(seed + i, *p.shape) * 0.5 + (1.0 if i % 2 == 0 else 0.0))
    return model


def mixed_precision_cases(world: int) -> list[str]:
    """fp32-parameter norms fed bf16 (as under autocast), sharded over uneven strips,
    against the plain layer on the same input (a distance of bf16 rounding's order)."""
    dmesh, failures = mesh(world), []
    layers = (nn.BatchNorm2d(C), nn.GroupNorm(3, C), nn.InstanceNorm2d(C, affine=True))
    layers += (nn.BatchNorm2d(C, affine=False),)
    for i, layer in enumerate(layers):
        x = _input(i, 2, 3 * world + 2, torch.bfloat16, i == 3)
        tag = f"{type(layer).__name__} bf16"
        compare_module(_affine(layer, 10 + i), x, dmesh, [Shard(3)], "shard", tag, failures, 3e-2)
    return failures


def test_mixed_precision_matches_plain_layers(dist_pool):
    failures = dist_pool.run(3, mixed_precision_cases, 3)[0]
    assert not failures, "\n".join(failures)


class _Written(TorchDispatchMode):
    """Counts the non-view ops that write a tensor of at least ``size`` elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.ops = size, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        big = any(isinstance(o, torch.Tensor) and o.numel() >= self.size for o in outs)
        if big and not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return out


def _written(model, x, dy, size: int) -> collections.Counter:
    model(x).backward(dy)  # warm-up (probes, caches)
    with _Written(size) as counter:
        model(x).backward(dy)
    return counter.ops


def written_counts(world: int) -> list[tuple[str, int, int, int]]:
    """(case, activation-sized writes of the sharded layer, of torch's own layer on the same
    local part, expected extra) for one BatchNorm2d forward + backward."""
    from spconv_train.parallel._norm_stats import _kernel_stats

    dmesh, rows = mesh(world), []
    for dtype, cl in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)):
        layer = _affine(nn.BatchNorm2d(C), 3).to(device())
        x = _input(1, 2, 4 * world, dtype, cl).to(device())
        if dtype != torch.float32 and x.device.type != "cpu" and not cl:
            continue  # the composed path (``_norm_stats._fused``)
        fmt = torch.channels_last if cl else torch.contiguous_format
        # the local parts in the input's layout (distribute_tensor's are contiguous)
        parts = [distribute_tensor(t, dmesh, [Shard(3)]).to_local() for t in (x, x.clone())]
        local, dy = (t.contiguous(memory_format=fmt) for t in parts)
        xs = DTensor.from_local(local.clone(), dmesh, [Shard(3)]).requires_grad_()
        key = (x.device.type, dtype, cl)
        dys = DTensor.from_local(dy, dmesh, [Shard(3)])
        local.requires_grad_()
        size = local.numel()
        par = _written(parallelize(copy.deepcopy(layer), dmesh), xs, dys, size)
        plain = _written(layer, local, dy, size)
        # dx is an inference-form batch_norm plus an addcmul (one write more than torch's
        # fused backward); in bf16 on CPU both in fp32 and rounded once (the casts of x and
        # dy, the fp32 dx and its cast: four more), on CUDA SyncBatchNorm's dx kernel (one;
        # an NCHW bf16 input composes there); the two-pass moments write two more
        # (deviations, squares)
        extra = 1 if dtype == torch.float32 or x.device.type != "cpu" else 4
        extra += 0 if _kernel_stats(*key) else 2
        rows.append(
            (
                f"{dtype} channels_last={cl} {dict(par)} vs {dict(plain)}",
                sum(par.values()),
                sum(plain.values()),
                extra,
            )
        )
    return rows


def test_batch_norm_writes_like_torch(dist_pool):
    """The composed bf16 path writes ~16 activation-sized tensors (fp32 casts, sub, mul,
    add, ...) per forward + backward where torch's own writes 3 (with the input gradient's
    accumulation); the fused one 1-4 more (3 with the two-pass moments of contiguous fp32)."""
    for case, par, plain, extra in dist_pool.run(2, written_counts, 2)[0]:
        assert par <= plain + extra, f"{case}: {par} writes vs torch's {plain} (+{extra})"


def test_fused_paths_per_dtype():
    """bf16/fp16 inputs with fp32 statistics take the fused kernels on CPU (torch's
    mixed-dtype batch norm), only per-channel statistics do; fp64 moments stay two-pass."""
    from spconv_train.parallel._norm_stats import _Cells, _fused, _kernel_stats

    batch, group = _Cells("batch", C, C, 10, ()), _Cells("group", C, 2, 10, ())
    x64, w64 = torch.zeros(1, C, 2, 2, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    mean32 = torch.zeros(1, C)
    assert _fused(x64, w64, w64, mean32.double(), batch)
    assert _fused(x64, None, None, mean32.double(), batch)
    assert not _fused(x64, w64, w64, mean32.double(), group)
    for low in (torch.bfloat16, torch.float16):
        assert _fused(x64.to(low), w64.float(), None, mean32, batch)
        assert _fused(x64.to(low), w64.to(low), None, mean32, batch)  # affine cast up
        assert _kernel_stats("cpu", low, False) and _kernel_stats("cpu", low, True)
    assert not _fused(x64.float(), None, None, mean32.double(), batch)  # fp32 input, fp64 stats
    assert not _kernel_stats("cpu", torch.float64, True)


@pytest.mark.parametrize("dtype, cl", [(torch.bfloat16, False), (torch.float32, True)])
def test_kernel_moments_match_two_pass(dtype, cl):
    """The one-kernel moments (batch, group and instance cells) against fp64 two-pass ones."""
    from spconv_train.parallel._norm_stats import _Cells, _local_moments

    x = _input(4, 3, 7, dtype, channels_last=cl)
    for cells in (
        _Cells("batch", C, C, 105, ()),
        _Cells("group", C, 3, 70, ()),
        _Cells("instance", C, C, 35, ()),
    ):
        n, mean, m2 = _local_moments(x, cells)
        groups = x.double().reshape(3, cells.num_groups, -1)
        if cells.kind == "batch":
            groups = x.double().transpose(0, 1).reshape(C, -1)  # batch statistics: flat
        var, want = torch.var_mean(groups, -1, correction=0)
        assert n == groups.shape[-1] and mean.dtype == torch.float32
        torch.testing.assert_close(mean.double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m2.double() / n, var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dtype, cl",
    [
        (torch.bfloat16, True),
        (torch.bfloat16, False),
        (torch.float32, True),
        (torch.float32, False),
    ],
)
def test_backward_kernel_pieces_on_device(dtype, cl):
    """The fused backward's pieces on the harness device (CUDA under ``SPCONV_TEST_DEVICE=cuda``)
    against fp64: the local sums ``sum(dy * xhat)``, ``sum(dy)`` (fp32-exact) and ``dx`` from
    the global sums, with ``dy`` close to its projection on ``xhat`` (the terms of ``dx``
    cancel): a bf16 ``dx`` as far from fp64 as one rounding of the exact value (the sum of
    two rounded terms was 40x farther). CUDA's bf16 sums are exact on channels-last only, so
    an NCHW bf16 input takes the composed path there."""
    from spconv_train.parallel._norm_stats import _affine_sums, _Cells, _dx, _fused

    dev = device()
    x = _input(5, 2, 9, dtype, channels_last=cl).to(dev)
    var, mean = torch.var_mean(x.double(), (0, 2, 3), correction=0)
    fused = _fused(x, None, None, mean.float(), _Cells("batch", C, C, 10, ()))
    assert fused == (dtype == torch.float32 or cl or dev.type == "cpu")
    if not fused:
        return
    stats = (mean.float(), var.float())
    invstd32 = torch.rsqrt(stats[1] + 1e-5)
    w32 = seeded(7, C).float().to(dev) + 1.0
    # the statistics as the kernels get them (fp32): their rounding is no error
    mean, invstd, w = stats[0].double(), invstd32.double(), w32.double()
    view = (1, C, 1, 1)
    xhat = (x.double() - mean.view(view)) * invstd.view(view)
    dy = (30 * xhat + seeded(6, *x.shape).double().to(dev)).to(dtype)
    dy = dy.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    gw, gb = _affine_sums(dy, x, w32, stats, invstd32, 1e-5)
    sums = torch.stack([(dy.double() * xhat).sum((0, 2, 3)), dy.double().sum((0, 2, 3))])
    assert gw.dtype == torch.float32
    got = torch.stack([gw, gb]).double()
    torch.testing.assert_close(got, sums, rtol=1e-5, atol=1e-5 * sums.abs().max().item())
    n = x.numel() // C
    dx = _dx(dy, x, w32, stats, invstd32, (gw, gb), n, 1e-5)
    a = (invstd * w).view(view)
    want = a * (dy.double() - sums[1].view(view) / n - xhat * sums[0].view(view) / n)
    assert dx.dtype == dtype

    def distance(t: torch.Tensor) -> float:
        return ((t.double() - want).norm() / want.norm()).item()

    bound = 2 * distance(want.to(dtype)) if dtype == torch.bfloat16 else 1e-5
    assert distance(dx) <= bound, (distance(dx), distance(want.to(dtype)))
