"""Width-sharded BatchNorm2d / GroupNorm / InstanceNorm2d against single-device torch:
outputs, input and parameter gradients, and running statistics after several steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, compare_module, seeded

C = 6
GRAD_KINDS = ("shard", "replicate", "partial")


def _input(seed: int, n: int, w: int, h: int = 5) -> torch.Tensor:
    """Channels with large, different means and scales: naive E[x^2] - E[x]^2 variances
    lose digits here."""
    shift = torch.linspace(-4.0, 9.0, C).view(1, C, 1, 1)
    scale = torch.linspace(3.0, 0.2, C).view(1, C, 1, 1)  # the largest mean, the least spread
    return shift + scale * seeded(seed, n, C, h, w)


def _randomize_affine(model: nn.Module, seed: int) -> nn.Module:
    """Non-trivial weight and bias (the defaults ones/zeros hide mistakes)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(seeded(seed + i, *p.shape) * 0.5 + (1.0 if i % 2 == 0 else 0.0))
    return model


def _norm_models() -> list[tuple[str, nn.Module, int]]:
    """(label, model, number of training steps before an eval-mode check)."""
    cases: list[tuple[str, nn.Module, int]] = []
    for momentum in (0.1, None):
        for affine in (True, False):
            bn = nn.BatchNorm2d(C, momentum=momentum, affine=affine)
            cases.append((f"BatchNorm2d(momentum={momentum}, affine={affine})", bn, 2))
    untracked = nn.BatchNorm2d(C, track_running_stats=False)  # batch statistics in eval too
    cases.append(("BatchNorm2d(track_running_stats=False)", untracked, 1))
    for groups, affine in ((1, True), (2, False), (3, True), (6, True), (3, False)):
        gn = nn.GroupNorm(groups, C, affine=affine)
        cases.append((f"GroupNorm({groups}, affine={affine})", gn, 1))
    for affine in (True, False):
        for track in (True, False):
            momentum = 0.3 if affine else None  # None: running statistics stay as they are
            inorm = nn.InstanceNorm2d(
                C, affine=affine, track_running_stats=track, momentum=momentum
            )
            cases.append((f"InstanceNorm2d(affine={affine}, track={track}, {momentum})", inorm, 2))
    return cases


class _Functional(nn.Module):
    """Model code calling the functional forms (and torch.* with its own argument order),
    as parallel branches: stacked norms would be invariant to the earlier affine scales,
    whose gradients would then be rounding noise."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(seeded(7, 3, C) + 1)
        self.b = nn.Parameter(seeded(8, 3, C))
        self.register_buffer("rm", seeded(9, 2, C))
        self.register_buffer("rv", seeded(10, 2, C).abs() + 0.5)

    def forward(self, x):
        F, w, b, rm, rv = nn.functional, self.w, self.b, self.rm, self.rv
        y = F.batch_norm(x, rm[0], rv[0], w[0], b[0], training=True, momentum=0.2)
        y = y + F.group_norm(x, 3, w[1], eps=1e-3)
        y = y + F.instance_norm(x, weight=w[2], bias=b[2]) * 2.0
        y = y + torch.batch_norm(x, w[2], None, rm[1], rv[1], True, 0.1, 1e-5, False)
        # torch's own backward of ``instance_norm`` with a bias and no weight fails on CUDA
        # ("tensor does not have a device"; torch 2.11, H200): a weight of ones there
        wi = None if x.device.type == "cpu" else torch.ones_like(b[1])
        return y + torch.instance_norm(x, wi, b[1], None, None, True, 0.1, 1e-5, False)


def _buffers_check(label, par, ref, failures) -> list[torch.Tensor]:
    for (name, b), (_, br) in zip(par.named_buffers(), ref.named_buffers(), strict=True):
        if b.dtype == torch.long:
            if not torch.equal(b, br):
                failures.append(f"{label} {name}: {b.tolist()} != {br.tolist()}")
        else:
            check_close(f"{label} {name}", b, br, 1e-5, failures)
    return [b.clone() for b in par.buffers()]


def _run_case(label, model, steps, dmesh, placements, n, w, seed, failures) -> list:
    """``steps`` training steps then one eval step, each compared with torch; returns the
    sharded model's buffers after every step (to check they agree across ranks)."""
    buffers: list[torch.Tensor] = []
    kinds = [GRAD_KINDS[(seed + i) % 3] for i in range(steps + 1)]
    for step in range(steps + 1):
        model.train(step < steps)
        mode = "train" if step < steps else "eval"
        x = _input(seed * 10 + step, n, w)
        tag = f"{label} {mode} step {step} W={w} grad={kinds[step]}"
        par, ref = compare_module(model, x, dmesh, placements, kinds[step], tag, failures)
        buffers += _buffers_check(tag, par, ref, failures)
        model = ref
        model.zero_grad(set_to_none=True)
    return buffers


def norm_grid(world: int, shape: tuple[int, ...], n: int, widths: tuple[int, ...]) -> tuple:
    """Every norm case on ``mesh(shape)``; returns (failures, buffers) for this rank."""
    dmesh = mesh(shape if len(shape) > 1 else shape[0])
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    failures: list[str] = []
    buffers: list[torch.Tensor] = []
    for w in widths:
        for i, (label, model, steps) in enumerate(_norm_models()):
            model = _randomize_affine(model, seed=100 + i)
            buffers += _run_case(label, model, steps, dmesh, placements, n, w, i, failures)
        buffers += _run_case("functional", _Functional(), 1, dmesh, placements, n, w, 50, failures)
    return failures, buffers


def _assert_grid(results: list) -> None:
    failures = results[0][0]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    ref_buffers = results[0][1]
    for rank, (_, buffers) in enumerate(results[1:], start=1):
        for i, (b, b0) in enumerate(zip(buffers, ref_buffers, strict=True)):
            assert torch.equal(b, b0), f"buffer {i} differs between rank 0 and rank {rank}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_norms_match_single_device(dist_pool, world):
    """Uneven strips (and at world 4, an empty strip: width 5 -> 2, 2, 1, 0 columns)."""
    widths = (4 * world + 1,) if world < 4 else (13, 5)
    _assert_grid(dist_pool.run(world, norm_grid, world, (world,), 2, widths))


@pytest.mark.parametrize("batch", [4, 3])
def test_norms_on_dp_sp_mesh(dist_pool, batch):
    """(dp, sp) = (2, 2) mesh, [Shard(0), Shard(3)]: batch statistics over both dimensions,
    group/instance statistics over sp only (batch 3: uneven batch shards 2 + 1)."""
    _assert_grid(dist_pool.run(4, norm_grid, 4, (2, 2), batch, (7,)))


def norm_low_precision(world: int) -> list[str]:
    """bf16 batch norm (fp32 statistics, a bf16 input and affine) and an fp32 one, against
    the plain layer in the same dtype."""
    dmesh = mesh(world)
    failures: list[str] = []
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        model = _randomize_affine(nn.BatchNorm2d(C), seed=7).to(dtype)
        x = _input(3, 2, 4 * world + 3).to(dtype)
        compare_module(model, x, dmesh, [Shard(3)], "shard", f"{dtype}", failures, tol)
    return failures


def test_batch_norm_low_precision(dist_pool):
    failures = dist_pool.run(2, norm_low_precision, 2)[0]
    assert not failures, "\n".join(failures)


def norm_errors(world: int) -> list[str]:
    """Clear errors, raised on every rank, for what cannot run."""
    dmesh = mesh(world)
    x = distribute_tensor(_input(1, 2, 9), dmesh, [Shard(3)])
    messages = []
    model = parallelize(nn.Sequential(nn.LayerNorm([5, 9])), dmesh)
    with pytest.raises(SpatialShardingError) as info:
        model(x)
    messages.append(str(info.value))
    model = parallelize(nn.Sequential(nn.BatchNorm2d(C)), dmesh)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(distribute_tensor(_input(2, 1, 1, h=1), dmesh, [Shard(3)]))
    return messages


def test_norm_errors(dist_pool):
    messages = dist_pool.run(2, norm_errors, 2)[0]
    assert "layer_norm" in messages[0]


def test_parallelize_swaps_norm_layers():
    """Spatial classes replace the norms in place; state_dict keys are unchanged; plain
    tensors still run the ordinary layers."""
    model = nn.Sequential(
        nn.BatchNorm2d(C), nn.GroupNorm(2, C), nn.InstanceNorm2d(C, affine=True),
        nn.SyncBatchNorm(C),
    )  # fmt: skip
    ref = _randomize_affine(model, 3)
    keys = list(ref.state_dict())

    class FakeMesh:
        ndim = 1
        mesh_dim_names = ("sp",)

    par = parallelize(copy.deepcopy(ref), FakeMesh())
    assert list(par.state_dict()) == keys
    names = [type(m).__name__ for m in par]
    assert names == [
        "SpatialBatchNorm2d", "SpatialGroupNorm", "SpatialInstanceNorm2d", "SpatialSyncBatchNorm"
    ]  # fmt: skip
    x = _input(4, 2, 7)
    ref.eval()  # SyncBatchNorm trains only in a process group; eval runs on one process
    par.eval()
    torch.testing.assert_close(par(x), ref(x))
