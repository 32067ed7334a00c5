"""``F.pad`` (every mode, growing and cropping), ``pixel_shuffle``, ``pixel_unshuffle``,
slicing / centre crops, ``flip`` and ``roll`` on H x W tiles (issue 12 item 1: every op
that runs on a strip runs on a tile): each sharded dim is re-chunked (pad, shuffle,
slicing, flip, roll) or windowed (unshuffle) over its own mesh dim in turn, against one
device in fp64 (forward and input gradient, no activation-sized collective), on 2 x 2,
(dp, sp_h, sp_w) = (2, 1, 2), (3, 1) and (1, 3) meshes with uneven sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.meshes import each_mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

MESHES = {
    4: [((2, 2), ("sp_h", "sp_w")), ((2, 1, 2), ("dp", "sp_h", "sp_w"))],
    3: [((3, 1), ("sp_h", "sp_w")), ((1, 3), ("sp_h", "sp_w"))],
}

PADS = [
    ("constant (1, 2, 3, 0)", (1, 2, 3, 0), "constant"),
    ("constant value crop (-2, 1, 1, -3)", (-2, 1, 1, -3), "constant"),
    ("reflect (2, 1, 1, 2)", (2, 1, 1, 2), "reflect"),
    ("replicate (3, 0, 0, 4)", (3, 0, 0, 4), "replicate"),
    ("circular (1, 2, 2, 1)", (1, 2, 2, 1), "circular"),
]


def pad_and_shuffle(world: int) -> list[str]:
    failures: list[str] = []
    for dmesh, pl, key in each_mesh(MESHES[world]):
        for i, (label, pad, mode) in enumerate(PADS):
            x = seeded(700 + i, 2, 3, 13, 17, dtype=torch.float64)
            value = 0.5 if "value" in label else None

            def fn(t, pad=pad, mode=mode, value=value):
                return F.pad(t, pad, mode, value) if mode == "constant" else F.pad(t, pad, mode)

            check_fn(fn, x, dmesh, pl, f"{key} F.pad {label}", failures)
        x = seeded(710, 2, 8, 11, 13, dtype=torch.float64)
        check_fn(lambda t: F.pixel_shuffle(t, 2), x, dmesh, pl, f"{key} shuffle 2", failures)
        x = seeded(711, 2, 9, 7, 10, dtype=torch.float64)
        check_fn(lambda t: F.pixel_shuffle(t, 3), x, dmesh, pl, f"{key} shuffle 3", failures)
        x = seeded(712, 2, 3, 18, 22, dtype=torch.float64)
        check_fn(lambda t: F.pixel_unshuffle(t, 2), x, dmesh, pl, f"{key} unshuffle", failures)
        rechunks = [
            ("centre crop", lambda t: t[:, :, 2:-3, 3:-2]),
            ("strided slice", lambda t: t[..., 1:12:2, ::3]),
            ("slice H, int C", lambda t: t[:, 1, 4:]),
            ("flip H W", lambda t: torch.flip(t, [2, 3])),
            ("flip H", lambda t: t.flip(-2)),
            ("roll H W", lambda t: torch.roll(t, (5, -4), (2, 3))),
        ]
        for i, (label, fn) in enumerate(rechunks):
            x = seeded(720 + i, 2, 3, 13, 17, dtype=torch.float64)
            check_fn(fn, x, dmesh, pl, f"{key} {label}", failures)
        torch.manual_seed(3)
        block = nn.Sequential(  # a sub-pixel upsampler: conv, shuffle, pad, conv
            nn.Conv2d(3, 12, 3, padding=1),
            nn.PixelShuffle(2),
            nn.ReflectionPad2d(1),
            nn.Conv2d(3, 2, 3),
        ).double()
        x = seeded(713, 2, 3, 9, 11, dtype=torch.float64)
        check_module(block, x, dmesh, pl, f"{key} sub-pixel block", failures)
    return failures


@pytest.mark.parametrize("world", [4, 3])
def test_pad_and_shuffle_on_tiles_match_single_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, pad_and_shuffle, world)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
