"""One batch stacks samples of one size: a mismatch is refused naming every sample and its
size, for images and volumes alike (``data.base.check_one_size``)."""

from __future__ import annotations

import pytest

from spconv_train.data.base import DataError, check_one_size
from spconv_train.data.volumes import SyntheticVolumes, VolumeAugment, make_volume_batch


class _Named:
    def name(self, i: int) -> str:
        return f"img{i}.png"


def test_one_size_passes_and_mismatch_names_every_sample():
    check_one_size(_Named(), [0, 1], [(4, 5), (4, 5)], "samples", "(HxW)", "fix")
    with pytest.raises(DataError) as info:
        check_one_size(_Named(), [3, 7], [(4, 5), (4, 6)], "samples", "(HxW)", "use batch 1")
    assert str(info.value) == (
        "samples in one batch must have the same size (HxW): img3.png 4x5, img7.png 4x6; "
        "use batch 1"
    )


def test_volume_batch_of_two_sizes_refused():
    source = SyntheticVolumes(2, size=(4, 6, 6), num_classes=2)
    augments = [VolumeAugment((0, 0, 0), (4, 6, 6)), VolumeAugment((0, 0, 0), (4, 5, 6))]
    with pytest.raises(DataError, match=r"volumes in one batch must have the same size \(DxHxW\)"):
        make_volume_batch(source, [0, 1], augments, ((0, 4), (0, 5), (0, 6)))
    images, masks = make_volume_batch(source, [0, 1], augments[:1] * 2, ((0, 4), (0, 6), (0, 6)))
    assert images.shape == (2, 1, 4, 6, 6) and masks.shape == (2, 4, 6, 6)
