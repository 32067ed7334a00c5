"""H x W tiles in the product (issue 12 item 3, 2-D part): ``parallel.sp: [p, q]``.

Config and mesh resolution, per-tile loading of augmented samples (equal to slicing the
whole augmented sample), the trainer's feed and validation items on a (dp, sp_h, sp_w)
mesh, ``run_verify`` on 2x2 and 2x1x2 meshes (sharded vs one device, float64), and one training
run on the shared worker groups: 2 steps on width strips (2 ranks), resumed on a 2x2 grid
(4 ranks) to 6 steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from spconv_train.config import ConfigError, load_config, spatial_grid, validate_for_world
from spconv_train.data import DataError, SyntheticDataset, draw_augment, load_strip, strip_bounds
from tests.dist_harness import train_on_group
from tests.test_train_e2e import TINY, read_metrics
from tests.test_verify import TINY as VERIFY_TINY
from tests.test_verify import _failed, verify_cases

pytestmark = pytest.mark.e2e  # runs the command line or torchrun as processes

# --- config ---------------------------------------------------------------------------------


def test_grid_config_resolves_the_mesh() -> None:
    cfg = load_config(None, ["parallel.sp=[2, 3]", "data.height=32", "data.width=64"])
    assert cfg.parallel.sp == [2, 3] and spatial_grid(cfg) == (2, 3)
    assert validate_for_world(cfg, 6) == (1, 6)
    assert validate_for_world(cfg, 12) == (2, 6)  # dp = world / (p * q)
    assert spatial_grid(load_config(None, ["parallel.sp=4"])) is None  # an int: strips
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, 4)
    assert info.value.key == "parallel.sp" and "2x3 = 6 ranks does not divide" in str(info.value)
    # every tile row must get rows: 6 rows over 4 tile rows in chunks of 2 leave one empty
    cfg = load_config(None, ["parallel.sp=[4, 1]", "data.height=6"])
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, 4)
    assert info.value.key == "data.height" and "1 rank(s) empty" in str(info.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.sp=[2]"], "a grid [p, q]"),
        (["parallel.sp=[0, 2]"], "a grid [p, q]"),
        (["parallel.sp=[2, 2.5]"], "item 1: expected an integer"),
        (["parallel.sp=two"], "an integer or a list of integers"),
        (["parallel.sp=[2, 2]", "data.kind=volume"], "volumes split one dim"),
    ],
)
def test_grid_config_errors_name_the_key(overrides, words) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == "parallel.sp" and words in str(info.value)


def test_show_config_prints_the_tiles() -> None:
    from tests.test_cli import UNET, invoke

    result = invoke("show-config", UNET, "--set", "parallel.sp=[2, 2]", "--world-size", "8")
    assert result.exit_code == 0, result.output
    assert "dp=2 x sp=4 (2x2 tiles)" in result.output
    bad = invoke("show-config", UNET, "--set", "parallel.sp=[2, 2]", "--world-size", "6")
    assert bad.exit_code == 2 and "parallel.sp" in bad.output


# --- data: a tile of the augmented sample equals the slice of the whole ----------------------


@pytest.mark.parametrize("scale", [(1.0, 1.0), (0.7, 1.4)])
def test_tiles_of_augmented_samples_stitch_to_the_whole(scale) -> None:
    source = SyntheticDataset(4, height=23, width=29, num_classes=3, seed=5)
    for index in range(4):
        p = draw_augment(
            1, 2, index, image_hw=(23, 29), crop_hw=(19, 31), hflip=0.5, vflip=0.5, scale=scale
        )
        full_image, full_mask = load_strip(source, index, (0, 31), p)
        for rows_parts, cols_parts in ((2, 2), (3, 2), (2, 3)):
            for i in range(rows_parts):
                for j in range(cols_parts):
                    r, s = strip_bounds(19, rows_parts, i)
                    a, b = strip_bounds(31, cols_parts, j)
                    image, mask = load_strip(source, index, (a, b), p, rows=(r, s))
                    torch.testing.assert_close(image, full_image[:, r:s, a:b], rtol=0, atol=0)
                    assert torch.equal(mask, full_mask[r:s, a:b])


# --- in the worker pool ---------------------------------------------------------------------


def _feed_pieces(overrides: list[str]) -> dict:
    """The trainer's first batch and validation item on this rank of a tile mesh."""
    from spconv_train.distributed import build_mesh, spatial_mesh
    from spconv_train.train.data_feed import MeshCoords, TrainFeed, build_sources, val_items

    cfg = load_config(None, overrides)
    dp, sp = validate_for_world(cfg, torch.distributed.get_world_size())
    mesh = build_mesh(dp, sp, "cpu", spatial_grid(cfg))
    train, val, _ = build_sources(cfg)
    coords = MeshCoords.of(mesh)
    batch = next(iter(TrainFeed(train, cfg, mesh, torch.device("cpu"))))
    item = next(val_items(val, cfg, coords, spatial_mesh(mesh), torch.device("cpu")))
    return {
        "coords": coords,
        "batch": batch.image.full_tensor(),
        "local": batch.image.to_local(),
        "target": batch.target,
        "val": item.image.full_tensor(),
        "val_local": item.image.to_local(),
        "val_target": item.target,
        "rows": item.rows,
        "cols": item.cols,
        "placements": list(batch.image.placements),
    }


def test_feed_loads_tiles_on_a_dp_tile_mesh(dist_pool) -> None:
    from torch.distributed.tensor import Shard

    overrides = ["parallel.sp=[2, 1]", "data.height=21", "data.width=18", "data.vflip=0.5"]
    out = dist_pool.run(4, _feed_pieces, overrides)  # (dp, sp_h, sp_w) = (2, 2, 1)
    assert [o["coords"].dp_rank for o in out] == [0, 0, 1, 1]
    assert [o["coords"].sp_rank for o in out] == [0, 1, 0, 1]
    assert out[0]["placements"] == [Shard(0), Shard(2), Shard(3)]
    for o in out:
        r = 0 if o["coords"].sp_rank == 0 else 11  # 21 rows over 2 tile rows: 11, 10
        h = 11 if r == 0 else 10
        replica = o["batch"][o["coords"].dp_rank : o["coords"].dp_rank + 1]
        assert torch.equal(o["local"], replica[:, :, r : r + h])
        assert o["target"].shape == (1, h, 18)
        assert o["rows"] == (r, r + h) and o["cols"] == (0, 18)
        assert o["val_local"].shape[-2:] == (h, 18) and o["val_target"].shape == (1, h, 18)
    torch.testing.assert_close(out[0]["batch"], out[3]["batch"])  # one global batch


def test_verify_on_a_2x2_grid(dist_pool) -> None:
    overrides = VERIFY_TINY + ["data.height=34", "data.width=66", "data.vflip=0.5"]
    report = dist_pool.run(4, verify_cases, [(overrides + ["parallel.sp=[2, 2]"], {"steps": 1})])
    report = report[0][0]
    assert report["passed"], _failed(report)
    assert not report["activation_sized_collectives"]
    assert max(c["max_rel_err"] for c in report["checks"]) < 1e-10
    assert report["mesh"] == {"dp": 1, "sp": 4}


def test_verify_on_a_dp_tile_mesh(dist_pool) -> None:
    cases = [(VERIFY_TINY + ["parallel.sp=[1, 2]"], {"steps": 2})]  # (dp, sp_h, sp_w) = (2, 1, 2)
    report = dist_pool.run(4, verify_cases, cases)[0][0]
    assert report["passed"], _failed(report)
    assert report["mesh"] == {"dp": 2, "sp": 2} and report["batch_shape"] == [2, 3, 32, 64]


def _short_val_check(height: int) -> tuple[str, str | None]:
    """``check_val_sizes`` on a 2x2 grid, validation images ``height`` x 64 rows."""
    from spconv_train.distributed import build_mesh, spatial_mesh
    from spconv_train.parallel import parallelize
    from spconv_train.train.data_feed import MeshCoords
    from spconv_train.train.loop import build_model
    from spconv_train.train.val_check import check_val_sizes

    sets = ["model.num_classes=3", "model.kwargs={depth: 3, base_width: 4}", "parallel.sp=[2, 2]"]
    cfg = load_config(None, [*sets, "data.height=32", "data.width=64"])
    source = SyntheticDataset(1, height=height, width=64, num_classes=3)
    mesh = build_mesh(1, 4, "cpu", (2, 2))
    torch.manual_seed(0)
    model = parallelize(build_model(cfg), mesh)
    try:
        coords, cpu = MeshCoords.of(mesh), torch.device("cpu")
        check_val_sizes(model, source, cfg, coords, spatial_mesh(mesh), cpu)
    except DataError as exc:
        return "error", str(exc)
    return "ok", None


def test_validation_image_too_short_for_the_tiles_is_reported_up_front(dist_pool) -> None:
    for status, message in dist_pool.run(4, _short_val_check, 4):
        assert status == "error", message
        assert "validation image 4x64 (HxW) cannot run through unet" in message
        assert "parallel.sp=[2, 2]" in message and "fewer tile rows" in message
    assert dist_pool.run(4, _short_val_check, 24)[0] == ("ok", None)


# --- training: strips -> tiles ---------------------------------------------------------------


def test_run_resumes_strip_checkpoint_on_a_tile_grid(dist_pool, tmp_path) -> None:
    """2 steps on 2 width strips (2 ranks), then resumed on a 2x2 grid (4 ranks) to 6 steps:
    real ``train()`` on the shared worker groups (the command line around it runs under
    torchrun in tests/test_train_e2e.py)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tmp_path / "run.yaml"
    text = TINY.format(run_dir=tmp_path / "run").replace("lr: 3.0e-3", "lr: 1.0e-2")
    text = text.replace("height: 32, width: 64", "height: 34, width: 66")
    config.write_text(text, encoding="utf-8")
    dist_pool.run(2, train_on_group, str(config), ["training.steps=2"], False)
    sets = ["training.steps=6", "parallel.sp=[2, 2]"]
    out = "".join(dist_pool.run(4, train_on_group, str(config), sets, True)[0].split())
    assert "meshdp=1xsp=4(2x2tiles)" in out and "resumedfrom" in out, out  # rank 0's console
    run_dir = tmp_path / "run"
    lines = read_metrics(run_dir)
    train = [m for m in lines if m["split"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    losses = [m["loss"] for m in train]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # it learns
    val = [m for m in lines if m["split"] == "val"]
    assert [m["step"] for m in val] == [2, 4, 6] and all(0 <= m["miou"] <= 1 for m in val)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-000006"
    meta = json.loads((ckpt / "step-000006" / "meta.json").read_text())
    assert meta["shared"]["data"]["epoch"] >= 0
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    panel = acc.Images("val/panel_0")[-1]  # stitched from 2x2 tiles, downsampled by 2
    assert (panel.height, panel.width) == (17, 3 * 33 + 2 * 2)
    # predict takes an explicit grid (tests/test_predict_tiles.py); one that does not fit
    # the ranks is refused naming the key (before any image is read)
    from typer.testing import CliRunner

    from spconv_train.cli import app

    args = ["predict", str(run_dir / "model.pt"), str(tmp_path / "none.png")]
    args += ["--out", str(tmp_path / "pred"), "--set", "parallel.sp=[2, 2]", "--nproc", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "parallel.sp: a grid 2x2" in result.output, result.output
