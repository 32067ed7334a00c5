"""Tests for spconv_train.data's folder datasets: missing pairs, split lists, and files that
cannot be read or do not fit (truncated, garbage, wrong mask size or values), each error
naming the file and the fix; the skip mode that drops and counts them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from spconv_train.data import DataError, FolderDataset


def _save_png(path: Path, arr: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def _make_pair(root: Path, stem: str, h: int = 6, w: int = 9, split: str = "train", **kw):
    """A random RGB PNG image and an 'L' PNG mask with values < 3; kw overrides the arrays."""
    rng = np.random.default_rng(sum(map(ord, stem)))  # stable across runs
    image = kw.get("image", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    mask = kw.get("mask", rng.integers(0, 3, (h, w), dtype=np.uint8))
    _save_png(root / "images" / split / f"{stem}.png", image)
    _save_png(root / "masks" / split / f"{stem}.png", mask)
    return image, mask


def test_missing_pairs_name_the_stems(tmp_path):
    _make_pair(tmp_path, "a")
    _make_pair(tmp_path, "b")
    (tmp_path / "masks/train/b.png").unlink()
    _save_png(tmp_path / "masks/train/c.png", np.zeros((6, 9), np.uint8))
    with pytest.raises(DataError, match=r"no mask .* b\.png.*no image .* c\.png"):
        FolderDataset(tmp_path, "train", num_classes=3)
    ds = FolderDataset(tmp_path, "train", num_classes=3, on_bad_sample="skip")
    assert len(ds) == 1 and {Path(f).name for f, _ in ds.skipped} == {"b.png", "c.png"}
    with pytest.raises(DataError, match="image folder not found"):
        FolderDataset(tmp_path, "val", num_classes=3)


def test_split_list(tmp_path):
    for stem in ("a", "b", "c"):
        _make_pair(tmp_path, stem)
    (tmp_path / "train.txt").write_text("# chosen\nc\n\na.png  # with extension\n")
    ds = FolderDataset(tmp_path, "train", num_classes=3, split_list="train.txt")
    assert [ds.name(i) for i in range(len(ds))] == ["c", "a"]
    (tmp_path / "bad.txt").write_text("a\nzz\n")
    with pytest.raises(DataError, match="zz"):
        FolderDataset(tmp_path, "train", num_classes=3, split_list=tmp_path / "bad.txt")


def test_truncated_png_image_and_mask(tmp_path):
    _make_pair(tmp_path, "good", h=32, w=32)
    _make_pair(tmp_path, "bad", h=32, w=32)
    for kind in ("images", "masks"):
        path = tmp_path / kind / "train/bad.png"
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        ds = FolderDataset(tmp_path, "train", num_classes=3)
        with pytest.raises(DataError, match=rf"{kind}/train/bad\.png"):
            ds.validate_all()
        with pytest.raises(DataError, match=rf"{kind}/train/bad\.png"):
            ds.load(0)  # sorted stems: "bad" is sample 0
        path.write_bytes(data)


def test_garbage_npy_names_file(tmp_path):
    _make_pair(tmp_path, "a")
    (tmp_path / "images/train/a.png").unlink()
    (tmp_path / "images/train/a.npy").write_bytes(b"not an npy file")
    with pytest.raises(DataError, match=r"a\.npy: cannot read"):
        FolderDataset(tmp_path, "train", num_classes=3).size(0)


def test_mask_size_mismatch_gives_both_sizes(tmp_path):
    _make_pair(tmp_path, "a", h=6, w=9, mask=np.zeros((6, 8), np.uint8))
    ds = FolderDataset(tmp_path, "train", num_classes=3)
    with pytest.raises(DataError, match=r"masks/train/a\.png: mask size 6x8 .* size 6x9"):
        ds.validate_all()
    with pytest.raises(DataError, match="6x8"):
        ds.load(0)


def test_mask_values_out_of_range(tmp_path):
    mask = np.zeros((6, 9), np.uint8)
    mask[2, 7] = 5
    _make_pair(tmp_path, "a", mask=mask)
    ds = FolderDataset(tmp_path, "train", num_classes=3)
    with pytest.raises(DataError, match=r"a\.png: mask class index out of range: values \[5\]"):
        ds.validate_all()
    with pytest.raises(DataError, match="row 2, column 7"):
        ds.load(0, (4, 9))  # global column, not the strip's
    ds.load(0, (0, 4))  # the bad pixel is outside these columns


@pytest.mark.parametrize("num_classes", [2, 3])
def test_binary_0_255_mask_hint(tmp_path, num_classes):
    mask = np.zeros((6, 9), np.uint8)
    mask[:, 4:] = 255
    _make_pair(tmp_path, "a", mask=mask)
    ds = FolderDataset(tmp_path, "train", num_classes=num_classes, ignore_index=100)
    with pytest.raises(DataError, match=r"a\.png: .*looks like a 0/255 binary mask"):
        ds.validate_all()
    # With ignore_index=255 the masks are valid, but all foreground would be ignored.
    ds = FolderDataset(tmp_path, "train", num_classes=num_classes)
    with pytest.warns(UserWarning, match="0/255"):
        ds.validate_all()


@pytest.mark.parametrize("fmt", ["png", "npy"])
def test_rgb_mask_hint(tmp_path, fmt):
    _make_pair(tmp_path, "a")
    rgb = np.zeros((6, 9, 3), np.uint8)
    (tmp_path / "masks/train/a.png").unlink()
    if fmt == "png":
        _save_png(tmp_path / "masks/train/a.png", rgb)
    else:
        np.save(tmp_path / "masks/train/a.npy", rgb)
    ds = FolderDataset(tmp_path, "train", num_classes=3)
    with pytest.raises(DataError, match=rf"masks/train/a\.{fmt}: .*RGB.*class ind"):
        ds.validate_all()
    with pytest.raises(DataError, match="RGB"):
        ds.load(0)


def test_skip_mode_drops_and_counts(tmp_path):
    for stem in ("a", "b", "c"):
        _make_pair(tmp_path, stem)
    _make_pair(tmp_path, "d", mask=np.full((6, 9), 7, np.uint8))  # out of range
    _make_pair(tmp_path, "e", mask=np.zeros((5, 9), np.uint8))  # wrong size
    with pytest.raises(DataError, match=r"(?s)2 bad sample.*d\.png.*e\.png"):
        FolderDataset(tmp_path, "train", num_classes=3).validate_all()
    ds = FolderDataset(tmp_path, "train", num_classes=3, on_bad_sample="skip")
    skipped = ds.validate_all()
    assert len(ds) == 3 and [ds.name(i) for i in range(3)] == ["a", "b", "c"]
    assert [Path(f).name for f, _ in skipped] == ["d.png", "e.png"]
    assert "out of range" in skipped[0][1] and "differs" in skipped[1][1]
    ds.load(2)
