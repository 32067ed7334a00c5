"""Sizes are checked before memory is asked for (issue 21, item 4).

A tiny tiled TIFF may claim 100000 x 100000 pixels. Validation runs whole images, one
piece per spatial rank: before, such a validation image asked for a 120 GB zero tensor
(``val_check.py``), naming no file. Now every image read whole (validation images, and
training images without a crop) is compared, from its header alone, with
``data.max_image_pixels`` per rank of the mesh; over it: exit 2 naming the file and the key.
"""

from __future__ import annotations

import resource
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import tifffile

from spconv_train.data import DataError, FolderDataset, write_synthetic_dataset


def _claiming(path: Path, height: int, width: int) -> Path:
    """A 256 x 256 tiled TIFF (64 KB) whose header claims ``height`` x ``width``."""
    tifffile.imwrite(path, np.zeros((256, 256), np.uint8), tile=(256, 256), metadata=None)
    with tifffile.TiffFile(path) as tif:
        page, order = tif.pages[0], tif.byteorder
        entries = [page.tags[name].offset for name in ("ImageLength", "ImageWidth")]
    with open(path, "r+b") as f:
        for entry, value in zip(entries, (height, width), strict=True):
            f.seek(entry + 2)  # the IFD entry after its tag code: type LONG, count 1, value
            f.write(struct.pack(order + "HII", 4, 1, value))
    return path


def _dataset(root: Path) -> Path:
    write_synthetic_dataset(root, num_train=2, num_val=1, height=32, width=64, num_classes=3)
    return root


def _add_pair(root: Path, split: str, stem: str, height: int, width: int, claim: bool) -> Path:
    image = root / "images" / split / f"{stem}.tif"
    mask = root / "masks" / split / f"{stem}.tif"
    if claim:
        _claiming(image, height, width)
        _claiming(mask, height, width)
    else:  # real pixels, tiled and compressed: small files
        rgb = np.zeros((height, width, 3), np.uint8)
        tifffile.imwrite(image, rgb, tile=(256, 256), compression="zlib")
        tifffile.imwrite(mask, rgb[..., 0], tile=(256, 256), compression="zlib")
    return image


def test_header_claiming_10_gigapixels_is_refused_without_reading(tmp_path):
    root = _dataset(tmp_path / "d")
    huge = _add_pair(root, "val", "huge", 100_000, 100_000, claim=True)
    assert huge.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            FolderDataset(root, "val", num_classes=3).validate_all(grid=(1, 2))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6  # nothing decoded (a band of the mask scan alone would be 16 MB)
    message = str(info.value)
    assert info.value.path == str(huge)
    assert (
        f"{huge}: val image of 100000x100000 (HxW) is read whole, as 2 strip(s): each rank "
        "would hold 100000x50000 = 5,000,000,000 pixels, over data.max_image_pixels="
        "2,000,000,000; remove it from the val split" in message
    )
    assert "parallel.sp" in message
    skip = FolderDataset(root, "val", num_classes=3, on_bad_sample="skip")
    assert [f for f, _ in skip.validate_all(grid=(1, 2))] == [str(huge)] and len(skip) == 1


def test_the_limit_is_per_rank_of_the_mesh_and_crops_pass(tmp_path):
    root = _dataset(tmp_path / "d")
    big = _add_pair(root, "val", "big", 1500, 1500, claim=False)
    kw = {"num_classes": 3, "max_image_pixels": 1_000_000}
    with pytest.raises(DataError, match=r"each rank would hold 1500x1500 = 2,250,000 pixels"):
        FolderDataset(root, "val", **kw).validate_all()
    with pytest.raises(DataError, match=r"as 2 strip\(s\): each rank would hold 1500x750"):
        FolderDataset(root, "val", **kw).validate_all(grid=(1, 2))
    FolderDataset(root, "val", **kw).validate_all(grid=(2, 2))  # 750 x 750 tiles fit
    FolderDataset(root, "val", **kw).validate_all(grid=(1, 4))  # 1500 x 375 strips fit
    big.rename(root / "images" / "train" / big.name)
    (root / "masks" / "val" / big.name).rename(root / "masks" / "train" / big.name)
    train = FolderDataset(root, "train", **kw)
    train.validate_all(crop=(32, 64))  # read as crops: the file's size does not matter
    train.validate_all(crop=(None, 64))  # whole height: 1500 x 64 fits
    with pytest.raises(DataError, match=r"hold 1500x1000 .* set data.height and data.width"):
        FolderDataset(root, "train", **kw).validate_all(crop=(None, 1000))


CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4}}}}
data: {{source: folder, root: {root}, height: 32, width: 64, max_image_pixels: {limit}}}
training: {{steps: 2, val_every: 2, log_every: 1}}
checkpoint: {{every: 2}}
logging: {{tensorboard: false, progress: false}}
"""


def _run(tmp_path: Path, root: Path, limit: int):
    """``spconv-train run`` in this process (one rank): (exit code, console, run_dir)."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir, root=root, limit=limit), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config)], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split()), run_dir


@pytest.mark.parametrize(
    ("height", "claim", "limit"),
    [(100_000, True, 2_000_000_000), (1500, False, 1_000_000)],
    ids=["claims-10-gigapixels", "real-over-lowered-limit"],
)
def test_run_exits_2_naming_the_file_before_anything_is_allocated(tmp_path, height, claim, limit):
    root = _dataset(tmp_path / "d")
    image = _add_pair(root, "val", "big", height, height, claim=claim)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, out, run_dir = _run(tmp_path, root, limit)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert code == 2, out[-3000:]
    assert f"{image}: val image of {height}x{height} (HxW) is read whole" in out
    assert f"over data.max_image_pixels={limit:,}" in out
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.yaml").exists()
    assert grown_mb < 500, f"peak memory grew by {grown_mb:.0f} MB"
