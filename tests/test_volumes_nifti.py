"""NIfTI volume folders (``.nii`` / ``.nii.gz`` through nibabel, issue 12 item 3): the axis
convention (nibabel's ``(x, y, z[, c])`` arrays are read as ``[C,] D, H, W`` = ``[c,] z, y, x``),
per-rank blocks (``load_block`` with crops and flips, 2 and 3 ranks along each of D, H, W)
equal to slicing the array, multi-channel files, slope / intercept scaling, a bad pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spconv_train.data import DataError, VolumeFolder, draw_volume_augment, load_block, strip_bounds

nib = pytest.importorskip("nibabel")

X, Y, Z = 7, 5, 6  # stored (x, y, z): read as D, H, W = 6, 5, 7


def _save(path, arr, disk_dtype=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = nib.Nifti1Image(arr, np.eye(4))
    if disk_dtype is not None:  # floats stored as integers: nibabel writes slope / intercept
        img.set_data_dtype(disk_dtype)
    nib.save(img, str(path))


def _coords() -> np.ndarray:
    """A float32 ``(x, y, z)`` volume whose value says where it is: 100 z + 10 y + x."""
    x, y, z = np.meshgrid(np.arange(X), np.arange(Y), np.arange(Z), indexing="ij")
    return (100 * z + 10 * y + x).astype(np.float32)


def _labels(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 3, (X, Y, Z)).astype(np.uint8)


def test_nifti_axes_are_read_as_z_y_x(tmp_path):
    _save(tmp_path / "images/train/a.nii.gz", _coords())
    _save(tmp_path / "masks/train/a.nii", _labels())
    four = np.stack([_coords(), -_coords()], axis=-1)  # (x, y, z, c): two channels
    _save(tmp_path / "images/train/b.nii.gz", four)
    _save(tmp_path / "masks/train/b.nii.gz", _labels(2))
    src = VolumeFolder(tmp_path, "train", num_classes=3)
    assert len(src) == 2 and [src.size(i) for i in range(2)] == [(Z, Y, X)] * 2
    assert [src.channels(i) for i in range(2)] == [1, 2]
    image, mask = src[0]
    d, h, w = torch.meshgrid(torch.arange(Z), torch.arange(Y), torch.arange(X), indexing="ij")
    assert torch.equal(image[0], (100 * d + 10 * h + w).float())  # D = z, H = y, W = x
    assert torch.equal(mask, torch.from_numpy(_labels().transpose(2, 1, 0).astype(np.int64)))
    image, mask = src[1]
    assert image.shape == (2, Z, Y, X)
    assert torch.equal(image[1], -image[0]) and torch.equal(
        image[0], (100 * d + 10 * h + w).float()
    )
    assert torch.equal(mask, torch.from_numpy(_labels(2).transpose(2, 1, 0).astype(np.int64)))
    block, block_mask = src.read(0, ((1, 4), (2, 5), (3, 6)))
    assert torch.equal(block, src[0][0][:, 1:4, 2:5, 3:6])
    assert torch.equal(block_mask, src[0][1][1:4, 2:5, 3:6])


@pytest.mark.parametrize("parts", [2, 3])
def test_nifti_blocks_per_rank_equal_slicing_the_array(tmp_path, parts):
    _save(tmp_path / "images/train/v.nii.gz", _coords())
    _save(tmp_path / "masks/train/v.nii.gz", _labels())
    src = VolumeFolder(tmp_path, "train", num_classes=3)
    want_image = torch.from_numpy(_coords().transpose(2, 1, 0).copy())[None]
    want_mask = torch.from_numpy(_labels().transpose(2, 1, 0).astype(np.int64))
    aug = draw_volume_augment(0, 0, 3, size=(Z, Y, X), crop=(None, 4, 6), hflip=1, vflip=1)
    assert aug.flips == (False, True, True)
    box = tuple(slice(s, s + n) for s, n in zip(aug.start, aug.out, strict=True))
    want_image, want_mask = (
        want_image[(slice(None), *box)].flip([2, 3]),
        want_mask[box].flip([1, 2]),
    )
    for axis in range(3):
        n = aug.out[axis]
        blocks = [load_block(src, 0, aug, axis, strip_bounds(n, parts, r)) for r in range(parts)]
        assert torch.equal(torch.cat([b[0] for b in blocks], 1 + axis), want_image), axis
        assert torch.equal(torch.cat([b[1] for b in blocks], axis), want_mask), axis


def test_nifti_scaled_integers_and_bad_pairs(tmp_path):
    values = _coords() / 8 - 20  # stored as int16 with slope / intercept
    _save(tmp_path / "images/train/s.nii.gz", values, np.int16)
    _save(tmp_path / "masks/train/s.nii.gz", _labels())
    src = VolumeFolder(tmp_path, "train", num_classes=3)
    assert src.shapes[0] == (Z, Y, X)  # the header's int16 would be refused: floats are read
    want = torch.from_numpy(values.transpose(2, 1, 0).copy())
    assert torch.allclose(src[0][0][0], want, atol=0.01)
    _save(tmp_path / "images/val/t.nii.gz", _coords())
    _save(tmp_path / "masks/val/t.nii.gz", _labels()[:, :, :4])  # z 4 != 6
    with pytest.raises(DataError, match=r"t\.nii\.gz: mask size \(4, 5, 7\)"):
        VolumeFolder(tmp_path, "val", num_classes=3)
