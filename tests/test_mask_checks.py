"""Mask checks that scale: streamed band by band in the mask's dtype, cached in run_dir."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tifffile
from PIL import Image

from spconv_train.data import DataError, FolderDataset, scan
from spconv_train.data.prepare import prepare_splits


@pytest.fixture
def mask_reads(monkeypatch):
    """Every mask band the scans read: ``(rows, dtype)``."""
    reads: list[tuple[int, np.dtype]] = []
    real = scan.read_mask_raw

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        reads.append((out.shape[0], out.dtype))
        return out

    monkeypatch.setattr(scan, "read_mask_raw", recording)
    return reads


def _write_split(root, split, seed, num_classes=3, n=2, h=40, w=24):
    rng = np.random.default_rng(seed)
    for kind in ("images", "masks"):
        (root / kind / split).mkdir(parents=True, exist_ok=True)
    masks = []
    for i in range(n):
        image = rng.integers(0, 4096, (h, w), dtype=np.uint16)
        mask = rng.integers(0, num_classes, (h, w), dtype=np.uint8)
        tifffile.imwrite(root / f"images/{split}/s{i}.tif", image, tile=(16, 16))
        tifffile.imwrite(root / f"masks/{split}/s{i}.tif", mask, rowsperstrip=4)
        masks.append(mask)
    return masks


def test_mask_values_streams_bands_in_own_dtype(tmp_path, mask_reads):
    masks = _write_split(tmp_path, "train", 0)
    path = tmp_path / "masks/train/s0.tif"
    values = scan.mask_values(path, band_pixels=24 * 10)  # 10 rows a band
    assert values == sorted(int(v) for v in np.unique(masks[0]))
    assert [r for r, _ in mask_reads] == [10, 10, 10, 10]
    assert all(dt == np.uint8 for _, dt in mask_reads)  # never an int64 copy


def test_out_of_range_value_is_located_in_its_band(tmp_path):
    _write_split(tmp_path, "train", 1)
    bad = np.zeros((40, 24), dtype=np.uint8)
    bad[29, 7] = 9
    tifffile.imwrite(tmp_path / "masks/train/s1.tif", bad)
    ds = FolderDataset(tmp_path, "train", num_classes=3)
    with pytest.raises(DataError, match=r"s1.tif.*values \[9\] \(first at row 29, column 7\)"):
        ds.validate_all()
    png = tmp_path / "png"
    _write_split(png, "train", 2)
    (png / "masks/train/s0.tif").unlink()
    Image.fromarray(bad).save(png / "masks/train/s0.png")
    with pytest.raises(DataError, match=r"first at row 29, column 7"):
        FolderDataset(png, "train", num_classes=3).validate_all()


def test_second_start_reads_the_cache_and_touched_file_is_rechecked(tmp_path, mask_reads):
    data, run = tmp_path / "data", tmp_path / "run"
    _write_split(data, "train", 3)
    _write_split(data, "val", 4)

    def start():
        train = FolderDataset(data, "train", num_classes=3)
        val = FolderDataset(data, "val", num_classes=3)
        mask_reads.clear()
        prepare_splits(train, val, run)
        return len(mask_reads)

    assert start() == 4  # 4 masks, one band each at this size
    assert (run / scan.CACHE_NAME).is_file()
    assert start() == 0  # restart: nothing re-scanned
    touched = data / "masks/val/s1.tif"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert start() == 1  # only the touched mask
    # A changed mask is caught although the old one was cached as fine.
    bad = np.full((40, 24), 7, dtype=np.uint8)
    tifffile.imwrite(touched, bad)
    with pytest.raises(DataError, match=r"val/s1.tif: mask class index out of range"):
        start()
    entries = json.loads((run / scan.CACHE_NAME).read_text())["entries"]
    assert len(entries) == 4


def test_corrupt_cache_is_ignored(tmp_path, mask_reads):
    data, run = tmp_path / "data", tmp_path / "run"
    _write_split(data, "train", 5, n=1)
    _write_split(data, "val", 6, n=1)
    run.mkdir()
    (run / scan.CACHE_NAME).write_text("{not json")
    train = FolderDataset(data, "train", num_classes=3)
    prepare_splits(train, FolderDataset(data, "val", num_classes=3), run)
    assert len(mask_reads) == 2
    assert json.loads((run / scan.CACHE_NAME).read_text())["version"] == 1
