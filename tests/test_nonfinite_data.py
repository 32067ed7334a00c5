"""NaN / Inf in images are data errors, found where they enter (issue 21, item 3).

- A float TIFF or ``.npy`` image holding NaN / Inf is named up front (``validate_all``,
  streamed and cached) and, for a file changed since, when it is loaded; both go through
  ``data.on_bad_sample`` like any other bad file.
- Validation either scores every image or names the ones it left out: a validation image
  that turns bad after the up-front check, or whose model output is non-finite, is skipped
  from the loss *and* the metrics, named once and counted; the scores then equal those of
  the run without it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from spconv_train.data import DataError, FolderDataset
from spconv_train.data.scan import ScanCache

H, W, K = 32, 64, 3


def _image(seed: int) -> np.ndarray:
    """A float32 [H, W, 3] image in [0, 1]."""
    return np.random.default_rng(seed).random((H, W, 3), dtype=np.float32)


def _mask(seed: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).integers(0, K, (H, W), dtype=np.uint8)


def _dataset(root: Path, train: int = 3, val: int = 2) -> Path:
    """Float TIFF training images, float ``.npy`` ([C, H, W]) validation images."""
    for split, n in (("train", train), ("val", val)):
        (root / "images" / split).mkdir(parents=True)
        (root / "masks" / split).mkdir(parents=True)
        for i in range(n):
            seed = i if split == "train" else 50 + i
            if split == "train":
                tifffile.imwrite(root / "images" / split / f"{split}{i}.tif", _image(seed))
            else:
                np.save(
                    root / "images" / split / f"{split}{i}.npy", _image(seed).transpose(2, 0, 1)
                )
            Image.fromarray(_mask(seed)).save(root / "masks" / split / f"{split}{i}.png")
    return root


def _add(root: Path, split: str, stem: str, pixels: np.ndarray) -> Path:
    """A [H, W, 3] float image ``stem`` (TIFF for train, .npy for val) with a mask."""
    if split == "train":
        path = root / "images" / split / f"{stem}.tif"
        tifffile.imwrite(path, pixels, tile=(16, 16))
    else:
        path = root / "images" / split / f"{stem}.npy"
        np.save(path, pixels.transpose(2, 0, 1))
    Image.fromarray(_mask(7)).save(root / "masks" / split / f"{stem}.png")
    return path


def _with(value: float, row: int, col: int, channel: int = 1) -> np.ndarray:
    pixels = _image(9)
    pixels[row, col, channel] = value
    return pixels


# --- the data layer --------------------------------------------------------------------------


def test_nan_and_inf_images_are_named_up_front_and_when_loaded(tmp_path):
    root = _dataset(tmp_path / "d")
    nan_tif = _add(root, "train", "nan", _with(np.nan, 5, 7))
    pixels = _with(np.inf, 20, 3)
    pixels[30, 60, 0] = -np.inf
    inf_npy = _add(root, "val", "inf", pixels)

    with pytest.raises(DataError) as info:
        FolderDataset(root, "train", num_classes=K).validate_all()
    assert info.value.path == str(nan_tif)
    assert f"{nan_tif}: image holds 1 NaN and 0 Inf value(s) (first at row 5, column 7)" in str(
        info.value
    )
    cache = ScanCache(tmp_path / "cache.json")
    val = FolderDataset(root, "val", num_classes=K, on_bad_sample="skip")
    with cache.locked():
        skipped = val.validate_all(cache)
    assert [f for f, _ in skipped] == [str(inf_npy)] and len(val) == 2
    assert skipped[0][1].startswith(
        "image holds 0 NaN and 2 Inf value(s) (first at row 20, column 3)"
    )
    # The verdicts are cached: a restart reads neither file again.
    again = FolderDataset(root, "val", num_classes=K, on_bad_sample="skip")
    cache = ScanCache(tmp_path / "cache.json")
    with cache.locked():
        assert again.validate_all(cache) == skipped
    assert cache.misses == 0

    # A file that turns bad after the up-front check: the load names it (rows 16.. of a tile).
    train = FolderDataset(root, "train", num_classes=K)
    nan_tif.unlink()
    (root / "masks" / "train" / "nan.png").unlink()
    train = FolderDataset(root, "train", num_classes=K)
    train.validate_all()
    tifffile.imwrite(root / "images" / "train" / "train1.tif", _with(np.nan, 18, 40), tile=(16, 16))
    train.load(0, cols=(0, 32))  # train0: fine
    with pytest.raises(DataError, match=r"train1.tif: image holds 1 NaN .*row 18, column 40"):
        train.load(1, cols=(32, 64), rows=(16, 32))


# --- the command line, one process ------------------------------------------------------------

CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4}}}}
data: {{source: folder, root: {root}, height: 32, width: 64, on_bad_sample: {mode},
        hflip: 0.0}}
training: {{steps: 3, val_every: 2, log_every: 1}}
checkpoint: {{every: 3}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def _run(tmp_path: Path, root: Path, mode: str, name: str):
    """``spconv-train run`` in this process (one rank); (exit code, console, metrics)."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    run_dir = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir, root=root, mode=mode), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config)], env={"COLUMNS": "200"})
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return result.exit_code, " ".join(result.output.split()), [json.loads(s) for s in lines]


def test_run_skips_or_stops_on_nan_images_up_front(tmp_path):
    """Skip mode: the NaN training TIFF and the Inf validation .npy are named and counted,
    and training runs on the rest. Error mode: exit 2 naming the file, nothing trained."""
    root = _dataset(tmp_path / "d")
    nan_tif = _add(root, "train", "nan", _with(np.nan, 5, 7))
    inf_npy = _add(root, "val", "inf", _with(np.inf, 20, 3))

    code, out, metrics = _run(tmp_path, root, "skip", "skip")
    assert code == 0, out[-3000:]
    assert f"skipped train sample {nan_tif} (up front): image holds 1 NaN" in out
    assert f"skipped val sample {inf_npy} (up front): image holds 0 NaN and 1 Inf" in out
    assert "skipped samples │ 2 (named above" in out
    skipped = [(r["data_split"], r["file"]) for r in metrics if r["split"] == "skipped"]
    assert skipped == [("train", str(nan_tif)), ("val", str(inf_npy))]
    val = [r for r in metrics if r["split"] == "val"]
    assert [r["step"] for r in val] == [2, 3]
    assert all(np.isfinite(r["loss"]) and r["skipped_images"] == 0 for r in val)

    code, out, _ = _run(tmp_path, root, "error", "error")
    assert code == 2, out[-3000:]
    assert f"{nan_tif}: image holds 1 NaN and 0 Inf value(s) (first at row 5, column 7)" in out
    assert not (tmp_path / "error" / "checkpoints").exists()


@pytest.fixture
def flaky_val(monkeypatch):
    """Files whose pixels turn NaN after the up-front check (when training loads them)."""
    import spconv_train.data.folder as folder

    bad: set[Path] = set()
    original = folder.read_image_raw

    def read_image_raw(path, cols, *args, **kwargs):
        pixels = original(path, cols, *args, **kwargs)
        if Path(path) in bad:
            pixels = pixels.copy()
            pixels[0, 0, 0] = np.nan
        return pixels

    monkeypatch.setattr(folder, "read_image_raw", read_image_raw)
    return bad


def test_validation_scores_every_image_or_names_the_skipped_ones(tmp_path, flaky_val):
    """Two validation images go bad in ways the up-front check cannot see: one's file holds
    NaN when validation loads it, the other's pixels are finite but so large (+-3e38) that the
    model's output overflows. Skip mode leaves both out of the loss and the metrics, names
    each once (two validations) and counts them; the scores equal those of the same run
    without the two images. Error mode stops with exit 2 naming the first."""
    root = _dataset(tmp_path / "d", val=2)
    clean = tmp_path / "clean"
    _dataset(clean, val=2)
    flaky = _add(root, "val", "flaky", _image(11))
    flaky_val.add(flaky)
    signs = np.sign(_image(12) - 0.5).astype(np.float32)
    huge = _add(root, "val", "huge", signs * np.float32(3e38))

    code, out, metrics = _run(tmp_path, root, "skip", "skip")
    assert code == 0, out[-3000:]
    assert len(re.findall(rf"skipped val sample {re.escape(str(flaky))} \(at step 2\): "
                          r"image holds 1 NaN", out)) == 1  # fmt: skip
    assert len(re.findall(rf"skipped val sample {re.escape(str(huge))} \(at step 2\): "
                          r"non-finite validation loss", out)) == 1  # fmt: skip
    assert "skipped samples │ 2 (named above" in out
    skipped = [(r["step"], r["file"]) for r in metrics if r["split"] == "skipped"]
    assert skipped == [(2, str(flaky)), (2, str(huge))]
    code, out_clean, reference = _run(tmp_path, clean, "skip", "clean")
    assert code == 0, out_clean[-3000:]
    val = [r for r in metrics if r["split"] == "val"]
    want = [r for r in reference if r["split"] == "val"]
    assert [r["skipped_images"] for r in val] == [2, 2]
    keys = ("step", "loss", "miou", "pixel_accuracy", "mean_dice")
    assert [[r[k] for k in keys] for r in val] == [[r[k] for k in keys] for r in want]
    assert all(np.isfinite(r["loss"]) for r in val)

    code, out, _ = _run(tmp_path, root, "error", "error")
    assert code == 2, out[-3000:]
    assert f"{flaky}: image holds 1 NaN" in out and "while loading a validation image" in out


# --- validation on two ranks: one rank's strip fails to load ---------------------------------


def validate_with_rank1_failure(root: str, mode: str, bad_stem: str, drop: bool, fail: bool = True):
    """On every pool rank: ``validate`` (sp = world) over the val split of ``root`` whose
    load of ``bad_stem`` fails on rank 1 only (``drop``: the image removed instead; not
    ``fail``: loads as it is); returns (loss, miou, skipped_images, skipped records) or
    the error."""
    import torch
    import torch.distributed as dist

    from spconv_train.config import load_config
    from spconv_train.distributed import DistInfo, build_mesh
    from spconv_train.logging import RunLogger
    from spconv_train.parallel import parallelize
    from spconv_train.train.loop import _Run, build_model
    from spconv_train.train.preemption import StopRequests
    from spconv_train.train.validation import validate
    from spconv_train.train.watchdog import Watchdog

    sets = ["model.num_classes=3", "model.kwargs={depth: 2, base_width: 4}", "run_dir=/x"]
    cfg = load_config(None, [*sets, f"data.on_bad_sample={mode}", "data.height=32"])
    source = FolderDataset(root, "val", num_classes=K, on_bad_sample=mode)
    source.validate_all()
    if drop:
        source._items = [item for item in source._items if item[0] != bad_stem]
    rank, world = dist.get_rank(), dist.get_world_size()
    original = source.load

    def load(i, cols=None, rows=None):
        if source.name(i) == bad_stem and rank == 1 and fail:
            path = source.files(i)[0]
            raise DataError(f"{path}: simulated", path=str(path), reason="simulated")
        return original(i, cols, rows)

    source.load = load
    mesh = build_mesh(1, world, "cpu")
    torch.manual_seed(0)
    model = parallelize(build_model(cfg), mesh)
    info = DistInfo(rank, world, rank, "gloo", torch.device("cpu"), False)
    logger = RunLogger("/nonexistent", enabled=False, tensorboard=False, progress=False)
    run = _Run(cfg, info, mesh, model, source, ["a", "b", "c"], logger,
               Watchdog(60, rank, enabled=False), StopRequests())  # fmt: skip
    try:
        scores = validate(run, 1)
    except DataError as exc:
        return "error", str(exc)
    skipped = [(r.file, r.reason, r.step) for r in run.skipped]
    return scores["loss"], scores["miou"], scores["skipped_images"], skipped


def test_validation_agrees_on_a_strip_only_one_rank_failed_to_load(dist_pool, tmp_path):
    root = _dataset(tmp_path / "d", val=3)
    bad = str(root / "images" / "val" / "val1.npy")
    results = dist_pool.run(2, validate_with_rank1_failure, str(root), "skip", "val1", False)
    want = dist_pool.run(2, validate_with_rank1_failure, str(root), "skip", "val1", True)
    for (loss, miou, n, skipped), (ref_loss, ref_miou, ref_n, _) in zip(results, want, strict=True):
        assert (loss, miou) == (ref_loss, ref_miou) and np.isfinite(loss)
        assert n == 1 and ref_n == 0
        assert skipped == [(bad, "simulated", 1)]
    errors = dist_pool.run(2, validate_with_rank1_failure, str(root), "error", "val1", False)
    assert errors[0] == errors[1] and errors[0][0] == "error"
    assert f"{bad}: simulated (while loading a validation image)" in errors[0][1]


def test_nan_in_a_float_volume_is_named_up_front_and_when_read(tmp_path):
    from spconv_train.data import VolumeFolder

    def pair(split: str, stem: str, image: np.ndarray) -> Path:
        for sub, arr in (("images", image), ("masks", np.zeros(image.shape[-3:], np.uint8))):
            (tmp_path / sub / split).mkdir(parents=True, exist_ok=True)
            np.save(tmp_path / sub / split / f"{stem}.npy", arr)
        return tmp_path / "images" / split / f"{stem}.npy"

    rng = np.random.default_rng(0)
    pair("train", "ok", rng.random((2, 6, 5, 7), dtype=np.float32))
    volume = rng.random((2, 6, 5, 7), dtype=np.float32)
    volume[1, 4, 2, 3] = np.nan
    bad = pair("train", "nan", volume)
    with pytest.raises(DataError, match=r"nan\.npy: image holds 1 NaN .*slice 4, row 2, column 3"):
        VolumeFolder(tmp_path, "train", num_classes=2)
    skip = VolumeFolder(tmp_path, "train", num_classes=2, on_bad_sample="skip")
    assert [f for f, _ in skip.skipped] == [str(bad)] and len(skip) == 1
    volume[1, 4, 2, 3] = 0.5  # passes up front, then turns bad on disk
    good = pair("val", "later", volume)
    source = VolumeFolder(tmp_path, "val", num_classes=2)
    volume[0, 5, 4, 6] = np.inf
    np.save(good, volume)
    with pytest.raises(DataError, match=r"later\.npy: image holds 0 NaN and 1 Inf .*slice 5"):
        source.read(0, ((3, 6), (0, 5), (0, 7)))


def test_validation_loss_leaves_out_images_without_labels(dist_pool, tmp_path):
    """val2 holds only ignore_index: it adds nothing (as if removed). val1's right half,
    rank 1's strip, holds only ignore_index: it still counts (labels on rank 0)."""
    root = _dataset(tmp_path / "d", val=3)
    Image.fromarray(np.full((H, W), 255, np.uint8)).save(root / "masks" / "val" / "val2.png")
    half = _mask(51)
    half[:, W // 2 :] = 255
    Image.fromarray(half).save(root / "masks" / "val" / "val1.png")
    got = dist_pool.run(2, validate_with_rank1_failure, str(root), "error", "val2", False, False)
    want = dist_pool.run(2, validate_with_rank1_failure, str(root), "error", "val2", True, False)
    assert got[0] == got[1] and got[0][:3] == want[0][:3] and np.isfinite(got[0][0])
    without_val1 = dist_pool.run(
        2, validate_with_rank1_failure, str(root), "error", "val1", True, False
    )
    assert without_val1[0][0] != got[0][0]  # val1 is scored
