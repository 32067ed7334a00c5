"""Width-sharded Conv2d against the single-process Conv2d, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.reference import compare_module, seeded


def _conv_configs() -> list[dict]:
    """The grid of Conv2d configurations (issue 2, item 3)."""
    cfgs = []
    for k in range(1, 8):
        cfgs.append(dict(kernel_size=k, padding=k // 2))
        cfgs.append(dict(kernel_size=k, padding="same"))
        cfgs.append(dict(kernel_size=k, padding="valid", bias=False))
    for s in (2, 3, 4):
        cfgs.append(dict(kernel_size=3, stride=s, padding=1))
        cfgs.append(dict(kernel_size=s, stride=s))  # patchify
        cfgs.append(dict(kernel_size=5, stride=s, padding=(1, 2)))
    for d in (2, 3):
        cfgs.append(dict(kernel_size=3, dilation=d, padding=d))
        cfgs.append(dict(kernel_size=4, dilation=d, padding="same"))
        cfgs.append(dict(kernel_size=3, dilation=(1, d), stride=2, padding=(0, 3)))
    cfgs.append(dict(kernel_size=7, padding=3, groups=4, out_channels=4))  # depthwise
    cfgs.append(dict(kernel_size=3, padding=1, groups=2, out_channels=6))
    cfgs.append(dict(kernel_size=(3, 5), padding=(1, 0), stride=(1, 2)))
    cfgs.append(dict(kernel_size=2, padding=3))  # padding wider than the kernel
    for mode in ("reflect", "replicate", "circular"):
        cfgs.append(dict(kernel_size=3, padding=1, padding_mode=mode))
        cfgs.append(dict(kernel_size=5, padding=2, stride=2, padding_mode=mode))
        cfgs.append(dict(kernel_size=4, padding="same", padding_mode=mode))
        cfgs.append(dict(kernel_size=3, padding=(2, 3), dilation=2, padding_mode=mode))
    return cfgs


def _make_conv(cfg: dict, seed: int) -> nn.Conv2d:
    cfg = dict(cfg)
    torch.manual_seed(seed)
    return nn.Conv2d(4, cfg.pop("out_channels", 5), **cfg)


def _width_for(conv: nn.Conv2d, world: int) -> int:
    """A width every rank can run at this world size, not divisible by it when world > 1."""
    k, s, d = conv.kernel_size[1], conv.stride[1], conv.dilation[1]
    halo = d * (k - 1) + max(conv._reversed_padding_repeated_twice[:2])
    w = world * s * (halo + 3)
    return w + 1 if world > 1 else w


def conv_grid(world: int, grad_kind: str) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for i, cfg in enumerate(_conv_configs()):
        conv = _make_conv(cfg, seed=i)
        x = seeded(1000 + i, 2, 4, 9, _width_for(conv, world))
        compare_module(conv, x, dmesh, [Shard(3)], grad_kind, f"{cfg} W={x.shape[-1]}", failures)
    return failures


# 2 and 3 ranks (uneven widths) run the code paths 4 ranks would; a Partial upstream
# gradient runs at 2 ranks in test_conv_grad_placements (suite time)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_conv_grid_matches_single_device(dist_pool, world):
    grad_kinds = {1: "shard", 2: "shard", 3: "replicate"}
    failures = dist_pool.run(world, conv_grid, world, grad_kinds[world])[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("grad_kind", ["replicate", "partial"])
def test_conv_grad_placements(dist_pool, grad_kind):
    """grad_output arriving as Replicate or Partial is redistributed before the backward."""
    failures = dist_pool.run(2, conv_grid, 2, grad_kind)[0]
    assert not failures, "\n".join(failures)


def functional_conv(world: int) -> list[str]:
    """F.conv2d called from model code is routed to the spatial convolution too."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(seeded(5, 6, 4, 3, 4))

        def forward(self, x):
            return nn.functional.conv2d(x, self.w, None, 1, "same", 2)

    failures: list[str] = []
    x = seeded(6, 1, 4, 5, 8 * world + 3)
    compare_module(Functional(), x, mesh(world), [Shard(3)], "shard", "F.conv2d", failures)
    return failures


def test_functional_conv2d(dist_pool):
    assert not dist_pool.run(3, functional_conv, 3)[0]


def conv_errors(world: int) -> list[str]:
    """Geometries that cannot run raise a clear error on every rank (no hang)."""
    dmesh = mesh(world)
    messages = []
    cases = [
        (nn.Conv2d(2, 2, 7, padding=3), 8, "narrower than the halo"),  # strips of 2 < halo 3
        (nn.Conv2d(2, 2, 3, padding=1), 5, "empty strip"),  # 2,2,1,0 columns
        (nn.Conv2d(2, 2, 4, stride=4), 12, "empty strip"),  # output width 3 on 4 ranks
    ]
    for conv, width, expected in cases:
        model = parallelize(nn.Sequential(conv), dmesh)
        x = distribute_tensor(seeded(1, 1, 2, 3, width), dmesh, [Shard(3)])
        with pytest.raises(SpatialShardingError) as info:
            model(x)
        msg = str(info.value)
        assert "0 (Conv2d(" in msg, msg  # names the module path
        assert ("narrower" in msg) == (expected == "narrower than the halo"), msg
        assert "parallel.sp" in msg, msg
        messages.append(msg)
    return messages


def test_conv_errors_name_layer_and_fix(dist_pool):
    messages = dist_pool.run(4, conv_errors, 4)[0]
    assert "empty strip" in messages[1] and "width 5" in messages[1]
    assert "output width 3" in messages[2]


def test_parallelize_keeps_state_dict_and_refuses_unsupported():
    """Single process: keys and parameter objects are unchanged; unsupported modules are
    listed with their paths (the mesh is not touched before the check)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    keys = list(model.state_dict())
    params = list(model.parameters())

    class FakeMesh:  # parallelize only reads ndim/names before swapping layers
        ndim = 1
        mesh_dim_names = ("sp",)

    parallelize(model, FakeMesh())
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert "SpatialConv2d" in repr(model)
    # plain tensors still run the ordinary convolution
    x = seeded(3, 1, 3, 8, 8)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), ref(x))

    bad = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.Conv1d(3, 3, 1), nn.Unfold(2)))
    with pytest.raises(SpatialShardingError) as info:
        parallelize(bad, FakeMesh())
    assert "1.0 (Conv1d)" in str(info.value) and "1.1 (Unfold)" in str(info.value)


def test_grid_covers_the_issue():
    cfgs = _conv_configs()
    assert {c["kernel_size"] for c in cfgs if isinstance(c["kernel_size"], int)} == set(range(1, 8))
    assert {c.get("stride", 1) for c in cfgs} >= {1, 2, 3, 4}
    assert {c.get("padding_mode", "zeros") for c in cfgs} == {
        "zeros",
        "reflect",
        "replicate",
        "circular",
    }
    assert any(c.get("groups") == 4 for c in cfgs) and any(c.get("bias") is False for c in cfgs)
    paddings = {c.get("padding") for c in cfgs if isinstance(c.get("padding"), str)}
    assert paddings == {"same", "valid"}
