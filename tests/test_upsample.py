"""Width-sharded ConvTranspose2d against the single-process op, the functional and (dp, sp)
paths, and interpolation's index tables, routes and refusals (the interpolation grid over
modes, layouts and world sizes is ``tests/test_resize_grid.py``)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, current_runtime, parallelize
from spconv_train.parallel._conv import plan_conv_transpose
from spconv_train.parallel._interpolate import _apply, _local_table, resize_sizes
from tests.dist_harness import mesh
from tests.meshes import each_mesh
from tests.op_check import check_module
from tests.reference import compare_module, seeded

GRAD_KINDS = {1: "shard", 2: "replicate", 3: "shard", 4: "partial"}


# ---------------------------------------------------------------- ConvTranspose2d


def _convt_configs() -> list[dict]:
    """Every kernel x stride x padding, with dilation, output_padding, groups and bias
    cycling through their values (issue grid, item 3)."""
    cfgs = []
    for n, (k, s, p) in enumerate(itertools.product(range(1, 6), range(1, 4), range(3))):
        d = 1 + n % 2
        op = (n // 2) % max(s, d)  # output_padding < stride or dilation
        groups = 2 if n % 3 == 0 else 1
        cfgs.append(
            dict(
                kernel_size=k,
                stride=s,
                padding=p,
                dilation=d,
                output_padding=op,
                groups=groups,
                bias=n % 4 != 1,
            )
        )
    cfgs.append(dict(kernel_size=(3, 4), stride=(2, 3), padding=(1, 2), output_padding=(1, 2)))
    cfgs.append(dict(kernel_size=2, stride=2))  # the U-Net up-sampling layer
    return cfgs


def _width_for(layer: nn.ConvTranspose2d, world: int) -> int:
    """The narrowest width (at least 5, not a multiple of ``world`` when world > 1) whose
    uneven strips still hold this layer's halo."""
    k, s, d = layer.kernel_size[1], layer.stride[1], layer.dilation[1]
    p, op = layer.padding[1], layer.output_padding[1]
    for w in itertools.count(5 + k % 2):
        if world > 1 and w % world == 0:
            continue
        try:
            plan_conv_transpose("t", w, world, k, s, d, p, op)
            return w
        except SpatialShardingError:
            pass
    raise AssertionError("unreachable")


def convt_grid(world: int, grad_kind: str) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    for i, cfg in enumerate(_convt_configs()):
        torch.manual_seed(i)
        layer = nn.ConvTranspose2d(4, 6, **cfg)
        x = seeded(2000 + i, 2, 4, 5, _width_for(layer, world))
        compare_module(layer, x, dmesh, [Shard(3)], grad_kind, f"{cfg} W={x.shape[-1]}", failures)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_transpose_grid_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, convt_grid, world, GRAD_KINDS[world])[0]
    assert not failures, "\n".join(failures)


def test_convt_grid_covers_the_issue():
    cfgs = _convt_configs()[:-2]
    for key, values in [("kernel_size", {1, 2, 3, 4, 5}), ("stride", {1, 2, 3}),
                        ("padding", {0, 1, 2}), ("dilation", {1, 2}), ("groups", {1, 2}),
                        ("bias", {True, False}), ("output_padding", {0, 1, 2})]:  # fmt: skip
        assert {c[key] for c in cfgs} == values, key


# Tiny widths where some rank's outputs receive no input column at all (only the
# output_padding band, or nothing), or where a rank has no output column: zero + bias.
EDGE_CASES = [
    (dict(kernel_size=2, stride=3, padding=1, output_padding=2), 2, 4),
    (dict(kernel_size=1, stride=3, output_padding=2), 3, 4),
    (dict(kernel_size=1, stride=3, output_padding=2), 2, 2),
    (dict(kernel_size=3, stride=2, padding=2, output_padding=1, dilation=2), 4, 3),
]


def convt_edges(world: int) -> list[str]:
    failures: list[str] = []
    for i, (cfg, width, w) in enumerate(EDGE_CASES):
        if w != world:
            continue
        torch.manual_seed(i)
        layer = nn.ConvTranspose2d(3, 2, **cfg)
        x = seeded(50 + i, 1, 3, 4, width)
        compare_module(layer, x, mesh(world), [Shard(3)], "shard", f"edge {cfg}", failures)
    return failures


def test_conv_transpose_edges_hit_empty_windows():
    empty = 0
    for cfg, width, world in EDGE_CASES:
        k, s, d = cfg["kernel_size"], cfg["stride"], cfg.get("dilation", 1)
        tp = plan_conv_transpose("t", width, world, k, s, d, cfg.get("padding", 0),
                                 cfg["output_padding"])  # fmt: skip
        empty += sum(not needed for needed in tp.exchange.needed)
    assert empty >= 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_transpose_edges(dist_pool, world):
    failures = dist_pool.run(world, convt_edges, world)[0]
    assert not failures, "\n".join(failures)


def convt_empty_tiles() -> list[str]:
    """2 x 2 tiles (input width or height 1): some ranks' window along one dim is empty while
    the other dim exchanges halos (the zero row is added after every exchange)."""
    failures: list[str] = []
    for dmesh, pl, label in each_mesh([((2, 2), ("sp_h", "sp_w"))]):
        cases = [  # (kernel, stride, padding, output_padding), input (H, W)
            (((3, 1), (1, 3), (1, 0), (0, 2)), (7, 1)),
            (((1, 3), (3, 1), (0, 1), (2, 0)), (1, 7)),
            ((1, 3, 0, 2), (1, 1)),
        ]
        for i, ((k, s, p, op), hw) in enumerate(cases):
            cfg = dict(kernel_size=k, stride=s, padding=p, output_padding=op)
            torch.manual_seed(i)
            x = seeded(60 + i, 1, 3, *hw, dtype=torch.float64)
            layer = nn.ConvTranspose2d(3, 2, **cfg).double()
            check_module(layer, x, dmesh, pl, f"{label} {cfg} {hw}", failures)
    return failures


def test_conv_transpose_empty_windows_on_tiles(dist_pool):
    for failures in dist_pool.run(4, convt_empty_tiles):
        assert not failures, "\n".join(failures)


class _Functional(nn.Module):
    """Model code calling the functional ops, torchvision style."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(seeded(7, 8, 3, 3, 3))
        self.b = nn.Parameter(seeded(8, 6))
        self.up = nn.ConvTranspose2d(6, 3, 3, stride=2, padding=1)

    def forward(self, x):
        shape = x.shape[-2:]
        y = F.conv_transpose2d(x, self.w, self.b, stride=2, padding=1, output_padding=1, groups=2)
        y = F.interpolate(y, size=(7, 23), mode="bilinear", align_corners=False)
        y = self.up(y, output_size=[13, 46])  # output_size picks output_padding 1
        return F.interpolate(y, size=shape, mode="bilinear", align_corners=False)


def functional_paths(world: int) -> list[str]:
    failures: list[str] = []
    x = seeded(9, 2, 8, 5, 4 * world + 3)
    compare_module(_Functional(), x, mesh(world), [Shard(3)], "shard", "functional", failures)
    # data parallel x spatial: parameter gradients summed over both mesh dimensions
    m2 = mesh((2, world // 2))
    compare_module(_Functional(), x, m2, [Shard(0), Shard(3)], "shard", "dp x sp", failures)
    return failures


def test_functional_and_dp(dist_pool):
    failures = dist_pool.run(4, functional_paths, 4)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- interpolate


def _resize_whole(x, size, sf, mode, ac, rc):
    """The per-rank resize code run on a whole tensor (one rank, window = everything)."""
    h, w = x.shape[2:]
    align = bool(ac) if mode == "bilinear" else False
    (oh, ow), (sh, sw) = resize_sizes((h, w), size, sf, mode, ac, rc)
    for dim, n, no, s in ((3, w, ow, sw), (2, h, oh, sh)):
        table = _local_table((mode, n, no, align, s), 0, no, 0, x.dtype, x.device)
        x = x if table is None else _apply(x, dim, table)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_index_tables_match_aten_bit_for_bit(dtype):
    """Single process: the global-coordinate tables reproduce ATen's indices exactly (nearest
    modes bit for bit, bilinear to an ulp) over many sizes, scales and wide images, where a
    float rounding difference in the source coordinate would show."""
    modes = [("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True)]
    eps = torch.finfo(torch.float32).eps
    for w in (1, 2, 3, 5, 7, 13, 17, 31, 97, 8191):
        x = seeded(w, 1, 1, 2, w, dtype=dtype)
        cases = [(None, (1.0, sf), rc) for sf in (0.3, 0.5, 1.3, 1.5, 2.0, 2.1, 3.3, 7 / 3)
                 for rc in (None, True)]  # fmt: skip
        cases += [((2, n), None, None) for n in {1, 2, max(1, w // 3), w, w + 1, 2 * w, 3 * w - 1}]
        for (size, sf, rc), (mode, ac) in itertools.product(cases, modes):
            kw = dict(size=size, scale_factor=sf, mode=mode, align_corners=ac)
            try:
                want = F.interpolate(x, recompute_scale_factor=rc, **kw)
            except RuntimeError:  # an empty output: the spatial op refuses it too
                continue
            got = _resize_whole(x, size, sf, mode, ac, rc)
            # bilinear: fp32 to an ulp or so; fp64 weights come out ~1e-14 apart (ATen fuses
            # the multiply-add in double too; only the fp32 one is reproduced).
            tol = 0 if mode != "bilinear" else 16 * eps if dtype == torch.float32 else 1e-12
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err <= tol, (w, kw, rc, err)


def interp_functional_and_errors(world: int) -> list[str]:
    failures: list[str] = []

    class Head(nn.Module):  # torchvision segmentation heads resize back to the input size
        def forward(self, x):
            y = F.interpolate(x, scale_factor=0.5, mode="bilinear", align_corners=True)
            y = F.interpolate(y, scale_factor=1.7, mode="nearest", recompute_scale_factor=True)
            return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)

    x = seeded(11, 1, 2, 6, 8 * world + 1)
    compare_module(Head(), x, mesh(world), [Shard(3)], "replicate", "head", failures)
    xs = distribute_tensor(x, mesh(world), [Shard(3)])
    for kw in (dict(mode="bicubic"), dict(mode="bilinear", antialias=True)):
        with pytest.raises(SpatialShardingError, match="not supported"):
            parallelize(_Resize(kw), mesh(world))(xs)
    area = _Resize(dict(mode="area"))
    if current_runtime().registry.handler(F.adaptive_avg_pool2d):  # a spatial one exists
        compare_module(area, x, mesh(world), [Shard(3)], "shard", "area", failures)
    else:
        with pytest.raises(SpatialShardingError, match="adaptive_avg_pool2d"):
            parallelize(area, mesh(world))(xs)
    return failures


class _Resize(nn.Module):
    """F.interpolate to half the width with the given keyword arguments."""

    def __init__(self, kw: dict):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, size=(3, x.shape[-1] // 2), **self.kw)


def test_interpolate_functional_and_refusals(dist_pool):
    failures = dist_pool.run(3, interp_functional_and_errors, 3)[0]
    assert not failures, "\n".join(failures)


def test_modules_swapped_in_place():
    class FakeMesh:  # parallelize only reads ndim/names before swapping layers
        ndim = 1
        mesh_dim_names = ("sp",)

    model = nn.Sequential(nn.ConvTranspose2d(2, 2, 2, 2), nn.Upsample(scale_factor=2),
                          nn.UpsamplingBilinear2d(scale_factor=2))  # fmt: skip
    x = seeded(1, 1, 2, 3, 4)
    want = model(x)
    parallelize(model, FakeMesh())
    assert "SpatialConvTranspose2d" in repr(model) and "SpatialUpsample(" in repr(model)
    assert "SpatialUpsamplingBilinear2d" in repr(model)
    torch.testing.assert_close(model(x), want)  # plain tensors run the ordinary layers
