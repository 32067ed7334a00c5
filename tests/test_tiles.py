"""H x W tiles (issue 12 item 1): the corner exchange and the ops on an image sharded along H
and W (Conv2d: tests/test_conv_grid.py), against one device in fp64 (forward, input and
parameter gradients), uneven sizes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel._sharding import block_slices, mesh_coords, spatial_layout
from spconv_train.parallel._tiles import tile_window
from tests.meshes import each_mesh, mesh_and_placements
from tests.op_check import check_module
from tests.reference import dropout_off, seeded

#: (mesh shape, mesh dim names, placements) per world size; "dp" shards the batch
TILE_MESHES = {
    2: [((1, 2), ("sp_h", "sp_w")), ((2, 1), ("sp_h", "sp_w"))],
    4: [((2, 2), ("sp_h", "sp_w")), ((2, 1, 2), ("dp", "sp_h", "sp_w"))],
}


def tile_meshes(world: int):
    """``(mesh, placements, label)`` of every tile mesh of this world size."""
    return list(each_mesh(TILE_MESHES[world]))


def _size(parts: int, k: int, s: int, d: int, pad: int) -> int:
    """A size every tile of ``parts`` can run, uneven when ``parts`` > 1."""
    n = parts * s * (d * (k - 1) + pad + 3)
    return n + 1 if parts > 1 else n


def _parts(dmesh, name: str) -> int:
    return dmesh.size(dmesh.mesh_dim_names.index(name))


# ---------------------------------------------------------------- the corner exchange


def corner_exchange(world: int) -> list[str]:
    """The window (halo + corners + edge padding) equals the padded global image's slice,
    and the backward is the exchange's adjoint: <E x, y> == <x, E^T y> summed over ranks."""
    failures = []
    for dmesh, pl, label in tile_meshes(world):
        for mode, geoms in (
            ("zeros", {2: (3, 1, 1, 1, 1), 3: (5, 1, 1, 2, 2)}),
            ("zeros", {2: (4, 2, 2, 3, 1), 3: (3, 2, 1, 0, 2)}),
            ("reflect", {2: (3, 1, 1, 1, 1), 3: (3, 1, 1, 1, 1)}),
            ("circular", {2: (3, 1, 1, 1, 1), 3: (5, 1, 1, 2, 2)}),
        ):
            full = seeded(7, 2, 3, 11, 13, dtype=torch.float64)
            x = distribute_tensor(full, dmesh, pl)
            _, layout = spatial_layout(x, "test", tiles=True)
            local = x.to_local().detach().requires_grad_()
            tw = tile_window(local, tuple(x.shape), layout, "test", geoms, mode)
            (pt, pb), (pleft, pright) = geoms[2][3:], geoms[3][3:]
            f_mode = "constant" if mode == "zeros" else mode
            padded = F.pad(full, (pleft, pright, pt, pb), mode=f_mode)
            rows = slice(tw.starts[2] + pt, tw.starts[2] + pt + tw.local.shape[2])
            cols = slice(tw.starts[3] + pleft, tw.starts[3] + pleft + tw.local.shape[3])
            want = padded[block_slices(full.shape, pl, mesh_coords(dmesh))[0], :, rows, cols]
            if not torch.equal(tw.local.detach(), want):
                failures.append(f"{label} {mode} {geoms}: window differs from the padded image")
            y = seeded(100 + dist.get_rank(), *tw.local.shape, dtype=torch.float64)
            (tw.local * y).sum().backward()
            dots = torch.stack([(tw.local.detach() * y).sum(), (local * local.grad).sum() * 0])
            dots[1] = (local.detach() * local.grad).sum()
            dist.all_reduce(dots)
            if abs(dots[0] - dots[1]) > 1e-10 * abs(dots[0]):
                failures.append(f"{label} {mode} {geoms}: <Ex,y> {dots[0]} != <x,E'y> {dots[1]}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_corner_exchange_and_adjoint(dist_pool, world):
    failures = dist_pool.run(world, corner_exchange, world)[0]
    assert not failures, "\n".join(failures)


def refusals(world: int) -> list[str]:
    """Ops without a tile implementation refuse, naming themselves."""
    dmesh, pl, _ = tile_meshes(world)[0]
    x = distribute_tensor(seeded(1, 1, 4, 9, 9, dtype=torch.float64), dmesh, pl)
    failures = []
    from spconv_train.parallel.extend import SpatialMode

    for name, fn in (
        ("adaptive_avg_pool2d", lambda t: F.adaptive_avg_pool2d(t, 4)),  # too large for tiles
    ):
        try:
            with SpatialMode():
                fn(x)
            failures.append(f"{name} ran on tiles")
        except SpatialShardingError as e:
            if name not in str(e) or "tiles" not in str(e):
                failures.append(f"{name}: unclear refusal {e}")
    return failures


def test_unsupported_ops_refuse_tiles(dist_pool):
    failures = dist_pool.run(4, refusals, 4)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------- pools, norms, ConvTranspose2d, resize


def _tile_ops(world: int) -> list[tuple[str, nn.Module, tuple[int, int]]]:
    """(label, module, (H, W)) of the pooling / norm / transposed conv / resize grid on
    tiles of ``world`` ranks: sizes uneven over 2 parts, tiles wider than every halo."""
    from tests.test_pool_grid import _CLS, _for_rank, window_configs

    ops = []
    for i, (kind, cfg) in enumerate(window_configs()[:: 4 if world == 2 else 5]):
        cls, cfg = _CLS[kind, 2], _for_rank(cfg, 2)
        m = cls(**cfg)
        pair = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731
        k, s, p, d = (
            pair(getattr(m, a, 1)) for a in ("kernel_size", "stride", "padding", "dilation")
        )
        h = _size(2, k[0], s[0], d[0], p[0]) + i % 2
        ops.append((f"{cls.__name__}({cfg})", m, (h, _size(2, k[1], s[1], d[1], p[1]))))
    ops += [
        ("BatchNorm2d", nn.BatchNorm2d(4), (7, 9)),
        ("GroupNorm", nn.GroupNorm(2, 4), (7, 9)),
        ("InstanceNorm2d", nn.InstanceNorm2d(4, affine=True, track_running_stats=True), (7, 9)),
    ]
    for cfg in (
        dict(kernel_size=2, stride=2),
        dict(kernel_size=3, stride=2, padding=1, output_padding=1),
        dict(kernel_size=(3, 4), stride=(2, 3), padding=(1, 2), output_padding=(1, 2)),
        dict(kernel_size=5, stride=1, padding=2, dilation=2, groups=2),
        dict(kernel_size=3, stride=3, padding=2, bias=False),
    ):
        ops.append((f"ConvTranspose2d({cfg})", nn.ConvTranspose2d(4, 6, **cfg), (7, 9)))
    for cfg in (
        dict(scale_factor=2, mode="nearest"),
        dict(scale_factor=2, mode="bilinear", align_corners=False),
        dict(scale_factor=(1.5, 2.5), mode="bilinear", align_corners=True),
        dict(scale_factor=0.5, mode="nearest-exact"),
        dict(size=(11, 13), mode="bilinear", align_corners=False),
        dict(scale_factor=1.5, mode="nearest", recompute_scale_factor=True),
    ):
        ops.append((f"Upsample({cfg})", nn.Upsample(**cfg), (7, 9)))
    ops += [(f"pooled branch {o}", _PooledBranch(o), (13, 15)) for o in (1, (2, 3))]
    ops.append(("timm-style SE block + softmax over W", _SqueezeExcite(), (7, 9)))
    for cfg in (dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), dict(kernel_size=2)):
        pool = nn.MaxPool2d(**cfg, dilation=1, return_indices=True)
        ops.append((f"MaxPool2d({cfg}) global indices", pool, (9, 11)))
    return ops


class _SqueezeExcite(nn.Module):
    """timm's squeeze-excitation (``x.mean((2, 3), keepdim=True)``, a 1x1 conv on the
    replicated result, the broadcast product with the tiles), then a softmax along W."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = x * torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)))
        return torch.softmax(y, dim=3)


class _PooledBranch(nn.Module):
    """DeepLabV3's ASPP pooling branch and its concat: adaptive average pooling (Replicate
    on the tile mesh), 1x1 conv + BatchNorm on the pooled map, bilinear resize back onto the
    tiles, concat with the input, 3x3 conv."""

    def __init__(self, size) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(size)
        # no conv bias: BatchNorm cancels it, its gradient is rounding noise around 0
        self.conv, self.bn = nn.Conv2d(4, 3, 1, bias=False), nn.BatchNorm2d(3)
        self.mix = nn.Conv2d(7, 2, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(self.pool(x))))
        y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.mix(torch.cat([x, y], 1))


def ops_tiles(world: int) -> list[str]:
    failures: list[str] = []
    for dmesh, pl, label in tile_meshes(world):
        batch = 2  # BatchNorm on a pooled 1x1 map needs more than one sample
        ops = list(enumerate(_tile_ops(world)))
        # every op on the (2, 2) mesh; alternate ops on (dp, sp_h, sp_w) (suite time)
        for i, (name, module, (h, w)) in ops[:: 2 if "dp" in dmesh.mesh_dim_names else 1]:
            torch.manual_seed(i)
            module = module.double()
            x = seeded(3000 + i, batch, 4, h, w, dtype=torch.float64)
            check_module(module, x, dmesh, pl, f"{label} {name} {h}x{w}", failures)
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_pool_norm_convt_resize_on_tiles(dist_pool, world):
    failures = dist_pool.run(world, ops_tiles, world)[0]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- models


def model_tiles(
    name: str,
    shape: tuple[int, ...],
    kwargs: dict,
    hw: tuple[int, int],
    steps: int = 2,
    tol: float = 1e-8,
) -> list[str]:
    """A registry model on tiles equals one device in fp64: logits, loss, every parameter
    gradient, the buffers and the parameters after ``steps`` SGD steps. Gradients and
    buffers are measured against a floor of 1e-3 of their largest value when ``tol`` is
    looser than 1e-8 (mathematically zero BatchNorm quantities are rounding noise, as in
    ``tests/test_models_sharded.py``)."""
    import copy

    from spconv_train.models import create_model
    from spconv_train.parallel import CommAudit, parallelize
    from spconv_train.train import ConfusionMatrix, cross_entropy
    from tests.reference import check_close

    names = ("dp", "sp_h", "sp_w") if len(shape) == 3 else ("sp_h", "sp_w")
    dmesh, pl = mesh_and_placements(shape, names)
    torch.manual_seed(0)
    ref = create_model(name, num_classes=3, **kwargs).double()
    dropout_off(ref)
    par = parallelize(copy.deepcopy(ref), dmesh)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.01, momentum=0.9)
    batch, (h, w) = 2, hw
    x = seeded(1, batch, 3, h, w, dtype=torch.float64)
    target = torch.randint(0, 3, (batch, h, w), generator=torch.Generator().manual_seed(2))
    target[:, :2, :5] = 255
    failures: list[str] = []
    for step in range(steps):
        out_r = ref(x)
        loss_r = F.cross_entropy(out_r, target, ignore_index=255)
        xs = distribute_tensor(x, dmesh, pl)
        opt_r.zero_grad()
        opt_p.zero_grad()
        loss_r.backward()
        with CommAudit() as audit:  # halo exchanges and small reductions only
            out_p = par(xs)
            loss_p = cross_entropy(out_p, target, ignore_index=255)
            loss_p.backward()
        shapes = {tuple(p.shape) for p in par.parameters()}
        moved = audit.activation_sized(max(1, xs.to_local()[0].numel() // 4), shapes)
        failures += [f"step {step}: activation-sized {r.op} {r.shape}" for r in moved]
        label = f"{name} {shape} step {step}"
        cms = [ConfusionMatrix(3, ignore_index=255) for _ in range(2)]
        cms[0].update(out_r, target)
        cms[1].update(out_p, target)
        if not torch.equal(cms[1].reduce(), cms[0].reduce()):
            failures.append(f"{label}: confusion matrix differs")
        check_close(f"{label} logits", out_p, out_r, 1e-9, failures)
        check_close(f"{label} loss", loss_p, loss_r, 1e-9, failures)
        for (n, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            floor = (
                1e-9
                if tol <= 1e-8
                else 1e-3 * max(r.grad.abs().max().item() for r in ref.parameters())
            )
            check_close(f"{label} {n}.grad", p.grad, q.grad, tol, failures, floor)
        opt_r.step()
        opt_p.step()
    buffers = [
        (n, b, c)
        for (n, b), c in zip(par.named_buffers(), ref.buffers(), strict=True)
        if b.is_floating_point()
    ]
    floor = 1e-9 if tol <= 1e-8 else 1e-3 * max(c.abs().max().item() for _, _, c in buffers)
    for n, b, c in buffers:
        check_close(f"{name} {shape} buffer {n}", b, c, tol, failures, floor)
    return failures[:20]


@pytest.mark.parametrize(
    "shape,up", [((2, 2), "transpose"), ((2, 1, 2), "bilinear")], ids=["2x2", "dp2x1x2"]
)
def test_unet_on_tiles_matches_single_device(dist_pool, shape, up):
    kwargs = dict(depth=2, base_width=4, up=up)
    for rank, failures in enumerate(dist_pool.run(4, model_tiles, "unet", shape, kwargs, (18, 21))):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.skipif(
    os.environ.get("SPCONV_SLOW_TESTS") != "1",
    reason="torchvision models on a 2x2 tile mesh take ~80 s each on 2 cores: set "
    "SPCONV_SLOW_TESTS=1",
)
@pytest.mark.parametrize(
    "name,hw",
    [
        # the 1/8-resolution tiles (5 and 4 rows) still hold layer4's dilation-4 halo
        ("fcn_resnet50", (66, 70)),
        # the 1/16-resolution tiles hold the dilated 5x5 depthwise halo; global pooling (SE
        # blocks, the LR-ASPP head) and the resize of the pooled map onto the tiles
        ("lraspp_mobilenet_v3_large", (132, 136)),
    ],
)
def test_torchvision_on_tiles_matches_single_device(dist_pool, name, hw):
    args = (name, (2, 2), {}, hw, 1, 1e-6)  # fp64, 1e-6 as tests/test_models_sharded.py
    for rank, failures in enumerate(dist_pool.run(4, model_tiles, *args)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
