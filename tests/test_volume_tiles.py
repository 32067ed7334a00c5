"""Volumes (NCDHW) sharded over two or three of D, H, W at once (issue 12 item 2, multi-dim):
pools, ConvTranspose3d, norms and resizing on 5-D tiles (Conv3d: tests/test_conv_grid.py),
and ``unet3d`` on a 2 x 2 (sp_h, sp_w) mesh, against one device in fp64 (forward, input and
every parameter gradient, no activation-sized collective), with sizes that do not split
evenly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from spconv_train.parallel._sharding import block_slices, mesh_coords, spatial_layout
from spconv_train.parallel._tiles import tile_window
from spconv_train.parallel.extend import SpatialMode
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn, check_module
from tests.reference import check_close, seeded

#: (mesh shape, mesh dim names): every pair of D, H, W, all three, and with "dp"
VOLUME_MESHES = {
    "hw": ((2, 2), ("sp_h", "sp_w")),
    "dw": ((2, 2), ("sp_d", "sp_w")),
    "dhw": ((1, 2, 2), ("sp_d", "sp_h", "sp_w")),
    "dp-dh": ((2, 1, 2), ("dp", "sp_d", "sp_h")),
}


def volume_mesh(key: str):
    """``(mesh, placements)`` of ``VOLUME_MESHES[key]`` for NCDHW volumes."""
    return mesh_and_placements(*VOLUME_MESHES[key], ndim=5)


def corner_exchange_3d(key: str) -> list[str]:
    """The 3-D window (halos along every sharded dim, edges and corners, edge padding)
    equals the padded global volume's slice, and its backward is the exchange's adjoint:
    <E x, y> == <x, E^T y> summed over the ranks."""
    dmesh, pl = volume_mesh(key)
    full = seeded(7, 2, 3, 7, 9, 11, dtype=torch.float64)
    failures = []
    for mode, geoms in (
        ("zeros", {2: (3, 1, 1, 1, 1), 3: (5, 1, 1, 2, 2), 4: (3, 1, 1, 1, 1)}),
        ("zeros", {2: (4, 2, 1, 2, 1), 3: (3, 2, 1, 0, 2), 4: (3, 1, 2, 2, 2)}),
        ("reflect", {2: (3, 1, 1, 1, 1), 3: (3, 1, 1, 1, 1), 4: (5, 1, 1, 2, 2)}),
        ("circular", {2: (3, 1, 1, 1, 1), 3: (5, 1, 1, 2, 2), 4: (3, 1, 1, 1, 1)}),
    ):
        x = distribute_tensor(full, dmesh, pl)
        _, layout = spatial_layout(x, "test", ndim=5, tiles=True)
        local = x.to_local().detach().requires_grad_()
        tw = tile_window(local, tuple(x.shape), layout, "test", geoms, mode)
        pads = [a for d in (4, 3, 2) for a in geoms[d][3:]]
        padded = F.pad(full, pads, mode="constant" if mode == "zeros" else mode)
        box = [block_slices(full.shape, pl, mesh_coords(dmesh))[0], slice(None)]
        for d in (2, 3, 4):
            a = tw.starts[d] + geoms[d][3]
            box.append(slice(a, a + tw.local.shape[d]))
        if not torch.equal(tw.local.detach(), padded[tuple(box)]):
            failures.append(f"{key} {mode} {geoms}: window differs from the padded volume")
        y = seeded(100 + dist.get_rank(), *tw.local.shape, dtype=torch.float64)
        (tw.local * y).sum().backward()
        dots = torch.stack([(tw.local.detach() * y).sum(), (local.detach() * local.grad).sum()])
        dist.all_reduce(dots)
        if abs(dots[0] - dots[1]) > 1e-10 * abs(dots[0]):
            failures.append(f"{key} {mode} {geoms}: <Ex,y> {dots[0]} != <x,E'y> {dots[1]}")
    return failures


def test_corner_exchange_3d_and_adjoint(dist_pool):
    failures = []
    for key in ("dw", "dhw"):
        failures += dist_pool.run(4, corner_exchange_3d, key)[0]
    assert not failures, "\n".join(failures)


def _ops() -> list[tuple[str, nn.Module]]:
    """The 3-D op grid (4 channels in): each halo fits the smallest tile of a 7 x 9 x 11
    volume split in two along any dim."""
    ops: list[tuple[str, nn.Module]] = []
    pools = [
        nn.MaxPool3d(2),
        nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True),
        nn.MaxPool3d(3, stride=1, padding=1, dilation=2),
        nn.AvgPool3d(2),
        nn.AvgPool3d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.AvgPool3d((3, 2, 3), stride=(2, 1, 2), padding=1, divisor_override=5),
    ]
    ops += [(repr(p), p) for p in pools]
    for c in (
        dict(kernel_size=2, stride=2),
        dict(kernel_size=3, stride=2, padding=1, output_padding=1),
        dict(kernel_size=(3, 4, 2), stride=(1, 3, 2), padding=(1, 2, 0), groups=2, bias=False),
        dict(kernel_size=3, stride=1, padding=2, dilation=2),
    ):
        ops.append((f"ConvTranspose3d({c})", nn.ConvTranspose3d(4, 6, **c)))
    ops += [
        ("BatchNorm3d", nn.BatchNorm3d(4)),
        ("InstanceNorm3d", nn.InstanceNorm3d(4, affine=True, track_running_stats=True)),
        ("GroupNorm", nn.GroupNorm(2, 4)),
    ]
    for c in (
        dict(scale_factor=2, mode="nearest"),
        dict(scale_factor=2, mode="trilinear", align_corners=False),
        dict(size=(9, 13, 15), mode="trilinear", align_corners=True),
        dict(scale_factor=0.5, mode="nearest-exact"),
    ):
        ops.append((f"Upsample({c})", nn.Upsample(**c)))
    ops += [
        ("AdaptiveAvgPool3d(1)", nn.AdaptiveAvgPool3d(1)),
        ("AdaptiveAvgPool3d((1, 2, 1))", nn.AdaptiveAvgPool3d((1, 2, 1))),
        ("3-D squeeze-excitation", _SqueezeExcite3d()),
        ("3-D pooled branch", _PooledBranch3d()),
    ]
    return ops


class _PooledBranch3d(nn.Module):
    """DeepLabV3's ASPP pooling branch on a volume: adaptive average pooling (``Replicate``
    on the tile mesh), 1x1x1 conv + BatchNorm on the pooled map, trilinear resize back onto
    the tiles, concat with the input, 3x3x3 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool3d((1, 2, 2))
        # no conv bias: BatchNorm cancels it, its gradient is rounding noise around 0
        self.conv, self.bn = nn.Conv3d(4, 3, 1, bias=False), nn.BatchNorm3d(3)
        self.mix = nn.Conv3d(7, 2, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(self.pool(x))))
        y = F.interpolate(y, size=x.shape[-3:], mode="trilinear", align_corners=False)
        return self.mix(torch.cat([x, y], 1))


class _SqueezeExcite3d(nn.Module):
    """Global average pooling (``Replicate`` on the spatial mesh dims), a 1x1x1 conv on the
    pooled map, and its sigmoid broadcast onto the tiles."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Conv3d(4, 4, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc(F.adaptive_avg_pool3d(x, 1)))


def ops_on_volume_tiles(key: str) -> list[str]:
    dmesh, pl = volume_mesh(key)
    failures: list[str] = []
    # every op on the two 2 x 2 meshes; alternate ops on the two others (suite time)
    step, first = (1, 0) if key in ("hw", "dw") else (2, int(key == "dp-dh"))
    for i, (name, module) in list(enumerate(_ops()))[first::step]:
        torch.manual_seed(i)
        x = seeded(4000 + i, 2, 4, 7, 9, 11, dtype=torch.float64)
        check_module(module.double(), x, dmesh, pl, f"{key} {name}", failures)
    return failures


@pytest.mark.parametrize("key", list(VOLUME_MESHES))
def test_ops_on_volume_tiles_match_single_device(dist_pool, key):
    failures = dist_pool.run(4, ops_on_volume_tiles, key)[0]
    assert not failures, "\n".join(failures)


def pad_on_volume_tiles(key: str) -> list[str]:
    """``F.pad`` (every mode, cropping, channel padding) and the 3-D padding modules."""
    from tests.test_ops3d_more import _pad_cases, _pad_modules

    dmesh, pl = volume_mesh(key)
    failures: list[str] = []
    for j, (label, kw) in enumerate(_pad_cases().items()):
        x = seeded(20 + j, 2, 3, 7, 9, 11, dtype=torch.float64)
        fn = lambda t, kw=kw: F.pad(t, **kw)  # noqa: E731
        check_fn(fn, x, dmesh, pl, f"{key} F.pad {label}", failures)
    for j, m in enumerate(_pad_modules()):
        x = seeded(40 + j, 2, 3, 7, 9, 11, dtype=torch.float64)
        check_module(nn.Sequential(m), x, dmesh, pl, f"{key} {m}", failures)
    return failures


@pytest.mark.parametrize("key", ["dw", "dhw"])
def test_pad_on_volume_tiles_matches_single_device(dist_pool, key):
    failures = dist_pool.run(4, pad_on_volume_tiles, key)[0]
    assert not failures, "\n".join(failures)


def refusals(key: str) -> list[str]:
    """What is not written for multi-dim volumes refuses, naming the op."""
    dmesh, pl = volume_mesh(key)
    xs = distribute_tensor(seeded(5, 2, 4, 7, 9, 11, dtype=torch.float64), dmesh, pl)
    cases = {
        "adaptive_max_pool3d": lambda t: F.adaptive_max_pool3d(t, 1, return_indices=True),
        "adaptive_avg_pool3d": lambda t: F.adaptive_avg_pool3d(t, (3, 4, 5)),  # too big
        "max_pool3d": lambda t: F.max_pool3d(t, 2, return_indices=True),
    }
    failures = []
    for name, fn in cases.items():
        try:
            with SpatialMode():
                fn(xs)
            failures.append(f"{key} {name}: ran on a multi-dim volume")
        except SpatialShardingError as e:
            if name not in str(e):
                failures.append(f"{key} {name}: refusal does not name the op: {e}")
    return failures


def test_unsupported_ops_refuse_volume_tiles(dist_pool):
    failures = dist_pool.run(4, refusals, "dw")[0]
    assert not failures, "\n".join(failures)


def unet3d_on_tiles(key: str, up: str, size: tuple[int, int, int], steps: int = 2) -> list[str]:
    """``unet3d`` on a tile mesh equals one device: logits, every parameter gradient, the
    parameters after ``steps`` SGD steps and the BatchNorm buffers. ``size`` (D, H, W) not
    divisible by 2 resizes the up-sampled map to the skip (trilinear ``F.interpolate``)."""
    from spconv_train.models import create_model
    from spconv_train.parallel import CommAudit
    from spconv_train.train import cross_entropy

    dmesh, pl = volume_mesh(key)
    torch.manual_seed(0)
    opts = dict(depth=2, base_width=4, up=up)
    ref = create_model("unet3d", num_classes=3, in_channels=1, **opts).double()
    par = parallelize(copy.deepcopy(ref), dmesh)
    opt_r, opt_p = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, par))
    x = seeded(1, 2, 1, *size, dtype=torch.float64)
    target = torch.randint(0, 3, (2, *size), generator=torch.Generator().manual_seed(2))
    failures: list[str] = []
    for step in range(steps):
        opt_r.zero_grad()
        opt_p.zero_grad()
        out_r = ref(x)
        loss_r = F.cross_entropy(out_r, target)
        loss_r.backward()
        xs = distribute_tensor(x, dmesh, pl)
        with CommAudit() as audit:  # halo exchanges and small reductions only
            out_p = par(xs)
            loss_p = cross_entropy(out_p, target)
            loss_p.backward()
        shapes = {tuple(p.shape) for p in par.parameters()}
        moved = audit.activation_sized(max(1, xs.to_local()[0].numel() // 4), shapes)
        failures += [f"step {step}: activation-sized {r.op} {r.shape}" for r in moved]
        label = f"unet3d {key} step {step}"
        check_close(f"{label} logits", out_p, out_r, 1e-9, failures)
        check_close(f"{label} loss", loss_p, loss_r, 1e-9, failures)
        for (n, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            check_close(f"{label} {n}.grad", p.grad, q.grad, 1e-8, failures, 1e-9)
        opt_r.step()
        opt_p.step()
    for (n, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
        check_close(f"unet3d {key} {n} after {steps} steps", p, q, 1e-8, failures)
    for (n, b), c in zip(par.named_buffers(), ref.buffers(), strict=True):
        if b.is_floating_point():
            check_close(f"unet3d {key} buffer {n}", b, c, 1e-8, failures, 1e-9)
    return failures[:20]


@pytest.mark.parametrize(
    "key,up,size", [("hw", "transpose", (8, 12, 14)), ("dp-dh", "bilinear", (8, 13, 14))]
)
def test_unet3d_on_volume_tiles_matches_single_device(dist_pool, key, up, size):
    for rank, failures in enumerate(dist_pool.run(4, unet3d_on_tiles, key, up, size)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
