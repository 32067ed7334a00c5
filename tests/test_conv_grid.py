"""Convolution on every layout against one device: one grid.

Conv configurations (kernel incl. even ones, stride, dilation, groups, padding as int, tuple,
``'same'``, ``'valid'``, padding modes zeros / reflect / replicate / circular) x spatial rank
(1-D signals, 2-D images, 3-D volumes) x sharded axes (strips, rows, tiles, a volume along
each of D, H, W, volume blocks over two and three dims, with a ``dp`` batch dim) x world
size (2, 3, 4; sizes that do not split evenly). fp64; forward, input gradient, weight and
bias gradients; no activation-sized collective (``tests/op_check.py``). Modules go through
``parallelize``, functions through ``SpatialMode``. All cases of a world size run in one
worker call; each (config, layout) pair of a world runs when it falls on that world's
rotation, so every config meets every layout family across the worlds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import plan_window
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

#: Conv configs; a 3-tuple value is per (D, H, W): a lower rank takes its last entries.
CONFIGS: list[dict] = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=4, padding="same"),  # even kernel: the extra one after
    dict(kernel_size=2, padding="valid", bias=False),
    dict(kernel_size=2, stride=2),  # patchify
    dict(kernel_size=3, dilation=2, padding=2),
    dict(kernel_size=3, padding=1, groups=2, out_channels=4),
    dict(kernel_size=3, padding=1, groups=4, out_channels=4),  # depthwise
    dict(kernel_size=2, padding=3),  # padding wider than the kernel
    dict(kernel_size=1),
    dict(kernel_size=5, stride=3, padding=2),
    dict(kernel_size=3),  # no padding: the edges read halos only
    dict(kernel_size=(2, 3, 4), stride=(1, 2, 1), padding=(1, 0, 2), dilation=(2, 1, 1)),
    dict(kernel_size=(3, 2, 3), dilation=(1, 2, 3), padding="same"),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, stride=2, padding=(1, 2, 1), padding_mode="replicate"),
    dict(kernel_size=3, stride=2, padding=1, padding_mode="circular", groups=2, out_channels=4),
    dict(kernel_size=4, padding="same", padding_mode="reflect"),
    dict(kernel_size=3, dilation=2, padding=(2, 1, 3), padding_mode="circular"),
]

#: per world: label -> (mesh shape, mesh dim names, tensor rank, placements)
LAYOUTS: dict[int, dict[str, tuple]] = {
    2: {
        "signal": ((2,), ("sp",), 3, [Shard(2)]),
        "strips": ((2,), ("sp",), 4, [Shard(3)]),
        "rows": ((2, 1), ("sp_h", "sp_w"), 4, [Shard(2), Shard(3)]),
        "volume D": ((2,), ("sp",), 5, [Shard(2)]),
        "volume H": ((2,), ("sp",), 5, [Shard(3)]),
        "volume W": ((2,), ("sp",), 5, [Shard(4)]),
    },
    3: {
        "signal": ((3,), ("sp",), 3, [Shard(2)]),
        "strips": ((3,), ("sp",), 4, [Shard(3)]),
        "tiles 3x1": ((3, 1), ("sp_h", "sp_w"), 4, [Shard(2), Shard(3)]),
        "volume D": ((3,), ("sp",), 5, [Shard(2)]),
        "volume H": ((3,), ("sp",), 5, [Shard(3)]),
        "volume W": ((3,), ("sp",), 5, [Shard(4)]),
    },
    4: {
        "tiles 2x2": ((2, 2), ("sp_h", "sp_w"), 4, [Shard(2), Shard(3)]),
        "dp strips": ((2, 2), ("dp", "sp"), 4, [Shard(0), Shard(3)]),
        "blocks DW": ((2, 2), ("sp_d", "sp_w"), 5, [Shard(2), Shard(4)]),
        "blocks DH": ((2, 2), ("sp_d", "sp_h"), 5, [Shard(2), Shard(3)]),
        "blocks DHW": ((1, 2, 2), ("sp_d", "sp_h", "sp_w"), 5, [Shard(2), Shard(3), Shard(4)]),
        "dp tiles": ((2, 1, 2), ("dp", "sp_h", "sp_w"), 4, [Shard(0), Shard(2), Shard(3)]),
    },
}
#: a (config, layout) pair runs at a world when (config + layout + world) % ROTATION == 0
ROTATION = 3
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _for_rank(cfg: dict, n: int) -> dict:
    """``cfg`` for spatial rank ``n``: every 3-tuple cut to its last ``n`` entries."""
    return {k: (v[-n:] if isinstance(v, tuple) else v) for k, v in cfg.items()}


def _sizes(conv: nn.Module, parts: list[int]) -> list[int]:
    """Per spatial dim, a small size every rank can run (the smallest the geometry allows,
    ``plan_window``, plus two positions per part: most ranks then have interior outputs),
    not divisible by its part count > 1; reflect needs size > pad."""
    rev = conv._reversed_padding_repeated_twice  # last dim first
    sizes = []
    for j, p in enumerate(parts):
        k, s, d = conv.kernel_size[j], conv.stride[j], conv.dilation[j]
        lo, hi = rev[2 * (len(parts) - 1 - j)], rev[2 * (len(parts) - 1 - j) + 1]
        for n in range(max(3, lo + 1, hi + 1), 1000):
            if p > 1 and n % p == 0:
                continue
            try:
                plan_window("grid", n, p, k, s, d, lo, hi, conv.padding_mode)
            except SpatialShardingError:
                continue
            break
        sizes.append(n + 2 * p if p > 1 else n)
    return sizes


def _parts(dmesh, placements, ndim: int) -> list[int]:
    """Parts per spatial dim of a tensor of rank ``ndim`` under ``placements``."""
    parts = [1] * (ndim - 2)
    for m, p in enumerate(placements):
        if p.dim >= 2:
            parts[p.dim - 2] = dmesh.size(m)
    return parts


def _functional(conv: nn.Module):
    """``F.conv{n}d`` with ``conv``'s parameters and geometry, as model code calls it."""
    n = len(conv.kernel_size)
    w, b = conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
    return lambda t: _FN[n](t, w, b, conv.stride, conv.padding, conv.dilation, conv.groups)


def conv_grid(world: int) -> list[str]:
    failures: list[str] = []
    for li, (name, (shape, names, ndim, pl)) in enumerate(LAYOUTS[world].items()):
        dmesh = mesh(shape, names)
        batch = 2 if "dp" in names else 1
        for ci, cfg in enumerate(CONFIGS):
            if (ci + li + world) % ROTATION:
                continue
            cfg = _for_rank(dict(cfg), ndim - 2)
            torch.manual_seed(ci)
            conv = _CONV[ndim - 2](4, cfg.pop("out_channels", 3), **cfg).double()
            sizes = _sizes(conv, _parts(dmesh, pl, ndim))
            x = seeded(100 * ci + li, batch, 4, *sizes, dtype=torch.float64)
            label = f"{name} {cfg} {tuple(x.shape)}"
            if conv.padding_mode == "zeros" and ci % 3 == 0:
                check_fn(_functional(conv), x, dmesh, pl, f"F.conv {label}", failures)
            else:
                check_module(conv, x, dmesh, pl, label, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_grid_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, conv_grid, world)[0]
    assert not failures, "\n".join(failures)


def test_grid_covers_every_config_on_every_layout_family():
    """Across the worlds each config runs on strips / signals, on tiles or blocks, and on a
    volume sharded along one dim, and every layout runs both parities of configs."""
    families = {"one": ("signal", "strips", "dp strips"), "multi": ("rows", "tiles", "blocks")}
    for ci in range(len(CONFIGS)):
        ran = [
            name
            for world, layouts in LAYOUTS.items()
            for li, name in enumerate(layouts)
            if (ci + li + world) % ROTATION == 0
        ]
        for words in (*families.values(), ("volume",)):
            assert any(name.startswith(words) for name in ran), (CONFIGS[ci], ran)
    modes = {c.get("padding_mode", "zeros") for c in CONFIGS}
    assert modes == {"zeros", "reflect", "replicate", "circular"}
