"""Class-oversampled crops: the location index, the share of crops holding a rare class, the
fallback, the cache, and the same crops on every rank."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from spconv_train.data.augment_feed import draw_plans, load_planned_strips
from spconv_train.data.augment_v2 import draw_plan, load_plan_part
from spconv_train.data.class_sampling import ClassSampler, centre_crop, class_locations
from spconv_train.data.folder import FolderDataset
from spconv_train.data.transforms import draw_augment
from tests.augment_sources import ArraySource

HW, CROP, RARE = (96, 120), (16, 16), 3


def _rare_source(n: int = 4, with_rare: bool = True) -> ArraySource:
    """Masks of classes 0-2 with one 3 x 3 blob of class 3 (none when ``with_rare`` is
    False), at a different place in each sample."""
    rng = np.random.default_rng(0)
    images, masks = [], []
    for i in range(n):
        mask = rng.integers(0, 3, HW, dtype=np.uint8)
        if with_rare:
            y, x = 10 + 17 * i, 100 - 23 * i
            mask[y : y + 3, x : x + 3] = RARE
        masks.append(mask)
        images.append(rng.integers(0, 65536, (1, *HW), dtype=np.uint16))
    return ArraySource(images, masks)


def _share(source, fraction: float, epochs: int = 40) -> float:
    """Share of training crops holding a pixel of the rare class."""
    sampler = ClassSampler(source, [RARE], fraction, seed=1)
    hits = total = 0
    for epoch in range(epochs):
        for i in range(len(source)):
            plan = draw_plan(
                1, epoch, i, image_hw=HW, crop_hw=CROP, specs=[], hflip=0.5,
                recentre=sampler.recentre(i, epoch),
            )  # fmt: skip
            mask = load_plan_part(source, i, plan, (0, CROP[1]))[1]
            hits += bool((mask == RARE).any())
            total += 1
    return hits / total


def test_class_locations_streams_and_caps():
    rng = np.random.default_rng(3)
    mask = rng.integers(0, 4, (37, 29), dtype=np.uint8)
    bands = [(r0, mask[r0 : r0 + 5]) for r0 in range(0, 37, 5)]
    found = class_locations(bands, 29, [1, 3], cap=10_000)
    for c in (1, 3):
        assert np.array_equal(found[c], np.flatnonzero(mask == c))
    capped = class_locations(bands, 29, [1], cap=50)
    every = np.flatnonzero(mask == 1)
    step = 1 << int(np.ceil(np.log2(every.size / 50)))  # the smallest power of two that fits
    assert np.array_equal(capped[1], every[::step]) and capped[1].size <= 50


def test_oversampling_raises_the_share_of_rare_crops():
    source = _rare_source()
    shares = [_share(source, f) for f in (0.0, 0.33, 1.0)]
    assert shares[0] < 0.1  # a 3 x 3 blob in a 96 x 120 image: rarely in a random crop
    assert 0.25 < shares[1] < 0.5
    assert shares[2] == 1.0


def test_centre_crop_puts_the_pixel_in_the_middle():
    params = draw_augment(0, 0, 0, image_hw=HW, crop_hw=CROP, scale=(1.5, 1.5))
    moved = centre_crop(params, (40, 60))
    assert (moved.top, moved.left) == (round(40.5 * 1.5 - 0.5 - 7.5), round(60.5 * 1.5 - 0.5 - 7.5))
    edge = centre_crop(params, (0, HW[1] - 1))  # clamped onto the resized image
    assert (edge.top, edge.left) == (0, params.scaled_hw[1] - CROP[1])


def test_a_mask_without_the_class_falls_back_to_the_random_crop():
    source = _rare_source(with_rare=False)
    sampler = ClassSampler(source, [RARE], 1.0, seed=1)
    for i in range(len(source)):
        assert sampler.pick(i, 0) is None
        plain = draw_plan(1, 0, i, image_hw=HW, crop_hw=CROP, specs=[])
        sampled = draw_plan(
            1, 0, i, image_hw=HW, crop_hw=CROP, specs=[], recentre=sampler.recentre(i, 0)
        )
        assert sampled == plain


def _folder(root, n: int = 3):
    """A folder dataset of .npy pairs with the rare class in masks 0 and 2 only."""
    source = _rare_source(n)
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "masks" / split).mkdir(parents=True)
        for i in range(n):
            mask = source.masks[i] if i != 1 else np.minimum(source.masks[i], 2)
            np.save(root / "images" / split / f"s{i}.npy", source.images[i][0])
            np.save(root / "masks" / split / f"s{i}.npy", mask)
    return FolderDataset(root, "train", num_classes=4)


def _rank_picks(root: str) -> list:
    """What every rank picks (its own index, built from the files, cached in ``root``)."""
    from pathlib import Path

    source = FolderDataset(Path(root) / "data", "train", num_classes=4)
    sampler = ClassSampler(source, [RARE], 0.7, seed=5, cache_dir=Path(root) / "run")
    return [sampler.pick(i, epoch) for epoch in range(6) for i in range(len(source))]


def test_same_crops_on_every_rank_and_cached(dist_pool, tmp_path):
    source = _folder(tmp_path / "data")
    per_rank = dist_pool.run(2, _rank_picks, str(tmp_path))
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == _rank_picks(str(tmp_path))  # and the same in this process
    picks = per_rank[0]
    assert sum(p is not None for p in picks) >= 6  # 0.7 of the samples holding the class
    assert all(p is None for p in picks[1::3])  # sample s1 has no pixel of the class
    mask0 = np.load(tmp_path / "data" / "masks" / "train" / "s0.npy")
    assert all(mask0[p] == RARE for p in picks[0::3] if p is not None)
    files = sorted((tmp_path / "run" / "class_index").glob("*.npz"))
    assert len(files) == 3
    with np.load(files[0], allow_pickle=False) as data:  # plain arrays, no pickle
        assert set(data.files) == {f"class_{RARE}"}
    # A fresh sampler reads the cache instead of the masks.
    sampler = ClassSampler(source, [RARE], 0.7, seed=5, cache_dir=tmp_path / "run")
    sampler._bands = None  # reading a mask again would fail
    assert [sampler.pick(i, e) for e in range(6) for i in range(3)] == picks


@pytest.mark.parametrize("tiled", [False, True])
def test_training_feed_uses_the_plan(tiled):
    """``load_planned_strips`` (the training feed) on rank 1 of 2 equals the plan's whole
    crop sliced, with augmentations and oversampling configured."""
    source = _rare_source()
    data = types.SimpleNamespace(
        augment=[{"name": "rot90", "p": 1.0}, {"name": "gamma", "p": 1.0}],
        oversample_classes=[RARE], oversample_fraction=1.0, height=CROP[0], width=CROP[1] + 3,
        hflip=0.5, vflip=0.0, scale=[1.0, 1.0], ignore_index=255, normalize=None,
    )  # fmt: skip
    cfg = types.SimpleNamespace(data=data, training=types.SimpleNamespace(seed=2), run_dir=None)
    coords = types.SimpleNamespace(
        tiled=tiled, rows=lambda h: (h // 2, h) if tiled else (0, h), cols=lambda w: (w // 2, w)
    )
    image, mask, hw = load_planned_strips(source, cfg, coords, 0, [0, 2])
    assert hw == (CROP[0], CROP[1] + 3)
    for k, (i, plan) in enumerate(zip([0, 2], draw_plans(source, cfg, 0, [0, 2]), strict=True)):
        whole_image, whole_mask = load_plan_part(source, i, plan, (0, hw[1]), ignore_index=255)
        rows = slice(hw[0] // 2 if tiled else 0, hw[0])
        assert torch.equal(mask[k], whole_mask[rows, hw[1] // 2 :])
        assert torch.equal(image[k], whole_image[:, rows, hw[1] // 2 :])
        assert (whole_mask == RARE).any()  # centred on the rare blob
