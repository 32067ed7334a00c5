"""Tests for spconv_train.data: synthetic data, reading formats, strips and augmentation
(folder datasets and their errors: tests/test_data_folder.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.distributed.tensor import Shard
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

import spconv_train.data as data_pkg
from spconv_train.data import (
    AugmentParams,
    DataError,
    FolderDataset,
    SyntheticDataset,
    draw_augment,
    global_size,
    load_strip,
    make_batch,
    make_dp_sampler,
    strip_bounds,
    synthetic_class_names,
    synthetic_sample,
    write_synthetic_dataset,
)

# --------------------------------------------------------------------------- helpers


class _Recording(SyntheticDataset):
    """A SyntheticDataset that records the column ranges it was asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requested: list[tuple[int, int]] = []

    def load(self, i, cols=None, rows=None):
        self.requested.append(cols)
        return super().load(i, cols, rows)


def _reference_augment(image, mask, p: AugmentParams, ignore: int):
    """Augment the whole sample with torchvision ops, the obvious way."""
    hs, ws = p.scaled_hw
    if (hs, ws) != tuple(p.source_hw):
        image = TF.resize(image, [hs, ws], antialias=True)
        mask = TF.resize(tv_tensors.Mask(mask), [hs, ws]).as_subclass(torch.Tensor)
    oh, ow = p.out_hw
    m = max(oh, ow) + 1  # pad generously, then the window is a plain slice
    image = F.pad(image, (m, m, m, m), value=0.0)
    mask = F.pad(mask, (m, m, m, m), value=ignore)
    image = image[:, p.top + m : p.top + m + oh, p.left + m : p.left + m + ow]
    mask = mask[p.top + m : p.top + m + oh, p.left + m : p.left + m + ow]
    if p.hflip:
        image, mask = image.flip(-1), mask.flip(-1)
    if p.vflip:
        image, mask = image.flip(-2), mask.flip(-2)
    return image, mask


# --------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    kw = dict(height=16, width=40, num_classes=6, seed=3)
    a_img, a_mask = synthetic_sample(5, **kw)
    b_img, b_mask = synthetic_sample(5, **kw)
    assert torch.equal(a_img, b_img) and torch.equal(a_mask, b_mask)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(synthetic_sample(6, **kw)[0], a_img)
    assert not torch.equal(synthetic_sample(5, **{**kw, "seed": 4})[0], a_img)


@pytest.mark.parametrize("channels", [1, 3, 5])
def test_synthetic_ranges_and_class_coverage(channels):
    num_classes = 7
    seen = set()
    for i in range(6):
        image, mask = synthetic_sample(
            i, height=32, width=96, num_classes=num_classes, in_channels=channels
        )
        assert image.dtype == torch.float32 and image.shape == (channels, 32, 96)
        assert mask.dtype == torch.int64 and mask.shape == (32, 96)
        assert image.min() >= 0.0 and image.max() <= 1.0
        assert mask.min() >= 0 and mask.max() < num_classes
        assert (mask == num_classes - 1).any(), "every sample has a long band"
        seen |= set(mask.unique().tolist())
    assert seen == set(range(num_classes))
    assert len(synthetic_class_names(num_classes)) == num_classes


def test_synthetic_context_class_spans_most_of_the_width():
    # Long bands are >= 60 % of the width, so a strip of half the width never sees both
    # ends: the label needs context beyond one strip. Decoys look the same but are class 0.
    width = 200
    for i in range(4):
        _, mask = synthetic_sample(i, height=48, width=width, num_classes=4)
        band = mask == 3
        assert band.sum(1).max() >= 0.6 * width - 1
        runs = band.sum(1)
        assert ((runs == 0) | (runs >= 0.6 * width - 1)).all(), "no short long_band runs"


def test_synthetic_two_classes_and_speed():
    import time

    _, mask = synthetic_sample(0, height=16, width=64, num_classes=2)
    assert set(mask.unique().tolist()) <= {0, 1} and (mask == 1).any()
    start = time.perf_counter()
    synthetic_sample(1, height=128, width=512, num_classes=6)
    assert time.perf_counter() - start < 2.0  # ~10 ms on one core; loose for a shared CPU


def test_synthetic_dataset_interface():
    ds = SyntheticDataset(3, height=10, width=17, num_classes=5, seed=2, offset=4)
    assert len(ds) == 3 and ds.size(1) == (10, 17) and ds.channels(0) == 3
    image, mask = ds.load(1, (3, 9))
    full_image, full_mask = synthetic_sample(5, height=10, width=17, num_classes=5, seed=2)
    assert torch.equal(image, full_image[:, :, 3:9]) and torch.equal(mask, full_mask[:, 3:9])
    with pytest.raises(IndexError):
        ds.load(3)
    with pytest.raises(ValueError, match="column range"):
        ds.load(0, (5, 18))


# --------------------------------------------------------------------------- folders


def test_write_synthetic_dataset_and_read_back(tmp_path):
    root = write_synthetic_dataset(
        tmp_path / "ds", num_train=3, num_val=2, height=12, width=30, num_classes=5, seed=1
    )
    assert (root / "images/train/0000.png").is_file() and (root / "masks/val/0001.png").is_file()
    assert Image.open(root / "images/train/0000.png").mode == "RGB"
    assert Image.open(root / "masks/train/0000.png").mode == "L"
    train = FolderDataset(root, "train", num_classes=5)
    val = FolderDataset(root, "val", num_classes=5)
    assert len(train) == 3 and len(val) == 2 and train.name(2) == "0002"
    assert train.class_names == synthetic_class_names(5)
    assert train.validate_all() == [] and train.size(0) == (12, 30)
    reference = SyntheticDataset(2, height=12, width=30, num_classes=5, seed=1, offset=3)
    for i in range(2):
        image, mask = val.load(i)
        ref_image, ref_mask = reference.load(i)
        assert (image - ref_image).abs().max() <= 0.5 / 255 + 1e-6  # 8-bit quantization
        assert torch.equal(mask, ref_mask)
        strip_image, strip_mask = val.load(i, (7, 19))
        assert torch.equal(strip_image, image[:, :, 7:19]) and torch.equal(
            strip_mask, mask[:, 7:19]
        )


@pytest.mark.parametrize(
    ("channels", "fmt", "suffix"),
    [(1, "png", ".png"), (4, "png", ".npy"), (3, "tif", ".tif"), (3, "npy", ".npy")],
)
def test_write_synthetic_formats(tmp_path, channels, fmt, suffix):
    kw = dict(num_train=1, num_val=0, height=8, width=13, num_classes=3)
    root = write_synthetic_dataset(tmp_path, **kw, in_channels=channels, fmt=fmt)
    assert (root / "images/train" / f"0000{suffix}").is_file()
    ds = FolderDataset(root, "train", num_classes=3)
    image, _ = ds.load(0)
    assert image.shape == (channels, 8, 13) and ds.channels(0) == channels
    ref, _ = synthetic_sample(0, height=8, width=13, num_classes=3, in_channels=channels)
    assert (image - ref).abs().max() <= 0.5 / 255 + 1e-6


@pytest.mark.parametrize(
    "layout", ["chw_u8", "hwc_u8", "hw_f32", "chw_f32", "tif_rgb", "tif_l", "jpg"]
)
def test_strip_reads_equal_full_read_slices(tmp_path, layout):
    rng = np.random.default_rng(0)
    h, w = 7, 19
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    img_dir = tmp_path / "images/train"
    img_dir.mkdir(parents=True)
    if layout == "chw_u8":
        np.save(img_dir / "a.npy", rgb.transpose(2, 0, 1))
    elif layout == "hwc_u8":
        np.save(img_dir / "a.npy", rgb)
    elif layout == "hw_f32":
        np.save(img_dir / "a.npy", rng.random((h, w), dtype=np.float32))
    elif layout == "chw_f32":
        np.save(img_dir / "a.npy", rng.random((5, h, w), dtype=np.float32))
    elif layout == "tif_rgb":
        Image.fromarray(rgb).save(img_dir / "a.tif")
    elif layout == "tif_l":
        Image.fromarray(rgb[:, :, 0]).save(img_dir / "a.tiff")
    else:
        Image.fromarray(rgb).save(img_dir / "a.jpg", quality=95)
    mask_dir = tmp_path / "masks/train"
    mask_dir.mkdir(parents=True)
    if layout.startswith("tif"):
        Image.fromarray(rng.integers(0, 4, (h, w), dtype=np.uint8)).save(mask_dir / "a.tif")
    else:
        np.save(mask_dir / "a.npy", rng.integers(0, 4, (h, w)).astype(np.int32))
    ds = FolderDataset(tmp_path, "train", num_classes=4)
    assert ds.size(0) == (h, w)
    image, mask = ds.load(0)
    assert image.dtype == torch.float32 and mask.dtype == torch.int64
    assert image.shape[1:] == (h, w) and mask.shape == (h, w)
    if layout in ("chw_u8", "hwc_u8", "tif_rgb"):
        assert torch.equal(image, torch.from_numpy(rgb).permute(2, 0, 1).float() / 255)
    for a, b in [(0, 5), (5, 12), (12, 19), (4, 4), (0, 19)]:
        strip_image, strip_mask = ds.load(0, (a, b))
        assert torch.equal(strip_image, image[:, :, a:b])
        assert torch.equal(strip_mask, mask[:, a:b])


# --------------------------------------------------------------------------- strips


def test_strip_bounds_match_dtensor_shard():
    for width in range(1, 21):
        cols = torch.arange(width)
        for parts in range(1, 6):
            chunks = list(cols.chunk(parts))
            chunks += [cols[width:]] * (parts - len(chunks))  # DTensor pads with empty shards
            for rank in range(parts):
                a, b = strip_bounds(width, parts, rank)
                assert torch.equal(cols[a:b], chunks[rank])
                size, offset = Shard.local_shard_size_and_offset(width, parts, rank)
                assert (b - a, a) == (size, offset)
    with pytest.raises(ValueError):
        strip_bounds(5, 2, 2)


def test_draw_augment_deterministic_and_varied():
    state = torch.get_rng_state()
    kw = dict(image_hw=(20, 30), crop_hw=(10, 12), hflip=0.5, vflip=0.5, scale=(0.5, 2.0))
    assert draw_augment(1, 2, 3, **kw) == draw_augment(1, 2, 3, **kw)
    draws = {draw_augment(1, epoch, 3, **kw) for epoch in range(20)}
    assert len(draws) == 20
    assert {d.hflip for d in draws} == {True, False} and {d.vflip for d in draws} == {True, False}
    assert all(d.out_hw == (10, 12) for d in draws)
    assert torch.equal(torch.get_rng_state(), state)
    plain = draw_augment(0, 0, 0, image_hw=(20, 30))
    assert plain == AugmentParams.identity((20, 30))


def _param_cases(h, w):
    crops = [None, (h - 2, max(1, w - 3)), (h + 3, w + 5), (h, 3)]
    scales = [(1.0, 1.0), (0.5, 2.0), (0.3, 0.6), (1.5, 3.0)]
    for k in range(8):
        yield dict(
            image_hw=(h, w), crop_hw=crops[k % 4], hflip=0.5, vflip=0.5, scale=scales[k // 2 % 4]
        )


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("width", [7, 13, 23])
def test_strips_concatenate_to_the_whole_augmented_sample(parts, width):
    height = 9
    source = SyntheticDataset(2, height=height, width=width, num_classes=5, seed=parts)
    for k, kw in enumerate(_param_cases(height, width)):
        index = k % 2
        params = draw_augment(7, k, index, **kw)
        out_h, out_w = global_size(source, index, params)
        whole_image, whole_mask = load_strip(source, index, (0, out_w), params)
        assert whole_image.shape == (3, out_h, out_w) and whole_mask.shape == (out_h, out_w)
        strips = [
            load_strip(source, index, strip_bounds(out_w, parts, r), params) for r in range(parts)
        ]
        assert torch.equal(torch.cat([s[0] for s in strips], dim=2), whole_image)
        assert torch.equal(torch.cat([s[1] for s in strips], dim=1), whole_mask)
        # ... and the whole equals augmenting the full sample with torchvision.
        ref_image, ref_mask = _reference_augment(*source.load(index), params, 255)
        torch.testing.assert_close(whole_image, ref_image, atol=1e-5, rtol=0)
        assert torch.equal(whole_mask, ref_mask)


def test_load_strip_reads_only_needed_columns():
    source = _Recording(1, height=8, width=40, num_classes=4)
    flip = AugmentParams(source_hw=(8, 40), scaled_hw=(8, 40), out_hw=(8, 20), left=5, hflip=True)
    load_strip(source, 0, (0, 5), flip)
    # output [0, 5) flipped = window [15, 20) = source [20, 25)
    assert source.requested == [(20, 25)]
    zoom = AugmentParams(source_hw=(8, 40), scaled_hw=(16, 80), out_hw=(8, 40), left=10)
    source.requested.clear()
    load_strip(source, 0, (30, 40), zoom)
    ((a, b),) = source.requested
    assert a >= 19 and b <= 26  # scaled [40, 50) <- source ~[20, 25) plus one filter tap
    with pytest.raises(ValueError, match="size"):
        load_strip(source, 0, (0, 4), AugmentParams.identity((8, 41)))


def test_padding_uses_ignore_index():
    source = SyntheticDataset(1, height=4, width=6, num_classes=3)
    params = AugmentParams(source_hw=(4, 6), scaled_hw=(4, 6), out_hw=(6, 10), top=-1, left=-2)
    image, mask = load_strip(source, 0, (0, 10), params)
    assert (mask[0] == 255).all() and (mask[:, :2] == 255).all() and (image[:, :, 8:] == 0).all()
    assert torch.equal(mask[1:5, 2:8], source.load(0)[1])
    assert (load_strip(source, 0, (0, 10), params, ignore_index=9)[1][0] == 9).all()


def test_make_batch(tmp_path):
    source = SyntheticDataset(3, height=8, width=12, num_classes=3)
    params = [draw_augment(0, 0, i, image_hw=(8, 12), crop_hw=(6, 10), hflip=0.5) for i in range(3)]
    images, masks = make_batch(source, [0, 1, 2], (2, 7), params)
    assert images.shape == (3, 3, 6, 5) and masks.shape == (3, 6, 5)
    assert torch.equal(images[1], load_strip(source, 1, (2, 7), params[1])[0])
    odd = [params[0], AugmentParams.identity((8, 12))]
    with pytest.raises(DataError, match=r"synthetic\[seed=0\]/0000 6x10.*0001 8x12"):
        make_batch(source, [0, 1], (0, 5), odd)


def test_dp_sampler():
    samplers = [make_dp_sampler(10, dp=3, dp_rank=r, seed=5) for r in range(3)]
    for s in samplers:
        s.set_epoch(1)
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == 4 for p in per_rank)  # padded to equal length
    assert set(sum(per_rank, [])) == set(range(10))
    twin = make_dp_sampler(10, dp=3, dp_rank=1, seed=5)  # another spatial rank, same dp rank
    twin.set_epoch(1)
    assert list(twin) == per_rank[1]
    twin.set_epoch(2)
    assert list(twin) != per_rank[1]


def test_data_package_does_not_import_parallel():
    for path in Path(data_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "parallel" not in (node.module or ""), path
                assert not (node.level >= 2 and node.module is None), path
            elif isinstance(node, ast.Import):
                assert all("spconv_train.parallel" not in a.name for a in node.names), path
