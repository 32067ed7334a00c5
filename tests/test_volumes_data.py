"""Volumes in config and data (issue 12 item 3): the config keys and their errors, synthetic
3-D data, per-rank blocks with crops and flips, and ``.npy`` / TIFF-stack volume folders."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.config import ConfigError, load_config, validate_for_world
from spconv_train.data import (
    DataError,
    SyntheticVolumes,
    VolumeAugment,
    VolumeFolder,
    draw_volume_augment,
    load_block,
    strip_bounds,
)
from spconv_train.data.synthetic3d import synthetic_volume

VOLUME = ["data.kind=volume", "model.name=unet3d", "model.in_channels=1"]


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["data.kind=voxels"], "data.kind", "'image', 'volume'"),
        (["parallel.shard_dim=X"], "parallel.shard_dim", "'W', 'H', 'D'"),
        (["parallel.shard_dim=D"], "parallel.shard_dim", "applies to volumes"),
        ([*VOLUME, "data.depth=null"], "data.depth", "explicit depth"),
        ([*VOLUME, "data.depth=0"], "data.depth", ">= 1"),
        ([*VOLUME, "data.scale=[0.5, 2.0]"], "data.scale", "not supported"),
    ],
)
def test_config_errors_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_config_defaults_and_split_extent_check():
    cfg = load_config(None, [])
    assert (cfg.data.kind, cfg.parallel.shard_dim) == ("image", "W")  # 2-D unchanged
    # depth 1: no pooling (unet3d's deeper levels must fill every rank too: test_grid_auto)
    cfg = load_config(
        None, [*VOLUME, "parallel.shard_dim=D", "data.depth=3", "model.kwargs={depth: 1}"]
    )
    assert validate_for_world(cfg, 2) == (1, 2)
    with pytest.raises(ConfigError) as info:  # 3 slices over 4 ranks leave one empty
        validate_for_world(cfg, 4)
    assert info.value.key == "data.depth" and "slices" in str(info.value)


def test_cli_exit_2_and_resolved_config(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(
        app, ["show-config", "configs/unet3d.yaml", "--set", "parallel.shard_dim=Q"]
    )
    assert bad.exit_code == 2 and "parallel.shard_dim" in bad.output
    good = runner.invoke(app, ["show-config", "configs/unet3d.yaml", "--set", "data.depth=8"])
    assert good.exit_code == 0, good.output
    assert "kind: volume" in good.output and "shard_dim: W" in good.output
    assert "depth: 8" in good.output


# --- synthetic volumes and blocks ---------------------------------------------------------------


def test_synthetic_volume_is_deterministic_with_every_class():
    kw = dict(depth=12, height=16, width=20, num_classes=4, seed=3, in_channels=2)
    a, b = synthetic_volume(5, **kw), synthetic_volume(5, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (2, 12, 16, 20) and a[1].shape == (12, 16, 20)
    assert a[0].min() >= 0 and a[0].max() <= 1
    seen = set()
    for i in range(6):
        seen |= set(synthetic_volume(i, **kw)[1].unique().tolist())
    assert seen == {0, 1, 2, 3}


def test_long_rods_need_context_wider_than_one_block():
    """Some long-band rod is longer than half the volume along its axis: a rank holding
    half of that axis cannot see both of its ends."""
    extent = (16, 16, 24)
    spans = []
    for i in range(8):
        mask = synthetic_volume(i, depth=16, height=16, width=24, num_classes=3)[1] == 2
        for axis in range(3):
            other = tuple(k for k in range(3) if k != axis)
            spans.append(int(mask.any(dim=other).sum()) / extent[axis])
    assert max(spans) > 0.6


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_blocks_of_an_augmented_volume_stitch_to_the_whole(axis):
    source = SyntheticVolumes(2, size=(10, 12, 14), num_classes=4, in_channels=2)
    aug = draw_volume_augment(0, 1, 1, size=(10, 12, 14), crop=(None, 8, 11), hflip=1, vflip=1)
    assert aug.out == (10, 8, 11) and aug.flips == (False, True, True)
    image, mask = source[1]
    box = tuple(slice(s, s + n) for s, n in zip(aug.start, aug.out, strict=True))
    want_image, want_mask = image[(slice(None), *box)].flip([2, 3]), mask[box].flip([1, 2])
    n = aug.out[axis]
    blocks = [load_block(source, 1, aug, axis, strip_bounds(n, 3, r)) for r in range(3)]
    assert torch.equal(torch.cat([b[0] for b in blocks], 1 + axis), want_image)
    assert torch.equal(torch.cat([b[1] for b in blocks], axis), want_mask)
    whole = load_block(source, 0, VolumeAugment.identity((10, 12, 14)), axis, (0, n))
    assert whole[0].shape[1 + axis] == n


def test_crop_larger_than_the_volume_names_it():
    with pytest.raises(DataError, match=r"vol7: the crop is larger than the volume \(H=9 > 8\)"):
        draw_volume_augment(0, 0, 0, size=(4, 8, 8), crop=(None, 9, None), name="vol7")


# --- volume folders -----------------------------------------------------------------------------


def _write_pair(root, split, stem, image, mask, ext=".npy"):
    for sub, arr in (("images", image), ("masks", mask)):
        folder = root / sub / split
        folder.mkdir(parents=True, exist_ok=True)
        if ext == ".npy":
            np.save(folder / f"{stem}.npy", arr)
        else:
            import tifffile

            tifffile.imwrite(folder / f"{stem}{ext}", arr)


def _volume(seed, shape, dtype=np.uint8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 200, shape).astype(dtype)


def test_npy_and_tiff_volumes_read_by_block(tmp_path, monkeypatch):
    labels = np.random.default_rng(1).integers(0, 3, (6, 5, 7)).astype(np.uint8)
    _write_pair(tmp_path, "train", "a", _volume(0, (6, 5, 7)), labels)
    _write_pair(tmp_path, "train", "b", _volume(2, (2, 6, 5, 7), np.float32) / 200, labels)
    _write_pair(tmp_path, "train", "c", _volume(3, (6, 5, 7), np.uint16), labels, ".tif")
    loads = []
    real_load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    src = VolumeFolder(tmp_path, "train", num_classes=3)
    assert len(src) == 3 and [src.channels(i) for i in range(3)] == [1, 2, 1]
    assert all(k.get("mmap_mode") == "r" for k in loads)  # memory-mapped, never read whole
    for i in range(3):
        assert src.size(i) == (6, 5, 7)
        image, mask = src[i]
        assert torch.equal(mask, torch.from_numpy(labels.astype(np.int64)))
        block, block_mask = src.read(i, ((2, 5), (0, 5), (3, 6)))
        assert torch.equal(block, image[:, 2:5, :, 3:6])
        assert torch.equal(block_mask, mask[2:5, :, 3:6])
    assert torch.allclose(src[0][0][0], torch.from_numpy(_volume(0, (6, 5, 7))).float() / 255)


def test_bad_volume_pairs_name_the_file(tmp_path):
    _write_pair(tmp_path, "train", "ok", _volume(0, (4, 4, 4)), np.zeros((4, 4, 4), np.uint8))
    _write_pair(tmp_path, "train", "small", _volume(0, (4, 4, 4)), np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(DataError, match=r"small\.npy: mask size \(4, 4, 3\)") as info:
        VolumeFolder(tmp_path, "train", num_classes=2)
    assert info.value.path.endswith("masks/train/small.npy")
    skip = VolumeFolder(tmp_path, "train", num_classes=2, on_bad_sample="skip")
    assert len(skip) == 1 and skip.skipped[0][0].endswith("small.npy")
    _write_pair(tmp_path, "val", "v", _volume(0, (4, 4, 4)), np.full((4, 4, 4), 7, np.uint8))
    with pytest.raises(DataError, match=r"v\.npy: mask values \[7\] are outside \[0, 2\)"):
        VolumeFolder(tmp_path, "val", num_classes=2)


@pytest.mark.skipif(importlib.util.find_spec("nibabel") is not None, reason="nibabel installed")
def test_nifti_without_nibabel_says_so(tmp_path):
    for sub in ("images", "masks"):
        (tmp_path / sub / "train").mkdir(parents=True)
        (tmp_path / sub / "train" / "ct.nii.gz").write_bytes(b"not really")
    with pytest.raises(DataError, match=r"ct\.nii\.gz: NIfTI volumes need the nibabel package"):
        VolumeFolder(tmp_path, "train", num_classes=2)


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["data.kind=volume", "model.kwargs={depth: 2, base_width: 2}"], "model.name", "2-D"),
        (["model.name=unet3d", "model.kwargs={depth: 2, base_width: 2}"], "data.kind", "3-D"),
    ],
)
def test_model_and_data_dimensions_must_agree(overrides, key, words):
    from spconv_train.train.loop import build_model

    with pytest.raises(ConfigError) as info:
        build_model(load_config(None, overrides))
    assert info.value.key == key and words in str(info.value)


def test_make_data_writes_a_volume_folder(tmp_path):
    args = ["make-data", str(tmp_path), "--num-train", "2", "--num-val", "1", "--depth", "4"]
    args += ["--height", "6", "--width", "8", "--channels", "1", "--classes", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    train = VolumeFolder(tmp_path, "train", num_classes=3)
    val = VolumeFolder(tmp_path, "val", num_classes=3)
    assert (len(train), len(val)) == (2, 1) and train.size(1) == (4, 6, 8)
    assert train.class_names == ["background", "ellipsoid", "long_band"]
    image, mask = val[0]
    want_image, want_mask = synthetic_volume(2, depth=4, height=6, width=8, num_classes=3)
    assert torch.equal(mask, want_mask)
    assert torch.allclose(image, want_image, atol=0.5 / 255 + 1e-6)  # quantized to 8 bits
