"""Datasets, per-rank strip loading, augmentation in global coordinates, synthetic data.

This package never imports ``spconv_train.parallel``: column ranges come in as arguments
(``strip_bounds`` reproduces DTensor's ``Shard`` split so callers can compute them).
"""

from .base import DataError, SegmentationSource, check_cols
from .folder import FolderDataset
from .normalize import normalize_image
from .scan import normalization_range
from .strips import make_batch, make_dp_sampler, strip_bounds
from .synthetic import synthetic_class_names, synthetic_sample, write_synthetic_dataset
from .synthetic_dataset import SyntheticDataset
from .tiff import read_region
from .transforms import AugmentParams, draw_augment, global_size, load_strip

__all__ = [
    "AugmentParams",
    "DataError",
    "FolderDataset",
    "SegmentationSource",
    "SyntheticDataset",
    "check_cols",
    "draw_augment",
    "global_size",
    "load_strip",
    "make_batch",
    "make_dp_sampler",
    "normalization_range",
    "normalize_image",
    "read_region",
    "strip_bounds",
    "synthetic_class_names",
    "synthetic_sample",
    "write_synthetic_dataset",
]
