"""``data.augment``: the transforms against torchvision.transforms.v2 on the whole crop, and
every strip / tile layout against the whole crop sliced (in one process; the multi-rank
check is in test_augment_v2_dist.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from spconv_train.config import ConfigError, load_config
from spconv_train.data.augment_ops import DrawnOp, apply_intensity, layout_noise
from spconv_train.data.augment_spec import parse_augment
from spconv_train.data.augment_v2 import AugmentPlan, draw_plan, load_plan_part, value_range
from spconv_train.data.strips import strip_bounds
from spconv_train.data.transforms import AugmentParams
from tests.augment_sources import random_source

REPO = Path(__file__).resolve().parents[1]
GEOMETRIC = [
    {"name": "rot90", "p": 1.0},
    {"name": "transpose", "p": 1.0},
    {
        "name": "affine",
        "p": 1.0,
        "degrees": 30,
        "translate": [0.1, 0.1],
        "scale": [0.8, 1.2],
        "shear": 10,
    },  # fmt: skip
    {"name": "elastic", "p": 1.0, "alpha": 3.0, "sigma": 6.0},
]
INTENSITY = [
    {"name": "brightness", "p": 1.0, "factor": 0.3},
    {"name": "contrast", "p": 1.0, "factor": 0.3},
    {"name": "gamma", "p": 1.0, "gamma": [0.5, 2.0]},
    {"name": "noise", "p": 1.0, "sigma": 0.05},
]


def _whole(source, index, plan):
    return load_plan_part(source, index, plan, (0, plan.out_hw[1]), ignore_index=255)


def _one(name: str, values: tuple, hw=(40, 52)) -> AugmentPlan:
    op = DrawnOp(name, values, hw, seed=7)
    return AugmentPlan(AugmentParams.identity(hw), (op,), op.out_hw)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rot90_and_transpose_equal_torch(k):
    source = random_source(1)
    image, mask = source.load(0)
    got_image, got_mask = _whole(source, 0, _one("rot90", (float(k),)))
    assert torch.equal(got_mask, torch.rot90(mask, k, (-2, -1)))
    assert torch.equal(got_image, torch.rot90(image, k, (-2, -1)))
    got_image, got_mask = _whole(source, 0, _one("transpose", ()))
    assert torch.equal(got_mask, mask.T) and torch.equal(got_image, image.transpose(1, 2))


@pytest.mark.parametrize(
    "values",
    [(17.3, 2.0, -3.0, 1.1, 5.0), (-40.0, 0.0, 0.0, 0.8, 0.0), (8.0, -4.0, 5.0, 1.3, -12.0)],
)
def test_affine_matches_torchvision_v2(values):
    """Image: bilinear as v2.functional.affine (float32 grid there, float64 here); mask:
    nearest with ignore_index where the transform creates pixels, as for tv_tensors.Mask."""
    source = random_source(1)
    image, mask = source.load(0)
    got_image, got_mask = _whole(source, 0, _one("affine", values))
    angle, tx, ty, scale, shear = values
    kw = dict(angle=angle, translate=[tx, ty], scale=scale, shear=[shear, 0.0])
    want_image = F.affine(tv_tensors.Image(image), **kw, interpolation=F.InterpolationMode.BILINEAR)
    want_mask = F.affine(tv_tensors.Mask(mask), **kw, fill=255)
    torch.testing.assert_close(got_image, want_image.as_subclass(torch.Tensor), atol=1e-5, rtol=0)
    assert (got_mask != want_mask).float().mean() <= 1e-3  # float32 ties in torchvision
    assert (got_mask == 255).any()  # the rotation created pixels: ignored


def test_intensity_matches_torchvision_and_keeps_16_bit_levels():
    source = random_source(1)
    image, _ = source.load(0)
    for name, v, want in [
        ("brightness", 1.2, F.adjust_brightness(image[:1], 1.2)),
        ("gamma", 0.7, F.adjust_gamma(image[:1], 0.7)),
        ("contrast", 1.5, ((image - 0.5) * 1.5 + 0.5).clamp(0, 1)),
    ]:
        got, _ = _whole(source, 0, _one(name, (v,)))
        torch.testing.assert_close(got[: want.shape[0]], want, atol=1e-6, rtol=0)
    got, _ = _whole(source, 0, _one("brightness", (1.0,)))
    assert torch.equal(got, image)  # factor 1: the 16-bit values unchanged, not requantised
    assert got.unique().numel() > 256
    got, _ = _whole(source, 0, _one("noise", (0.01,)))
    residual = (got - image).double()
    inner = (image > 0.05) & (image < 0.95)  # not clamped
    assert abs(residual[inner].std().item() - 0.01) < 5e-4
    assert got.min() >= 0 and got.max() <= 1


def test_noise_is_standard_normal_and_layout_free():
    whole = layout_noise(3, 2, (0, 40), (0, 50), (40, 50))
    assert abs(whole.mean()) < 0.03 and abs(whole.std() - 1) < 0.03
    part = layout_noise(3, 2, (13, 29), (7, 31), (40, 50))
    assert torch.equal(part, whole[:, 13:29, 7:31])


def _layouts(h: int, w: int):
    """Strips (1 x q) and tiles (p x q), uneven splits included."""
    for p, q in [(1, 2), (1, 3), (2, 1), (3, 1), (2, 2), (2, 3)]:
        for i in range(p):
            for j in range(q):
                yield strip_bounds(h, p, i), strip_bounds(w, q, j)


@pytest.mark.parametrize(
    "items", [GEOMETRIC, GEOMETRIC[2:] + INTENSITY, [GEOMETRIC[1], INTENSITY[3]]]
)
def test_every_layout_equals_whole_crop_sliced(items):
    """Crops 25 x 13 (odd: uneven strips; rot90 / transpose draw a 13 x 25 crop) of 40 x 52
    images, several samples and epochs: each part equals the whole crop sliced."""
    source = random_source(3)
    specs = parse_augment(items)
    for index in range(3):
        for epoch in range(2):
            plan = draw_plan(
                5, epoch, index, image_hw=(40, 52), crop_hw=(25, 13), specs=specs, hflip=0.5,
                vflip=0.5, scale=(0.8, 1.25),
            )  # fmt: skip
            assert plan.out_hw == (25, 13)
            image, mask = _whole(source, index, plan)
            for rows, cols in _layouts(25, 13):
                part = load_plan_part(source, index, plan, cols, rows=rows, ignore_index=255)
                assert torch.equal(part[1], mask[rows[0] : rows[1], cols[0] : cols[1]])
                want = image[:, rows[0] : rows[1], cols[0] : cols[1]]
                torch.testing.assert_close(part[0], want, atol=1e-6, rtol=0)


def test_a_strip_reads_only_its_source_region():
    """rot90 / transpose of a 64 x 64 crop of a 128 x 128 image: a quarter strip reads a
    quarter of the crop; a small rotation reads a box near the strip, never the image."""
    source = random_source(1, hw=(128, 128))
    for items, limit in [([{"name": "rot90", "p": 1.0}], 64 * 16), ([GEOMETRIC[1]], 64 * 16),
                         ([{"name": "affine", "p": 1.0, "degrees": 5}], 64 * 28)]:  # fmt: skip
        plan = draw_plan(0, 0, 0, image_hw=(128, 128), crop_hw=(64, 64), specs=parse_augment(items))
        source.reads.clear()
        load_plan_part(source, 0, plan, strip_bounds(64, 4, 1))
        (_, (r0, r1), (c0, c1)), *more = source.reads
        assert not more and (r1 - r0) * (c1 - c0) <= limit


def test_yaml_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "data:\n  augment:\n    - {name: rot90, p: 0.5}\n"
        "    - {name: affine, degrees: 10, translate: [0.1, 0.05], scale: [0.9, 1.1]}\n"
        "    - {name: gamma, gamma: [0.8, 1.25]}\n    - {name: noise, sigma: 0.01}\n"
        "  oversample_classes: [2, 3]\n  oversample_fraction: 0.5\n"
    )
    cfg = load_config(path)
    specs = parse_augment(cfg.data.augment)
    assert [s.name for s in specs] == ["rot90", "affine", "gamma", "noise"]
    assert specs[1].arg("degrees") == (-10.0, 10.0) and specs[1].p == 0.5
    assert specs[3].arg("sigma") == (0.0, 0.01)
    assert cfg.data.oversample_classes == [2, 3] and cfg.data.oversample_fraction == 0.5
    bad = [
        ("data.augment=[{name: rot90, p: 2}]", "data.augment[0].p", "probability"),
        ("data.augment=[{name: affine, degreez: 3}]", "data.augment[0].degreez", "degrees"),
        ("data.augment=[{name: blur}]", "data.augment[0].name", "rot90"),
        ("data.augment=[{name: gamma, gamma: [2, 1]}]", "data.augment[0].gamma", "min <= max"),
        ("data.augment=[{name: rot90, k: [5]}]", "data.augment[0].k", "quarter turns"),
        ("data.oversample_classes=[7]", "data.oversample_classes", "[0, 2)"),
        ("data.oversample_fraction=1.5", "data.oversample_fraction", "between 0 and 1"),
    ]
    for override, key, words in bad:
        with pytest.raises(ConfigError) as info:
            load_config(None, [override, "model.num_classes=2"])
        assert key in str(info.value) and words in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match=r"data.augment: not supported for volumes"):
        load_config(REPO / "configs" / "unet3d.yaml", ["data.augment=[{name: rot90}]"])


def test_mean_std_images_use_their_storage_range():
    """Under mean_std the point-wise transforms act on x * std + mean, the [0, 1] scale."""
    source = random_source(1)
    image, _ = source.load(0)
    mean, std = torch.tensor([0.4, 0.5]).view(2, 1, 1), torch.tensor([0.2, 0.25]).view(2, 1, 1)
    low, high = value_range({"mode": "mean_std", "mean": [0.4, 0.5], "std": [0.2, 0.25]}, 2)
    torch.testing.assert_close(low, torch.tensor([-2.0, -2.0]))
    torch.testing.assert_close(high, torch.tensor([3.0, 2.0]))
    ops = list(_one("gamma", (2.0,)).ops)
    got = apply_intensity((image - mean) / std, ops, (low, high), (0, 40), (0, 52), (40, 52))
    torch.testing.assert_close(got, (image**2 - mean) / std, atol=1e-5, rtol=0)
