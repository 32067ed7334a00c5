"""``data.split_list`` with the documented ``<split> <stem>`` lines."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from spconv_train.data import DataError, FolderDataset


def _pair(root, split, stem, seed):
    rng = np.random.default_rng(seed)
    for kind in ("images", "masks"):
        (root / kind / split).mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
        root / "images" / split / f"{stem}.png"
    )
    Image.fromarray(rng.integers(0, 3, (8, 8), dtype=np.uint8)).save(
        root / "masks" / split / f"{stem}.png"
    )


def test_split_stem_lines(tmp_path):
    for i, stem in enumerate(("a", "b", "c")):
        _pair(tmp_path, "train", stem, i)
        _pair(tmp_path, "val", stem, 10 + i)
    (tmp_path / "split.txt").write_text("# split stem\ntrain c\ntrain a.png\n\nval b  # one\n")
    train = FolderDataset(tmp_path, "train", num_classes=3, split_list="split.txt")
    val = FolderDataset(tmp_path, "val", num_classes=3, split_list="split.txt")
    assert [train.name(i) for i in range(len(train))] == ["c", "a"]
    assert [val.name(i) for i in range(len(val))] == ["b"]
    # A split the file does not mention uses every stem (as documented).
    (tmp_path / "only_train.txt").write_text("train b\n")
    val = FolderDataset(tmp_path, "val", num_classes=3, split_list="only_train.txt")
    assert len(val) == 3
    (tmp_path / "bad.txt").write_text("train a extra\n")
    with pytest.raises(DataError, match="line 1"):
        FolderDataset(tmp_path, "train", num_classes=3, split_list="bad.txt")
    (tmp_path / "missing.txt").write_text("train zz\n")
    with pytest.raises(DataError, match="zz"):
        FolderDataset(tmp_path, "train", num_classes=3, split_list="missing.txt")
