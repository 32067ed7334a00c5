"""``parallel.sp: 0`` = the automatic grid (most square tile, most cubic block) and volume
grids ``parallel.sp: [d, h, w]`` from the config (issue 12 item 3): the choice, the config
errors that name the key, ``verify`` in float64 on volume grids and on an automatic 2 x 2
image grid, and training of a volume split over H and W (on the shared worker groups) and
of a square image at 4 ranks (under torchrun)."""

from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.config import (
    ConfigError,
    choose_grid,
    grid_mesh_dims,
    load_config,
    resolve_grid,
    split_dim,
    validate_for_world,
)
from tests.dist_harness import train_on_group
from tests.processes import REPO, torchrun
from tests.test_train_e2e import TINY, ok, read_metrics
from tests.test_verify import TINY as VERIFY_TINY
from tests.test_verify import _failed, verify_cases
from tests.test_volumes_train import TINY3D

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

VOLUME = ["data.kind=volume", "model.name=unet3d", "model.in_channels=1"]

# --- the choice -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "ranks", "levels", "grid"),
    [
        ((512, 2048), 2, 0, (1, 2)),  # wide images keep strips
        ((512, 2048), 4, 0, (1, 4)),
        ((256, 256), 1, 0, (1, 1)),
        ((256, 256), 2, 0, (1, 2)),  # tie: strips
        ((256, 256), 3, 0, (1, 3)),  # tie: strips
        ((256, 256), 4, 0, (2, 2)),
        ((256, 256), 5, 0, (1, 5)),  # prime: strips
        ((256, 256), 6, 0, (2, 3)),  # tie between 2x3 and 3x2: fewer tile rows
        ((2048, 512), 4, 0, (4, 1)),  # tall images: H strips
        ((100, 6), 4, 0, (4, 1)),  # 6 columns over 4 ranks leave one empty: skipped
        ((16, 32, 64), 2, 0, (1, 1, 2)),  # volumes: most cubic block
        ((16, 32, 64), 4, 0, (1, 1, 4)),  # tie with (1, 2, 2): fewer splits along D, H
        ((32, 32, 32), 4, 0, (1, 2, 2)),
        ((32, 32, 32), 6, 0, (1, 2, 3)),
        ((32, 32, 32), 8, 0, (2, 2, 2)),
        ((64, 16, 16), 3, 0, (3, 1, 1)),
        ((8, 8, 12), 4, 1, (1, 2, 2)),  # (1, 1, 4): 12 -> 6 over 4 leaves a rank empty
        ((12, 12, 12), 2, 1, (1, 1, 2)),
        ((12, 12, 12), 2, 3, None),  # 12 -> 6 -> 3 -> 1 over 2: every split leaves one empty
        ((8, 8, 8), 8, 3, None),
        ((2, 2), 6, 0, None),
    ],
)
def test_choose_grid(shape, ranks, levels, grid) -> None:
    assert choose_grid(shape, ranks, levels) == grid


@pytest.mark.parametrize(
    ("world", "sp"), [(1, 0), (2, 0), (3, 0), (4, [2, 2]), (5, 0), (6, [2, 3])]
)
def test_auto_grid_of_a_square_image(world: int, sp) -> None:
    cfg = load_config(None, ["data.height=96", "data.width=96"])
    assert resolve_grid(cfg, world) == (1, world)
    assert cfg.parallel.sp == sp  # strips stay 0; a grid is recorded in the config
    assert resolve_grid(cfg, world) == (1, world) and cfg.parallel.sp == sp  # idempotent
    if sp:
        assert grid_mesh_dims(cfg) == {"sp_h": sp[0], "sp_w": sp[1]}


def test_auto_grid_keeps_strips_for_wide_and_unknown_sizes() -> None:
    wide = load_config(None, ["data.height=512", "data.width=2048"])
    for world in (2, 4):
        assert resolve_grid(wide, world) == (1, world) and wide.parallel.sp == 0
    # full images of unknown size: strips (the size is known only per image)
    sets = ["data.source=folder", "data.root=/nowhere", "data.height=null", "data.width=null"]
    unknown = load_config(None, sets, check_paths=False)
    assert resolve_grid(unknown, 4) == (1, 4) and unknown.parallel.sp == 0
    # an explicit integer is never changed, a grid neither
    fixed = load_config(None, ["parallel.sp=4", "data.height=96", "data.width=96"])
    assert resolve_grid(fixed, 4) == (1, 4) and fixed.parallel.sp == 4


def test_auto_grid_of_volumes_and_explicit_volume_grids() -> None:
    cube = load_config(None, [*VOLUME, "data.depth=32", "data.height=32", "data.width=32"])
    assert resolve_grid(cube, 4) == (1, 4) and cube.parallel.sp == [1, 2, 2]
    assert grid_mesh_dims(cube) == {"sp_h": 2, "sp_w": 2}
    # parallel.shard_dim H or D pins the split: all ranks along that dim
    pinned = load_config(None, [*VOLUME, "parallel.shard_dim=D", "data.depth=32"])
    assert resolve_grid(pinned, 4) == (1, 4) and pinned.parallel.sp == 0
    assert (grid_mesh_dims(pinned), split_dim(pinned)) == (None, "D")
    # a grid with one split dim runs as strips along it; with dp
    one = load_config(None, [*VOLUME, "parallel.sp=[2, 1, 1]", "data.depth=16"])
    assert validate_for_world(one, 4) == (2, 2)
    assert (grid_mesh_dims(one), split_dim(one)) == (None, "D")
    three = load_config(None, [*VOLUME, "parallel.sp=[2, 1, 2]", "data.depth=16"])
    assert grid_mesh_dims(three) == {"sp_d": 2, "sp_w": 2}


@pytest.mark.parametrize(
    ("overrides", "world", "key", "words"),
    [
        (["parallel.sp=[2, 2]", *VOLUME], 4, "parallel.sp", "take [d, h, w]"),
        (["parallel.sp=[1, 2, 2]"], 4, "parallel.sp", "does not fit data.kind: image"),
        (["parallel.sp=[1, 2, 2, 1]"], 4, "parallel.sp", "[d, h, w]"),
        (["parallel.sp=[0, 2, 2]", *VOLUME], 4, "parallel.sp", "integers >= 1"),
        (
            [*VOLUME, "parallel.sp=[1, 2, 2]", "parallel.shard_dim=D"],
            4,
            "parallel.shard_dim",
            "names the split dims",
        ),
        ([*VOLUME, "parallel.sp=[1, 2, 2]"], 6, "parallel.sp", "1x2x2 = 4 ranks does not"),
        ([*VOLUME, "parallel.sp=[1, 4, 1]", "data.height=6"], 4, "data.height", "1 rank(s) empty"),
        # 12 slices over 2 ranks: 12 -> 6 -> 3 (2, 1) -> 1 (1, 0) after the 3rd pooling
        ([*VOLUME, "parallel.sp=[2, 1, 1]", "data.depth=12"], 2, "data.depth", "max-poolings"),
        ([*VOLUME, "parallel.sp=[2, 1, 1]", "data.depth=12"], 2, "data.depth", "multiple of 16"),
    ],
)
def test_grid_errors_name_the_key(overrides, world, key, words) -> None:
    with pytest.raises(ConfigError) as info:
        validate_for_world(load_config(None, overrides), world)
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_show_config_prints_the_chosen_grid() -> None:
    args = ["show-config", "configs/unet.yaml", "--set", "data.height=256", "--set"]
    result = CliRunner().invoke(app, [*args, "data.width=256", "--world-size", "4"])
    assert result.exit_code == 0, result.output
    assert "sp: [2, 2]" in result.output
    assert "dp=1 x sp=4 (2x2 tiles), chosen by parallel.sp: 0" in result.output


# --- verify (float64) -------------------------------------------------------------------------


def _verify_one_step(cases: list[list[str]]) -> list[dict]:
    """``verify`` (float64, 1 step) of ``TINY3D`` (8 x 8 x 12 volumes, unet3d depth 2) plus
    each case's overrides, in the worker pool."""
    from rich.console import Console

    from spconv_train.verify import run_verify

    console = Console(file=io.StringIO(), width=150)
    reports = [run_verify(load_config(None, TINY3D + c), steps=1, console=console) for c in cases]
    return [r.to_dict() for r in reports]


def test_verify_passes_on_volume_grids_and_an_automatic_image_grid(dist_pool) -> None:
    report = dist_pool.run(4, _verify_one_step, [["parallel.sp=[1, 2, 2]"]])[0][0]  # H x W
    assert report["passed"], (report["verdict"], report["failures"][:5])
    assert report["activation_sized_collectives"] == []
    assert report["mesh"] == {"dp": 1, "sp": 4} and report["grid"] == "1x2x2 blocks"
    square = VERIFY_TINY + ["data.height=32", "data.width=32"]  # parallel.sp: 0
    report = dist_pool.run(4, verify_cases, [(square, {"steps": 1})])[0][0]
    assert report["passed"], _failed(report)
    assert report["grid"] == "2x2 tiles" and "(dp=1 x sp=4 (2x2 tiles))" in report["verdict"]


# --- training ---------------------------------------------------------------------------------


def test_run_volume_with_sp_0_splits_h_and_w(dist_pool, tmp_path) -> None:
    """``configs/unet3d.yaml`` (tiny sizes) on an 8 x 16 x 16 volume at 4 ranks (real
    ``train()`` on the shared worker group, as ``spconv-train run`` runs it on every rank):
    ``parallel.sp: 0`` chooses ``[1, 2, 2]`` (8^3 blocks), printed and saved in
    ``config.yaml``; the loss goes down on a repeated volume, checkpoints and a ``model.pt``
    that loads into the plain model are written, and the middle slices are logged stitched
    from the blocks. (The one training run of the 3-D config in the suite.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from spconv_train.models import create_model
    from tests.test_train_e2e import exported

    run_dir = tmp_path / "run3d"
    sets = [f"run_dir={run_dir}", "model.kwargs={depth: 2, base_width: 4}", "data.depth=8"]
    sets += ["data.height=16", "data.width=16", "data.num_train=1", "data.num_val=1"]
    sets += ["data.hflip=0", "training.steps=6", "training.val_every=3", "training.log_every=1"]
    sets += ["checkpoint.every=3", "logging.progress=false"]
    sets += ["schedule.name=constant", "schedule.warmup_steps=0"]
    out = dist_pool.run(4, train_on_group, str(REPO / "configs" / "unet3d.yaml"), sets)[0]
    assert "meshdp=1xsp=4(1x2x2blocks)" in "".join(out.split()), out  # rank 0's console
    saved = load_config(run_dir / "config.yaml", check_paths=False)
    assert saved.parallel.sp == [1, 2, 2]  # the choice is recorded: a resume reproduces it
    assert (saved.data.kind, saved.data.depth) == ("volume", 8)
    train = [m for m in read_metrics(run_dir) if m["split"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    assert all(m["halo_s_per_step"] > 0 for m in train)
    assert train[-1]["loss"] < train[0]["loss"], [m["loss"] for m in train]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000003", "step-000006"]
    model = create_model("unet3d", num_classes=4, in_channels=1, depth=2, base_width=4)
    model.load_state_dict(exported(run_dir))  # strict: the plain parameter names
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "val/miou", "val/loss"} <= set(acc.Tags()["scalars"])
    panels = {t: acc.Images(t)[-1] for t in acc.Tags()["images"]}
    # H and W are split: the middle slices through all three axes, stitched from the blocks
    # that hold them (input | prediction | label with 2-pixel gaps)
    assert set(panels) == {"val/panel_0_D4", "val/panel_0_H8", "val/panel_0_W8"}, set(panels)
    assert (panels["val/panel_0_D4"].height, panels["val/panel_0_D4"].width) == (16, 52)
    assert (panels["val/panel_0_H8"].height, panels["val/panel_0_H8"].width) == (8, 52)
    assert (panels["val/panel_0_W8"].height, panels["val/panel_0_W8"].width) == (8, 52)


@pytest.mark.skipif(
    os.environ.get("SPCONV_SLOW_TESTS") != "1",
    reason="a second 4-rank torchrun (~30 s on 2 cores); the automatic 2 x 2 image grid is "
    "also checked by the verify test above: set SPCONV_SLOW_TESTS=1",
)
def test_run_square_image_with_sp_0_chooses_2x2_tiles(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    text = TINY.format(run_dir=tmp_path / "run").replace(
        "height: 32, width: 64", "height: 32, width: 32"
    )
    config.write_text(text, encoding="utf-8")
    proc = ok(
        torchrun(config, "--set", "training.steps=1", "--set", "training.val_every=1", nproc=4)
    )
    assert "mesh dp=1 x sp=4 (2x2 tiles)" in proc.stdout + proc.stderr
    saved = load_config(tmp_path / "run" / "config.yaml", check_paths=False)
    assert saved.parallel.sp == [2, 2]  # the choice is recorded: a resume reproduces it
    assert [m["step"] for m in read_metrics(tmp_path / "run") if m["split"] == "val"] == [1]


# --- blocks of a volume grid --------------------------------------------------------------------


@pytest.mark.parametrize("names", [("sp_d", "sp_w"), ("sp_h", "sp_w"), ("sp_d", "sp_h", "sp_w")])
def test_blocks_of_a_volume_grid_stitch_to_the_augmented_volume(names) -> None:
    """Every rank's ``block_bounds`` / ``load_box`` block of a cropped, flipped volume on a
    block mesh (ranks numbered row-major, as ``init_device_mesh`` does) equals the slice
    of the whole augmented volume that DTensor's chunking gives it."""
    import torch
    from torch.distributed.tensor import Shard

    from spconv_train.data import SyntheticVolumes, draw_volume_augment, load_box, strip_bounds
    from spconv_train.train.data_feed import MeshCoords
    from spconv_train.train.volume_feed import block_bounds

    sizes = {"sp_d": 2, "sp_h": 3, "sp_w": 2}
    grid = [sizes[n] for n in names]
    cfg = load_config(None, VOLUME)  # block_bounds reads the layout off the coords alone
    source = SyntheticVolumes(2, size=(9, 13, 14), num_classes=4, in_channels=2)
    aug = draw_volume_augment(0, 1, 1, size=(9, 13, 14), crop=(None, 11, 10), hflip=1, vflip=1)
    image, mask = source[1]
    box = tuple(slice(s, s + n) for s, n in zip(aug.start, aug.out, strict=True))
    want_image, want_mask = image[(slice(None), *box)].flip([2, 3]), mask[box].flip([1, 2])
    ranks = math.prod(grid)
    for sp_rank in range(ranks):
        coords = MeshCoords(
            1,
            ranks,
            0,
            sp_rank,
            sizes["sp_h"] if "sp_h" in names else 1,
            tiled=True,
            sp_d=sizes["sp_d"] if "sp_d" in names else 1,
            names=names,
        )
        back = {"sp_d": 3, "sp_h": 2, "sp_w": 1}
        assert coords.tile_placements(5) == [Shard(5 - back[n]) for n in names]
        where = dict(zip(names, np.unravel_index(sp_rank, grid), strict=True))
        want = tuple(
            strip_bounds(n, sizes[m], int(where[m])) if m in names else (0, n)
            for m, n in zip(("sp_d", "sp_h", "sp_w"), aug.out, strict=True)
        )
        block = block_bounds(cfg, coords, aug.out)
        assert block == want, (sp_rank, block, want)
        got_image, got_mask = load_box(source, 1, aug, block)
        s = tuple(slice(a, b) for a, b in block)
        assert torch.equal(got_image, want_image[(slice(None), *s)])
        assert torch.equal(got_mask, want_mask[s])
