"""``predict`` on H x W tiles and on volumes (issue 12, item 3): equal to one device.

Tiles: a seeded U-Net predicts images on a 2 x 2 grid (whole and in row bands, with class
probabilities), on two replicas of 1 x 2 tiles, on a 1 x 3 grid and on a 3 x 1 grid
(banded); every written mask must
equal the single-device arg-max pixel for pixel and ``metrics.json`` must count the
written masks. Volumes: a seeded 3-D U-Net predicts ``.npy`` volumes and a TIFF stack
split along D over 3 ranks and along W over 2 ranks (uneven blocks); the written ``.npy``
label volumes must equal the single-device arg-max. Refusals name the key, the option or
the file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from typer.testing import CliRunner

from spconv_train.train.metrics import ConfusionMatrix
from tests.test_predict_bands import UNET, _assert_argmax, _export, _image, _reference, _tiled

VOLUME = [
    "data.kind=volume",
    "data.depth=8",
    "model.name=unet3d",
    "model.in_channels=1",
    "model.num_classes=3",
    "model.kwargs={depth: 2, base_width: 4}",
]


def predict_sets(weights: str, inputs: list[str], out: str, masks=None, sets=(), **stream):
    """``run_predict`` with the overrides ``sets`` and ``StreamOptions(**stream)`` on the
    pool ranks; returns (status, metrics or error, console text)."""
    from rich.console import Console

    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._inputs import _class_names, _collect
    from spconv_train.predict._run import run_predict
    from spconv_train.predict._streamed import StreamOptions

    cfg = _load_config("export", Path(weights), None, list(sets), None)
    text = io.StringIO()
    console = Console(file=text, width=400)
    try:
        images = _collect(inputs, masks, cfg.data.kind == "volume")
        result = run_predict(
            cfg, "export", weights, images, out, console=console,
            class_names=_class_names(cfg, masks), stream=StreamOptions(**stream),
        )  # fmt: skip
        return "ok", result, text.getvalue()
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return "error", f"{type(exc).__name__}: {exc}", text.getvalue()


def _counted(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list:
    """The confusion matrix of (prediction, mask) pairs counted on one device."""
    cm = ConfusionMatrix(3, 255)
    for pred, mask in pairs:
        cm.update(torch.from_numpy(pred.reshape(1, -1, pred.shape[-1])).long(),
                  torch.from_numpy(mask.reshape(1, -1, mask.shape[-1])).long())  # fmt: skip
    return cm.local.tolist()


# --- H x W tiles ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiles_case(tmp_path_factory):
    """The exported U-Net (depth 3, stride 4), images of uneven sizes and their masks, and
    the single-device logits of each image."""
    root = tmp_path_factory.mktemp("tiles")
    weights, model = _export(root / "unet.pt", UNET, steps=25)
    images, masks = root / "images", root / "masks"
    images.mkdir()
    masks.mkdir()
    _image(images / "odd.npy", 70, 45, 0)  # tiles of 35 x 23 / 22 columns on 2 x 2
    _image(images / "small.png", 40, 64, 1)
    _image(images / "tall.npy", 120, 52, 2)  # banded: 120 = 30 x the stride 4
    rng = np.random.default_rng(3)
    for stem, (h, w) in (("odd", (70, 45)), ("small", (40, 64)), ("tall", (120, 52))):
        mask = rng.integers(0, 3, (h, w)).astype(np.uint8)
        mask[:3, :5] = 255  # ignored pixels
        np.save(masks / f"{stem}.npy", mask)
    suffix = {"odd": ".npy", "small": ".png", "tall": ".npy"}
    logits = {s: _reference(model, images / f"{s}{x}") for s, x in suffix.items()}
    return root, weights, logits


def _check_images(out: Path, case, result, stems: list[str], label: str) -> None:
    """Every written mask (``.png`` whole, ``.tif`` banded) equals the single-device
    arg-max; ``metrics.json`` counts them."""
    root, _, logits = case
    status, metrics, _ = result
    assert status == "ok", metrics
    pairs = []
    for stem in stems:
        png = out / f"{stem}.png"
        saved = np.array(Image.open(png)) if png.is_file() else _tiled(out / f"{stem}.ome.tif")
        _assert_argmax(saved, logits[stem], f"{stem} on {label}")
        assert Image.open(out / f"{stem}_overlay.png").size == saved.shape[::-1]
        pairs.append((saved, np.load(root / "masks" / f"{stem}.npy")))
    assert metrics["confusion_matrix"] == _counted(pairs), label
    assert json.loads((out / "metrics.json").read_text()) == metrics


def test_tiles_2x2_equal_one_device(dist_pool, tiles_case, tmp_path):
    """A 2 x 2 grid: whole images (PNG outputs stitched from the tiles) and 24-row bands
    with probabilities (each rank reads and predicts its tile of every band; TIFFs); and
    two replicas of 1 x 2 tiles at 4 ranks."""
    root, weights, logits = tiles_case
    images, masks, grid = root / "images", str(root / "masks"), ["parallel.sp=[2, 2]"]
    whole = [str(images / "odd.npy"), str(images / "small.png")]
    run = dist_pool.run(
        4, predict_sets, weights, whole, str(tmp_path / "w"), masks, grid, band_rows=0
    )
    assert all(r == ("ok", None, "") for r in run[1:]), run  # only rank 0 writes or prints
    _check_images(tmp_path / "w", tiles_case, run[0], ["odd", "small"], "2x2 tiles")
    # (dp, sp_h, sp_w) = (2, 1, 2): two replicas, one image each, a group per replica
    dp = ["parallel.sp=[1, 2]"]
    run = dist_pool.run(4, predict_sets, weights, whole, str(tmp_path / "d"), masks, dp)
    _check_images(tmp_path / "d", tiles_case, run[0], ["odd", "small"], "dp 2 x 1x2 tiles")
    tall = [str(images / "tall.npy")]
    out, stream = str(tmp_path / "b"), {"band_rows": 24, "probabilities": True}
    run = dist_pool.run(4, predict_sets, weights, tall, out, masks, grid, **stream)
    assert "tall: 120x52, 5 bands of 24 rows" in run[0][2], run[0]
    _check_images(tmp_path / "b", tiles_case, run[0], ["tall"], "2x2 tiles, bands")
    probs = _tiled(tmp_path / "b" / "tall_probabilities.ome.tif")
    want = (logits["tall"].softmax(0) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert probs.shape == (120, 52, 3) and np.abs(probs.astype(int) - want).max() <= 1


def test_tiles_1x3_and_3x1_equal_one_device(dist_pool, tiles_case, tmp_path):
    """Three tile columns (whole image) and three tile rows (16-row bands: most bands leave
    some tile rows without kept rows) at 3 ranks."""
    root, weights, _ = tiles_case
    images, masks = root / "images", str(root / "masks")
    small, tall = [str(images / "small.png")], [str(images / "tall.npy")]
    cols = ["parallel.sp=[1, 3]"]
    run = dist_pool.run(3, predict_sets, weights, small, str(tmp_path / "c"), masks, cols)
    _check_images(tmp_path / "c", tiles_case, run[0], ["small"], "1x3 tiles")
    rows = ["parallel.sp=[3, 1]"]
    run = dist_pool.run(
        3, predict_sets, weights, tall, str(tmp_path / "r"), masks, rows, band_rows=16
    )
    assert "tall: 120x52, 8 bands of 16 rows" in run[0][2], run[0]
    _check_images(tmp_path / "r", tiles_case, run[0], ["tall"], "3x1 tiles, bands")


def test_tiles_too_small_are_named(dist_pool, tiles_case, tmp_path):
    """An image too flat for 2 tile rows of a depth-3 U-Net fails naming the file and the
    grid; the other image is still written."""
    root, weights, logits = tiles_case
    flat = _image(tmp_path / "flat.png", 6, 40, 4)
    inputs = [str(flat), str(root / "images" / "small.png")]
    status, message, _ = dist_pool.run(
        4, predict_sets, weights, inputs, str(tmp_path / "o"), None, ["parallel.sp=[2, 2]"],
        band_rows=0,
    )[0]  # fmt: skip
    assert status == "error" and "ImagesFailed: 1 of 2" in message, message
    assert "flat.png: image 6x40 (HxW)" in message and "a grid of 2x2 tiles" in message
    _assert_argmax(np.array(Image.open(tmp_path / "o" / "small.png")), logits["small"], "small")


# --- volumes --------------------------------------------------------------------------------


def _export_volume_model(path: Path) -> tuple[str, torch.nn.Module]:
    """The seeded 3-D U-Net of ``VOLUME`` trained 15 AdamW steps on two synthetic volumes
    (class-weighted, so that it predicts more than background), with BatchNorm running
    statistics of those volumes, in eval mode, exported to ``path``."""
    from spconv_train.checkpoint import CheckpointManager
    from spconv_train.config import config_to_dict, load_config
    from spconv_train.data import SyntheticVolumes
    from spconv_train.models import build_model

    cfg = load_config(None, VOLUME)
    torch.manual_seed(0)
    model = build_model(cfg)
    data = SyntheticVolumes(2, size=(8, 16, 16), num_classes=3, seed=5)
    x, y = (torch.stack(t) for t in zip(data[0], data[1], strict=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    weight = torch.tensor([0.1, 1.0, 1.0])
    for _ in range(15):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, weight, ignore_index=255).backward()
        optimizer.step()
    with torch.no_grad():  # running statistics = the training volumes' batch statistics
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.momentum = None
                m.reset_running_stats()
        model(x)
    CheckpointManager.export(model, path, config=config_to_dict(cfg))
    return str(path), model.eval()


@pytest.fixture(scope="module")
def volume_case(tmp_path_factory):
    """The exported 3-D U-Net (depth 2), a ``.npy`` volume with a mask, a TIFF stack, and
    their single-device logits."""
    from spconv_train.data import SyntheticVolumes
    from spconv_train.data.volume_folder import volume_header
    from spconv_train.predict._volumes import read_box

    root = tmp_path_factory.mktemp("volumes")
    weights, model = _export_volume_model(root / "unet3d.pt")
    images, masks = root / "images", root / "masks"
    images.mkdir()
    masks.mkdir()
    # synthetic volumes (float32) of uneven sizes, as .npy and as a TIFF stack
    ct = SyntheticVolumes(1, size=(10, 12, 14), num_classes=3, seed=1)[0]
    stack = SyntheticVolumes(1, size=(12, 10, 16), num_classes=3, seed=2)[0]
    np.save(images / "ct.npy", ct[0][0].numpy())  # D over 3 ranks: 4, 4, 2 slices
    tifffile.imwrite(images / "stack.tif", stack[0][0].numpy())
    mask = ct[1].numpy().astype(np.uint8)
    mask[0, :2] = 255  # ignored voxels
    np.save(masks / "ct.npy", mask)
    np.save(masks / "stack.npy", stack[1].numpy().astype(np.uint8))
    logits = {}
    for path in sorted(images.iterdir()):
        x = read_box(path, tuple((0, n) for n in volume_header(path)[0]))
        with torch.no_grad():
            logits[path.stem] = model(x[None])[0]
    return root, weights, logits


@pytest.mark.parametrize(("world", "dim"), [(3, "D"), (2, "W")])
def test_volumes_equal_one_device(dist_pool, volume_case, tmp_path, world, dim):
    root, weights, logits = volume_case
    images, masks = str(root / "images"), str(root / "masks")
    result = dist_pool.run(world, predict_sets, weights, [images], str(tmp_path), masks,
                           [f"parallel.shard_dim={dim}"], probabilities=True)  # fmt: skip
    status, metrics, text = result[0]
    assert status == "ok", metrics
    assert f"ct: 10x12x14 (DxHxW), split along {dim} over {world} rank(s)" in text, text
    pairs = []
    for stem, want in logits.items():
        saved = np.load(tmp_path / f"{stem}.npy")
        assert saved.dtype == np.uint8
        flat = want.reshape(3, want.shape[1], -1)  # the tie check reads [K, rows, cols]
        _assert_argmax(saved.reshape(saved.shape[0], -1), flat, f"{stem} over {dim}")
        probs = np.load(tmp_path / f"{stem}_probabilities.npy")
        expect = (want.softmax(0) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
        assert probs.shape == (*saved.shape, 3) and np.abs(probs.astype(int) - expect).max() <= 1
        pairs.append((saved, np.load(root / "masks" / f"{stem}.npy")))
    assert metrics["confusion_matrix"] == _counted(pairs)
    assert [c["name"] for c in metrics["classes"]] == ["background", "ellipsoid", "long_band"]


def test_volume_too_small_is_named(dist_pool, volume_case, tmp_path):
    """4 slices over 3 ranks leave one rank without a slice: the volume is named with the
    way out, the other volume is still written."""
    root, weights, logits = volume_case
    np.save(tmp_path / "thin.npy", np.zeros((4, 12, 14), np.uint8))
    inputs = [str(tmp_path / "thin.npy"), str(root / "images" / "ct.npy")]
    status, message, _ = dist_pool.run(3, predict_sets, weights, inputs, str(tmp_path / "o"),
                                       None, ["parallel.shard_dim=D"])[0]  # fmt: skip
    assert status == "error" and "ImagesFailed: 1 of 2" in message, message
    assert "thin.npy: volume 4x12x14 (DxHxW)" in message and "split along D over sp=3" in message
    assert "fewer ranks" in message
    assert np.load(tmp_path / "o" / "ct.npy").shape == (10, 12, 14)


def test_refusals_name_the_key_or_option(volume_case, tiles_case, tmp_path):
    """No process group: what predict refuses exits 2 naming the option or the key."""
    from spconv_train.cli import app

    runner = CliRunner()
    vol_weights, image_weights = volume_case[1], tiles_case[1]
    ct = str(volume_case[0] / "images" / "ct.npy")
    out = ["--out", str(tmp_path / "o")]
    result = runner.invoke(app, ["predict", vol_weights, ct, *out, "--band-rows", "8"])
    assert result.exit_code == 2 and "--band-rows 8: volumes are predicted whole" in result.output
    grid = ["--set", "parallel.sp=[2, 2]"]
    result = runner.invoke(app, ["predict", vol_weights, ct, *out, *grid])
    assert result.exit_code == 2 and "parallel.sp" in result.output, result.output
    image = str(tiles_case[0] / "images" / "small.png")
    result = runner.invoke(app, ["predict", image_weights, image, *out, *grid, "--nproc", "2"])
    assert result.exit_code == 2 and "parallel.sp: a grid 2x2 = 4 ranks" in result.output
    missing = runner.invoke(app, ["predict", vol_weights, str(tmp_path / "none"), *out])
    said = " ".join(missing.output.split())  # the console wraps long lines
    assert missing.exit_code == 2 and "none: no such file or folder" in said


def test_volume_block_grid_equals_one_device(dist_pool, volume_case, tmp_path):
    """A volume split over H and W at once (``parallel.sp: [1, 2, 2]``, 4 ranks, each
    reading its block) predicts what one device does."""
    from spconv_train.data import SyntheticVolumes
    from spconv_train.models import build_model
    from spconv_train.predict import load_export
    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._volumes import read_box

    weights = volume_case[1]
    model = build_model(_load_config("export", Path(weights), None, [], None))
    model.load_state_dict(load_export(Path(weights))["model"])
    vol = SyntheticVolumes(1, size=(6, 12, 16), num_classes=3, seed=3)[0][0][0].numpy()
    np.save(tmp_path / "v.npy", vol)
    with torch.no_grad():
        want = model.eval()(read_box(tmp_path / "v.npy", ((0, 6), (0, 12), (0, 16)))[None])[0]
    inputs, grid = [str(tmp_path / "v.npy")], ["parallel.sp=[1, 2, 2]"]
    run = dist_pool.run(4, predict_sets, weights, inputs, str(tmp_path / "o"), None, grid)
    status, metrics, text = run[0]
    assert status == "ok", metrics
    assert "over 2x2 rank(s)" in text, text
    saved = np.load(tmp_path / "o" / "v.npy")
    assert saved.shape == (6, 12, 16)
    _assert_argmax(saved.reshape(6, -1), want.reshape(3, 6, -1), "grid [1, 2, 2]")
