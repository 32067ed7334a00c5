"""More 3-D ops on an NCDHW volume sharded along D, H or W against one device (fp64: forward,
input gradient, no activation gather): the ``nn.Upsample`` modules (the ``F.interpolate``
grid is ``tests/test_resize_grid.py``), ``F.pad`` and the ``*Pad3d`` modules, adaptive 3-D
pools, and ``unet3d`` with ``up="bilinear"`` (trilinear up-sampling)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded


def _volume(seed: int, world: int, dim: int, base=(4, 5, 6), extra: int = 1) -> torch.Tensor:
    """A small fp64 volume whose sharded ``dim`` is uneven over ``world`` ranks."""
    shape = list(base)
    shape[dim - 2] = 3 * world + extra
    return seeded(seed, 1, 2, *shape, dtype=torch.float64)


# ---------------------------------------------------------------- F.interpolate


def upsample3d_modules(world: int) -> list[str]:
    """``nn.Upsample`` on a volume after ``parallelize``; an unsupported mode is refused."""
    dmesh = mesh(world)
    failures: list[str] = []
    x = _volume(5, world, 4)
    for m in (nn.Upsample(scale_factor=2, mode="trilinear"), nn.Upsample(size=(3, 8, 5))):
        check_module(nn.Sequential(m), x, dmesh, [Shard(4)], f"{m} Shard(4)", failures)

    # pooled to one plane along W (Replicate on sp), then resized and padded locally
    def pooled(t):
        y = F.interpolate(F.adaptive_avg_pool3d(t, (2, 2, 1)), scale_factor=2, mode="trilinear")
        return F.pad(y, (1, 1, 0, 1, 1, 0), mode="replicate")

    check_fn(pooled, x, dmesh, [Shard(4)], "global pool + interpolate + pad", failures)
    area = lambda t: F.interpolate(t, size=(3, 2, 4), mode="area")  # noqa: E731
    check_fn(area, x, dmesh, [Shard(4)], "interpolate area Shard(4)", failures)
    xs = distribute_tensor(x, dmesh, [Shard(4)])
    with pytest.raises(SpatialShardingError, match="bicubic"), SpatialMode():
        F.interpolate(xs, scale_factor=2, mode="bicubic")
    return failures


def test_upsample3d_modules(dist_pool):
    failures = dist_pool.run(3, upsample3d_modules, 3)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- F.pad and *Pad3d


def _pad_cases() -> dict:
    return {
        "constant 1.5": dict(pad=(1, 2, 0, 1, 2, 1), value=1.5),
        "constant negative": dict(pad=(-1, 2, 1, -2, -1, 3)),
        "constant W only": dict(pad=(2, -1)),
        "constant C too": dict(pad=(1, 0, 0, 1, 1, 0, 1, 2), value=-2.0),
        "reflect": dict(pad=(2, 1, 1, 2, 2, 1), mode="reflect"),
        "replicate": dict(pad=(1, 3, 2, 0, 3, 1), mode="replicate"),
        "circular": dict(pad=(2, 1, 1, 2, 1, 2), mode="circular"),
        "circular negative": dict(pad=(-1, 2, 2, -1, 1, -1), mode="circular"),
    }


def _pad_modules() -> list[nn.Module]:
    return [
        nn.ZeroPad3d((1, 2, 0, 1, 2, 0)),
        nn.ConstantPad3d(2, 0.5),
        nn.ReflectionPad3d((1, 2, 2, 1, 1, 2)),
        nn.ReplicationPad3d((2, 0, 1, 1, 0, 2)),
        nn.CircularPad3d(1),
    ]


def pad3d_grid(world: int) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for j, (label, kw) in enumerate(_pad_cases().items()):
        for dim in (2, 3, 4):
            x = _volume(20 + j, world, dim, extra=1 + (j + dim) % 2)
            fn = lambda t, kw=kw: F.pad(t, **kw)  # noqa: E731
            check_fn(fn, x, dmesh, [Shard(dim)], f"F.pad {label} Shard({dim})", failures)
    for j, m in enumerate(_pad_modules()):
        dim = (j + world + 1) % 3 + 2
        x = _volume(40 + j, world, dim)
        check_module(nn.Sequential(m), x, dmesh, [Shard(dim)], f"{m} Shard({dim})", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pad3d_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, pad3d_grid, world)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- adaptive 3-D pools


def _adaptive_cases() -> dict:
    avg, mx = F.adaptive_avg_pool3d, F.adaptive_max_pool3d
    return {
        "avg 1 (global)": (avg, 1),
        "avg (3, 2, 4)": (avg, (3, 2, 4)),
        "avg (None, 3, 2)": (avg, (None, 3, 2)),
        "avg (2, 2, 2)": (avg, 2),  # fewer output planes than ranks at 3: a rank gets none
        "avg (5, 4, 3)": (avg, (5, 4, 3)),
        "max 1 (global)": (mx, 1),
        "max (3, 2, 4)": (mx, (3, 2, 4)),
        "max (2, None, 3)": (mx, (2, None, 3)),
        "max (5, 4, 3)": (mx, (5, 4, 3)),
    }


def adaptive3d_grid(world: int) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for j, (label, (pool, size)) in enumerate(_adaptive_cases().items()):
        for dim in (2, 3, 4):
            if world == 4 and (size if isinstance(size, int) else size[dim - 2]) == 2:
                continue  # refused (below): a window reads planes beyond the neighbours
            x = _volume(60 + j, world, dim, extra=1 + (j + dim) % 2)
            fn = lambda t, pool=pool, size=size: pool(t, size)  # noqa: E731
            check_fn(fn, x, dmesh, [Shard(dim)], f"{label} Shard({dim}) {tuple(x.shape)}", failures)
    for j, m in enumerate((nn.AdaptiveAvgPool3d((2, 3, 1)), nn.AdaptiveMaxPool3d(1))):
        dim = (j + world) % 3 + 2
        x = _volume(80 + j, world, dim)
        check_module(nn.Sequential(m), x, dmesh, [Shard(dim)], f"{m} Shard({dim})", failures)
    xs = distribute_tensor(_volume(0, world, 3), dmesh, [Shard(3)])
    with pytest.raises(SpatialShardingError, match="return_indices"), SpatialMode():
        F.adaptive_max_pool3d(xs, 2, return_indices=True)
    if world == 4:  # 13 planes over 4 ranks pooled to 2: rank 1's window reaches rank 3
        refused = pytest.raises(SpatialShardingError, match="adaptive_avg_pool3d.*neighbouring")
        with refused, SpatialMode():
            F.adaptive_avg_pool3d(xs, 2)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_adaptive_pool3d_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, adaptive3d_grid, world)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- unet3d, trilinear up


def unet3d_trilinear(world: int, dim: int, size: int) -> list[str]:
    """``unet3d(up="bilinear")`` (trilinear ``nn.Upsample``, and an ``F.interpolate`` to the
    skip's size when ``size`` is odd) sharded along ``dim`` equals one device."""
    torch.manual_seed(0)
    opts = dict(depth=2, base_width=4, norm="group", group_norm_groups=2, up="bilinear")
    model = create_model("unet3d", num_classes=3, in_channels=1, **opts).double()
    shape = [4, 6, 6]
    shape[dim - 2] = size
    x = seeded(12, 1, 1, *shape, dtype=torch.float64)
    failures: list[str] = []
    label = f"unet3d up=bilinear Shard({dim}) {tuple(x.shape)} world={world}"
    check_module(model, x, mesh(world), [Shard(dim)], label, failures)
    return failures


@pytest.mark.parametrize("world,dim,size", [(2, 2, 9), (3, 4, 12), (2, 3, 10)])
def test_unet3d_trilinear_matches_single_device(dist_pool, world, dim, size):
    failures = dist_pool.run(world, unet3d_trilinear, world, dim, size)[0]
    assert not failures, "\n".join(failures)


def dp_sp_ops3d(world: int) -> list[str]:
    """The new ops on a (dp, sp) = (2, 2) mesh, batch 3 (uneven batch shards), over D."""
    failures: list[str] = []
    dmesh = mesh((2, 2))
    x = seeded(13, 3, 2, 7, 4, 5, dtype=torch.float64)
    fns = {
        "trilinear": lambda t: F.interpolate(t, scale_factor=(1.5, 2, 1), mode="trilinear"),
        "reflect pad": lambda t: F.pad(t, (1, 0, 2, 1, 2, 2), mode="reflect"),
        "adaptive max": lambda t: F.adaptive_max_pool3d(t, (3, 2, 2)),
        "adaptive avg 1": lambda t: F.adaptive_avg_pool3d(t, 1),
    }
    for label, fn in fns.items():
        check_fn(fn, x, dmesh, [Shard(0), Shard(2)], f"dp x sp {label}", failures)
    return failures


def test_ops3d_more_on_dp_sp_mesh(dist_pool):
    failures = dist_pool.run(4, dp_sp_ops3d, 4)[0]
    assert not failures, "\n".join(failures)
