"""``data.normalize``: dtype, minmax, percentile (per image / per dataset), mean_std."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile
import torch

from spconv_train.config import (
    ConfigError,
    check_resume_changes,
    config_to_dict,
    dump_config,
    load_config,
)
from spconv_train.data import (
    FolderDataset,
    normalization_range,
    normalize_image,
    strip_bounds,
)
from spconv_train.data.normalize import range_of_bands
from spconv_train.logging import auto_contrast, overlay_panel
from spconv_train.train.data_feed import build_sources


def _dim_16bit(shape, seed):
    """A dim 16-bit fluorescence-like image: values 0..235 with a few bright outliers."""
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 236, shape).astype(np.uint16)
    img.reshape(-1)[rng.choice(img.size, 2, replace=False)] = 4000
    return img


def _write(root, split, images, num_classes=3):
    for kind in ("images", "masks"):
        (root / kind / split).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(99)
    for i, image in enumerate(images):
        tifffile.imwrite(root / f"images/{split}/s{i}.tif", image, tile=(16, 16))
        mask = rng.integers(0, num_classes, image.shape[:2], dtype=np.uint8)
        tifffile.imwrite(root / f"masks/{split}/s{i}.tif", mask)


def _bands(arr, step=7):
    """``bands()`` for ``range_of_bands``: rows of a ``[C, H, W]`` array, ``step`` at a time."""
    return lambda: (arr[:, r : r + step] for r in range(0, arr.shape[1], step))


def test_modes_match_numpy_references():
    img = _dim_16bit((2, 30, 40), 0)
    x = img.astype(np.float64)
    dtype = normalize_image(img, {"mode": "dtype"})
    assert torch.equal(dtype, torch.from_numpy(img.astype(np.float32)) / 65535.0)  # old behaviour
    assert float(dtype.max()) < 0.07  # why the option exists
    for mode in ("minmax", "percentile"):
        stats = range_of_bands(_bands(img), mode, [1, 99.8])
        for c in range(2):
            want = (
                (x[c].min(), x[c].max())
                if mode == "minmax"
                else tuple(np.percentile(x[c], [1, 99.8]))
            )
            assert stats[c] == pytest.approx(want, abs=1e-9)  # exact for 16-bit integers
        out = normalize_image(img, {"mode": mode}, stats)
        lo = np.array([s[0] for s in stats])[:, None, None]
        hi = np.array([s[1] for s in stats])[:, None, None]
        ref = np.clip((x - lo) / (hi - lo), 0, 1)
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-6)
    assert float(out.max()) == 1.0 and float(out.mean()) > 0.3  # no longer black
    ms = {"mode": "mean_std", "mean": [0.485, 0.456], "std": [0.229, 0.224]}
    ref = (x / 65535 - np.array([0.485, 0.456])[:, None, None]) / np.array([0.229, 0.224])[
        :, None, None
    ]
    np.testing.assert_allclose(normalize_image(img, ms).numpy(), ref, atol=1e-5)
    # Floats: histogram percentiles, close to numpy's.
    flt = np.random.default_rng(1).normal(size=(1, 50, 60)).astype(np.float32)
    stats = range_of_bands(_bands(flt), "percentile", [2, 98])
    assert stats[0] == pytest.approx(tuple(np.percentile(flt, [2, 98])), abs=1e-3)


def test_per_image_percentile_strips_use_whole_image_statistics(tmp_path):
    images = [_dim_16bit((37, 50), 2), _dim_16bit((37, 50), 3) // 2]
    _write(tmp_path, "train", images)
    cfg = load_config(
        None,
        ["data.source=folder", "data.root=x", "data.normalize.mode=percentile"],
        check_paths=False,
    )
    ds = FolderDataset(tmp_path, "train", num_classes=3, normalize=cfg.data.normalize)
    ds.prepare_normalization()
    for i, image in enumerate(images):
        lo, hi = np.percentile(image.astype(np.float64), [1, 99.8])
        ref = np.clip((image - lo) / (hi - lo), 0, 1)
        whole = ds.load(i)[0][0]
        np.testing.assert_allclose(whole.numpy(), ref, atol=1e-6)
        strips = [ds.load(i, strip_bounds(50, 3, r))[0][0] for r in range(3)]
        assert torch.equal(torch.cat(strips, dim=1), whole)  # each strip: whole-image numbers
        # predict's entry point gives the same numbers for the same file
        path = ds.files(i)[0]
        assert normalization_range(path, cfg.data.normalize) == ds._range(i)


def test_dataset_scope_is_stored_in_the_resolved_config(tmp_path):
    train = [_dim_16bit((24, 32), 4), _dim_16bit((24, 32), 5) * 3]
    _write(tmp_path, "train", train)
    _write(tmp_path, "val", [_dim_16bit((24, 32), 6)])
    overrides = [
        "data.source=folder",
        f"data.root={tmp_path}",
        f"run_dir={tmp_path / 'run'}",
        "model.in_channels=1",
        "model.num_classes=3",
        "data.normalize.mode=percentile",
        "data.normalize.scope=dataset",
        "data.normalize.percentile=[0.5, 99.5]",
    ]
    cfg = load_config(None, overrides)
    train_src, val_src, _ = build_sources(cfg)
    allpix = np.concatenate([t.ravel() for t in train]).astype(np.float64)
    want = np.percentile(allpix, [0.5, 99.5])
    assert cfg.data.normalize.stats == [pytest.approx(list(want))]
    # validation uses the training split's numbers
    val_img = tifffile.imread(tmp_path / "images/val/s0.tif").astype(np.float64)
    ref = np.clip((val_img - want[0]) / (want[1] - want[0]), 0, 1)
    np.testing.assert_allclose(val_src.load(0)[0][0].numpy(), ref, atol=1e-6)
    dump_config(cfg, tmp_path / "config.yaml")
    stored = load_config(tmp_path / "config.yaml", check_paths=False)
    assert stored.data.normalize.stats == cfg.data.normalize.stats
    # Resuming with the same settings (stats null: recomputed) is not a change ...
    again = config_to_dict(load_config(None, overrides))
    assert check_resume_changes(config_to_dict(stored), again) == []
    # ... while other numbers than the run used are refused.
    again["data"]["normalize"]["stats"] = [[0.0, 1.0]]
    with pytest.raises(ConfigError, match="data.normalize.stats"):
        check_resume_changes(config_to_dict(stored), again)
    assert normalization_range(tmp_path / "images/val/s0.tif", stored.data.normalize) == [
        tuple(cfg.data.normalize.stats[0])
    ]


def test_config_checks():
    folder = ["data.source=folder", "data.root=x"]
    with pytest.raises(ConfigError, match="data.normalize.mean"):
        load_config(None, [*folder, "data.normalize.mode=mean_std"], check_paths=False)
    with pytest.raises(ConfigError, match="data.normalize.percentile"):
        load_config(None, ["data.normalize.percentile=[99, 1]"], check_paths=False)
    with pytest.raises(ConfigError, match="data.normalize.mode"):
        load_config(None, ["data.normalize.mode=zscore"], check_paths=False)
    with pytest.raises(ConfigError, match="data.normalize.mode: percentile applies to folder"):
        load_config(None, ["data.normalize.mode=percentile"], check_paths=False)
    cfg = load_config(
        None,
        [
            *folder,
            "data.normalize.mode=mean_std",
            "data.normalize.mean=[0.5]",
            "data.normalize.std=[0.2]",
        ],
        check_paths=False,
    )
    assert cfg.data.normalize.mean == [0.5]


def test_auto_contrast_makes_dim_images_visible():
    dim = torch.from_numpy(_dim_16bit((1, 40, 40), 7).astype(np.float32)) / 65535.0
    out = auto_contrast(dim)
    assert float(dim.max()) < 0.07 and out.min() == 0 and out.max() == 1
    assert 0.3 < float(out.mean()) < 0.7
    labels = torch.zeros(40, 40, dtype=torch.long)
    panel = overlay_panel(dim, labels, labels, 2, downsample=1)
    assert int(panel[:, :, :10].max()) == 255  # the input panel of a dim image is not black
