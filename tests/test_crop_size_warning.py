"""A training crop larger than the images is named with both sizes (it is padded with
ignore_index, which trains nothing), once for the split; a crop that fits says nothing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from PIL import Image

from spconv_train.data import FolderDataset


def _folder(root, sizes: dict[str, tuple[int, int]]):
    rng = np.random.default_rng(0)
    for sub in ("images/train", "masks/train"):
        (root / sub).mkdir(parents=True)
    for stem, (h, w) in sizes.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
            root / "images/train" / f"{stem}.png"
        )
        Image.fromarray(rng.integers(0, 3, (h, w), dtype=np.uint8)).save(
            root / "masks/train" / f"{stem}.png"
        )
    return root


def test_crop_wider_than_images_warns_naming_both_sizes(tmp_path):
    root = _folder(tmp_path, {"wide": (32, 64), "narrow": (32, 24)})
    with pytest.warns(UserWarning) as record:
        FolderDataset(root, "train", num_classes=3).validate_all(crop=(16, 48))
    messages = [str(w.message) for w in record if "training crop" in str(w.message)]
    assert len(messages) == 1
    assert "16 x 48" in messages[0] and "1 of 2 image(s)" in messages[0]
    assert "narrow.png: 32 x 24" in messages[0] and "ignore_index" in messages[0]


@pytest.mark.parametrize("crop", [(16, 24), (None, 20), None])
def test_crop_that_fits_every_image_says_nothing(tmp_path, crop):
    root = _folder(tmp_path, {"wide": (32, 64), "narrow": (32, 24)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FolderDataset(root, "train", num_classes=3).validate_all(crop=crop)
