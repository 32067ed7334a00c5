"""Datasets, per-rank strip loading, augmentation in global coordinates, synthetic data.

This package never imports ``spconv_train.parallel``: column ranges come in as arguments
(``strip_bounds`` reproduces DTensor's ``Shard`` split so callers can compute them).
"""

from ._readers import (  # public names for predict (the readers stay in _readers)
    IMAGE_EXTS,
    MASK_EXTS,
    check_mask_values,
    image_header,
    index_folder,
    mask_header,
    read_image,
    read_image_raw,
    read_mask,
)
from .base import DataError, SegmentationSource, check_cols
from .folder import FolderDataset
from .grid import stitch_grid
from .normalize import normalize_image
from .scan import image_range, normalization_range
from .strips import make_batch, make_dp_sampler, strip_bounds
from .synthetic import synthetic_class_names, synthetic_sample, write_synthetic_dataset
from .synthetic_dataset import SyntheticDataset
from .tiff import read_region
from .transforms import AugmentParams, draw_augment, global_size, load_strip
from .volume_folder import VolumeFolder
from .volumes import (
    AXES,
    Box,
    SyntheticVolumes,
    VolumeAugment,
    VolumeSource,
    draw_volume_augment,
    load_block,
    load_box,
    make_volume_batch,
)

__all__ = [
    "AXES",
    "Box",
    "IMAGE_EXTS",
    "MASK_EXTS",
    "AugmentParams",
    "DataError",
    "FolderDataset",
    "SegmentationSource",
    "SyntheticDataset",
    "SyntheticVolumes",
    "VolumeAugment",
    "VolumeFolder",
    "VolumeSource",
    "check_cols",
    "check_mask_values",
    "draw_augment",
    "draw_volume_augment",
    "global_size",
    "image_header",
    "index_folder",
    "load_block",
    "load_box",
    "load_strip",
    "make_batch",
    "make_dp_sampler",
    "make_volume_batch",
    "mask_header",
    "image_range",
    "normalization_range",
    "normalize_image",
    "read_image",
    "read_image_raw",
    "read_mask",
    "read_region",
    "stitch_grid",
    "strip_bounds",
    "synthetic_class_names",
    "synthetic_sample",
    "write_synthetic_dataset",
]
