"""The user API of ``spconv_train.parallel`` and the op-author API of
``spconv_train.parallel.extend`` (nothing else from the package): the per-pixel handler of
docs/extending.md (``register_handler``) and a halo layer built on the lower-level
``plan_window`` / ``gather_window`` (``register_spatial_module``), both against one device
in fp64, forward and every gradient; the runtime's options and stats; ``parallelize``
refusing before it changes anything. ``tests/test_extend_example.py`` runs the page's
``halo_window`` example."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, current_runtime, parallelize, runtime_of
from spconv_train.parallel.extend import (
    enter,
    gather_window,
    leave,
    plan_window,
    refuse_module,
    register_handler,
    register_spatial_module,
    spatial_layout,
    sum_grad_over,
)
from tests.dist_harness import mesh
from tests.reference import check_close, reference_backward, seeded

TOL = 1e-10

# --- user ops ---------------------------------------------------------------------------------


# 1. A per-pixel op (it mixes channels, never columns), as docs/extending.md shows it.
@register_handler(F.local_response_norm)
def spatial_lrn(input, size, alpha=1e-4, beta=0.75, k=1.0):
    if not isinstance(input, DTensor):
        return F.local_response_norm(input, size, alpha, beta, k)
    x, layout = spatial_layout(input, "F.local_response_norm", tiles=True)
    out = F.local_response_norm(enter(x), size, alpha, beta, k)
    return leave(out, layout, tuple(x.shape))


# 2. A user layer that reads k neighbouring columns, with a learnable kernel.
class WidthSmooth(nn.Module):
    """out[..., j] = sum_i weight[i] * x[..., j + i - k // 2] (zero padding)."""

    def __init__(self, k: int = 5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, k))

    @staticmethod
    def smooth(x, weight, pad_lo: int, pad_hi: int):
        x = F.pad(x, (pad_lo, pad_hi))
        width = x.shape[-1] - weight.numel() + 1
        return sum(w * x[..., i : i + width] for i, w in enumerate(weight))

    def forward(self, x):
        p = self.weight.numel() // 2
        return self.smooth(x, self.weight, p, p)


@register_spatial_module(WidthSmooth)
class SpatialWidthSmooth(WidthSmooth):
    def forward(self, x):
        if not isinstance(x, DTensor):
            return super().forward(x)
        x, layout = spatial_layout(x, "WidthSmooth")
        k = self.weight.numel()
        width = x.shape[layout.dim]
        # the window op's geometry: kernel k, stride 1, dilation 1, padding k//2 each side
        plan = plan_window("WidthSmooth", width, layout.sp_size, k, 1, 1, k // 2, k // 2)
        window = gather_window(enter(x), plan, layout.sp_rank, layout.sp_group)
        weight = sum_grad_over(self.weight, layout.grad_groups)
        out = self.smooth(window, weight, 0, 0)  # the halo and edge padding are in the window
        return leave(out, layout, (*x.shape[:-1], plan.out_width))


# --- tests ------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.smooth = WidthSmooth(5)

    def forward(self, x):
        seen.append(current_runtime())
        return self.smooth(F.local_response_norm(self.conv(x), 3))


seen: list = []


def public_api(world: int) -> dict:
    torch.manual_seed(0)
    model = _Net().double()
    x = seeded(1, 2, 3, 6, 3 * world + 1, dtype=torch.float64)
    ref, xr, yr, g = reference_backward(model, x, 2)

    dmesh = mesh(world)
    par = parallelize(copy.deepcopy(model), dmesh, save_windows_by_reference=False)
    runtime = runtime_of(par)
    seen.clear()
    xs = distribute_tensor(x.clone(), dmesh, [Shard(3)]).requires_grad_()
    ys = par(xs)
    ys.backward(distribute_tensor(g, dmesh, [Shard(3)]))
    failures: list[str] = []
    check_close("output", ys, yr, TOL, failures)
    check_close("input grad", xs.grad, xr.grad, TOL, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{name}.grad", p.grad, pr.grad, TOL, failures)
    return {
        "failures": failures,
        "type": type(par.smooth).__name__,
        "current_was_mine": seen == [runtime],
        "outside": current_runtime() is not runtime,
        "save_windows": runtime.options.save_windows_by_reference,
        "halo_bytes": runtime.stats.halo_bytes,
        "halo_messages": runtime.stats.halo_messages,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_user_ops_through_public_api(dist_pool, world):
    for r, res in enumerate(dist_pool.run(world, public_api, world)):
        assert not res["failures"], "\n".join(res["failures"])
        assert res["type"] == "SpatialWidthSmooth"
        assert res["current_was_mine"] and res["outside"]
        assert res["save_windows"] is False
        # forward and backward halos of the conv (1 column) and the smoother (2 columns)
        # to each neighbour: an inner rank exchanges with two, an edge rank with one
        neighbours = 1 if r in (0, world - 1) else 2
        assert res["halo_messages"] == 2 * 2 * neighbours, res
        assert res["halo_bytes"] > 0


class _FakeMesh:  # parallelize reads only ndim / names before it swaps anything
    ndim = 1
    mesh_dim_names = ("sp",)


class _Refused(nn.Module):
    """Stands for a layer a user declares non-shardable."""

    def forward(self, x):
        return x


refuse_module(_Refused, "it mixes every column of the image")


def test_parallelize_refuses_before_changing_anything():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(_Refused()))
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SpatialShardingError) as info:
        parallelize(model, _FakeMesh())
    assert "2.0 (_Refused): it mixes every column" in str(info.value)
    assert [type(m) for m in model.modules()] == classes  # no class swapped
    assert not hasattr(model, "spatial_runtime")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="was not parallelized"):
        runtime_of(model)


def test_parallelize_options_are_checked():
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    with pytest.raises(TypeError, match="save_windows_by_referenc.*valid"):
        parallelize(model, _FakeMesh(), save_windows_by_referenc=False)
    assert type(model[0]) is nn.Conv2d  # refused before anything changed
    par = parallelize(model, _FakeMesh(), allow_gather=True)
    assert runtime_of(par).options.allow_gather is True
    assert runtime_of(par).options.save_windows_by_reference is True
    # a deep copy gets its own runtime (own stats), sharing the default handlers
    twin = copy.deepcopy(par)
    assert runtime_of(twin) is not runtime_of(par)
    assert runtime_of(twin).registry.handler(F.local_response_norm) is spatial_lrn
    # a handler registered on one model's runtime stays with that model

    def mine(x):
        return x

    runtime_of(par).registry.register(torch.atan)(mine)
    assert runtime_of(par).registry.handler(torch.atan) is mine
    assert runtime_of(twin).registry.handler(torch.atan) is None
    assert current_runtime().registry.handler(torch.atan) is None
