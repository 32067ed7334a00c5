"""Width-sharded Conv2d: upstream gradients of every placement, errors that name the layer,
and the module swap (the conv grid over every layout: tests/test_conv_grid.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.reference import compare_module, seeded

#: one config per conv path: whole strip ("same"), interior + edges (strided), window (reflect)
GRAD_CONFIGS = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
]


def grad_placements(world: int) -> list[str]:
    """A gradient arriving as Replicate or Partial is redistributed before the backward
    (the conv grid, tests/test_conv_grid.py, sends Shard gradients)."""
    dmesh = mesh(world)
    failures: list[str] = []
    for grad_kind in ("replicate", "partial"):
        for i, cfg in enumerate(GRAD_CONFIGS):
            torch.manual_seed(i)
            conv = nn.Conv2d(4, 5, **cfg)
            x = seeded(1000 + i, 2, 4, 9, 8 * world + 1)
            compare_module(conv, x, dmesh, [Shard(3)], grad_kind, f"{cfg} {grad_kind}", failures)
    return failures


def test_conv_grad_placements(dist_pool):
    failures = dist_pool.run(2, grad_placements, 2)[0]
    assert not failures, "\n".join(failures)


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

    bad = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.LocalResponseNorm(2), nn.Fold(4, 2)))
    with pytest.raises(SpatialShardingError) as info:
        parallelize(bad, FakeMesh())
    assert "1.0 (LocalResponseNorm)" in str(info.value) and "1.1 (Fold)" in str(info.value)
