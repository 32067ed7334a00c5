"""Pooling through every route (the functional forms, ``*_with_indices``, torch.*), on a
(dp, sp) mesh, in a small classifier, its errors, ceil-mode geometry and the module swap;
the op grid over configs, layouts and world sizes is ``tests/test_pool_grid.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from spconv_train.parallel._geometry import window_out_size
from spconv_train.parallel._tiles import ceil_geom
from spconv_train.parallel._window import plan_window
from tests.dist_harness import device, mesh
from tests.reference import check_close, compare_module, grad_dtensor, seeded


def compare_any(model, x, dmesh, placements, want, grad_kind, label, failures, ctx=None):
    """Like ``compare_module`` but the output placements ``want`` may differ from the
    input's (Replicate after global pooling); tuple outputs compare every element."""
    model, x = model.to(device()), x.to(device())  # SPCONV_TEST_DEVICE (tests/dist_harness.py)
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr = yr if isinstance(yr, tuple) else (yr,)
    g = seeded(99, *yr[0].shape).to(x.device)
    yr[0].backward(g)
    par = parallelize(copy.deepcopy(model), dmesh)
    xs = distribute_tensor(x.clone(), dmesh, placements).requires_grad_()
    with ctx or torch.enable_grad():
        ys = par(xs)
        ys = ys if isinstance(ys, tuple) else (ys,)
        for y in ys:
            if not isinstance(y, DTensor) or tuple(y.placements) != tuple(want):
                failures.append(f"{label}: output {getattr(y, 'placements', y)} != {want}")
                return
        ys[0].backward(grad_dtensor(g, dmesh, grad_kind, want))
    for j, (a, b) in enumerate(zip(ys, yr, strict=True)):
        if b.dtype == torch.int64:  # indices: exact
            if not torch.equal(a.full_tensor(), b):
                failures.append(f"{label}: indices differ")
        else:
            check_close(f"{label} output {j}", a, b, 1e-5, failures)
    check_close(f"{label} input grad", xs.grad, xr.grad, 1e-5, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{label} {name}.grad", p.grad, pr.grad, 1e-5, failures)


def _sharded_out(ow: int, world: int) -> bool:
    per = -(-ow // world)
    # every rank gets an output column; a global pool (one column) is Replicate regardless
    return ow > 1 and per * (world - 1) < ow


class _Functional(nn.Module):
    """Model code that calls the functional ops directly (routed by SpatialMode)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


FUNCTIONAL = {
    "F.max_pool2d": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
    "F.max_pool2d indices": lambda x: F.max_pool2d(x, 3, 2, 1, 2, True, True),
    "F.max_pool2d_with_indices": lambda x: F.max_pool2d_with_indices(x, (2, 3), None, (1, 1)),
    "torch.max_pool2d": lambda x: torch.max_pool2d(x, 2, 2, 1),
    "F.avg_pool2d": lambda x: F.avg_pool2d(x, 3, 2, 1, True, False),
    "F.avg_pool2d override": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    "F.adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (None, 5)),
    "F.adaptive_avg_pool2d 1": lambda x: F.adaptive_avg_pool2d(x, 1),
    "F.adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, (2, 6)),
    "F.adaptive_max_pool2d indices": lambda x: F.adaptive_max_pool2d(x, (3, 1), True),
    "F.adaptive_max_pool2d_with_indices": lambda x: F.adaptive_max_pool2d_with_indices(x, 6),
}


def functional_and_2d_mesh(world: int) -> list[str]:
    failures: list[str] = []
    x = seeded(3, 2, 3, 7, 8 * world + 3)
    for name, fn in FUNCTIONAL.items():
        out = fn(x)
        ow = (out[0] if isinstance(out, tuple) else out).shape[-1]
        want = [Shard(3)] if "adaptive" not in name or _sharded_out(ow, world) else [Replicate()]
        compare_any(_Functional(fn), x, mesh(world), [Shard(3)], want, "shard", name, failures)
    mod = nn.MaxPool2d((2, 3), 2, 1, dilation=(1, 2), return_indices=True, ceil_mode=True)
    compare_any(mod, x, mesh(world), [Shard(3)], [Shard(3)], "partial", "indices", failures)
    if world == 4:  # width 5: strips of 2, 2, 1 and 0 columns; global pooling still works
        x5 = seeded(5, 2, 3, 4, 5)
        for mod in (nn.AdaptiveAvgPool2d(1), nn.AdaptiveMaxPool2d((2, 3), return_indices=True)):
            compare_any(mod, x5, mesh(4), [Shard(3)], [Replicate()], "shard", f"W=5 {mod}",
                        failures)  # fmt: skip
    if world == 4:  # (dp, sp) mesh: batch sharded, width sharded; Replicate only on sp
        dm, pl = mesh((2, 2)), [Shard(0), Shard(3)]
        x = seeded(4, 4, 3, 5, 11)
        for mod in (nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.AvgPool2d(3, 2, 1, True, False)):
            compare_module(mod, x, dm, pl, "partial", f"2-D {mod}", failures)
        for size, want in ((1, [Shard(0), Replicate()]), ((2, 4), pl)):
            for mod in (nn.AdaptiveAvgPool2d(size), nn.AdaptiveMaxPool2d(size)):
                compare_any(mod, x, dm, pl, want, "replicate", f"2-D {mod}", failures)
    return failures


def test_functional_paths_and_2d_mesh(dist_pool):
    failures = dist_pool.run(4, functional_and_2d_mesh, 4)[0]
    assert not failures, "\n".join(failures)
    failures = dist_pool.run(3, functional_and_2d_mesh, 3)[0]
    assert not failures, "\n".join(failures)


def small_model(world: int) -> list[str]:
    """conv -> maxpool -> conv -> global avg pool -> flatten -> linear, as a classifier head.

    The Linear sees a Replicate DTensor and a plain-tensor weight; the spatial ``linear``
    handler runs it locally, so its weight gradient is a plain tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(4, 5, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3),
    )  # fmt: skip
    failures: list[str] = []
    x = seeded(8, 2, 3, 6, 8 * world + 3)
    for kind in ("replicate", "partial"):
        compare_any(model, x, mesh(world), [Shard(3)], [Replicate()], kind, f"model {kind}",
                    failures)  # fmt: skip
    if world == 4:
        x = seeded(9, 4, 3, 6, 13)
        compare_any(model, x, mesh((2, 2)), [Shard(0), Shard(3)], [Shard(0), Replicate()],
                    "replicate", "2-D model", failures)  # fmt: skip
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_small_model_with_global_pool_and_linear(dist_pool, world):
    failures = dist_pool.run(world, small_model, world)[0]
    assert not failures, "\n".join(failures)


def pool_errors(world: int) -> list[str]:
    dmesh, messages = mesh(world), []
    for mod, width in ((nn.MaxPool2d(7, 1, 3), 8), (nn.AvgPool2d(2), 5)):
        model = parallelize(nn.Sequential(mod), dmesh)
        with pytest.raises(SpatialShardingError) as info:
            model(distribute_tensor(seeded(1, 1, 2, 3, width), dmesh, [Shard(3)]))
        assert "0 (" in str(info.value) and "parallel.sp" in str(info.value), info.value
        messages.append(str(info.value))
    with pytest.raises(RuntimeError, match="pad should be at most half"):
        parallelize(nn.Sequential(nn.MaxPool2d(2, 2, 2)), dmesh)(
            distribute_tensor(seeded(1, 1, 2, 3, 16), dmesh, [Shard(3)])
        )
    return messages


def test_errors_are_clear(dist_pool):
    messages = dist_pool.run(4, pool_errors, 4)[0]
    assert "narrower" in messages[0] and "empty strip" in messages[1]


def test_ceil_mode_geometry_matches_torch():
    """Single process: output widths of the ceil-mode plan equal torch's, for many sizes
    (including windows that start inside the input next to the right padding)."""
    for width in range(4, 30):
        for k in range(1, 6):
            for s in range(1, 5):
                for d in (1, 2):
                    for p in range(0, k // 2 + 1):
                        meta = torch.empty(1, 1, 1, width, device="meta")
                        if width + 2 * p < d * (k - 1) + 1:
                            continue
                        want = F.max_pool2d(meta, (1, k), (1, s), (0, p), (1, d), True, True)[
                            0
                        ].shape[-1]
                        got = window_out_size(width, k, s, d, p, p, True)
                        assert got == want, (width, k, s, d, p)
                        if (
                            width >= 4 * (d * (k - 1) + p + s)
                            and _sharded_out(width, 4)
                            and _sharded_out(want, 4)
                        ):
                            wp = plan_window("t", width, 4, *ceil_geom(width, k, s, d, p, True))
                            assert wp.out_width == want


def test_parallelize_swaps_pools_and_keeps_plain_forward():
    """Single process: the pools become their spatial classes, plain tensors still work."""
    model = nn.Sequential(nn.MaxPool2d(2), nn.AvgPool2d(3, 1, 1), nn.AdaptiveAvgPool2d(2),
                          nn.AdaptiveMaxPool2d(1))  # fmt: skip
    ref = copy.deepcopy(model)

    class FakeMesh:
        ndim = 1
        mesh_dim_names = ("sp",)

    parallelize(model, FakeMesh())
    for name in ("SpatialMaxPool2d", "SpatialAvgPool2d", "SpatialAdaptiveAvgPool2d",
                 "SpatialAdaptiveMaxPool2d"):  # fmt: skip
        assert name in repr(model)
    x = seeded(2, 1, 2, 8, 8)
    torch.testing.assert_close(model(x), ref(x))
