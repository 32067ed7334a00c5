"""Up-front checks and statistics of the folder splits, once per run, cached in run_dir."""

from __future__ import annotations

from pathlib import Path

from .folder import FolderDataset
from .normalize import ChannelRange
from .scan import CACHE_NAME, ScanCache

__all__ = ["prepare_splits"]


def prepare_splits(
    train: FolderDataset,
    val: FolderDataset,
    run_dir: str | Path | None,
    *,
    grid: tuple[int, int] = (1, 1),
    crop: tuple[int | None, int | None] | None = None,
) -> ChannelRange | None:
    """Validate both splits (streamed mask scans) and compute the normalisation statistics.

    ``grid`` (rows x columns of spatial ranks) and the training ``crop`` (``data.height``,
    ``data.width``) bound what one rank holds of an image read whole: validation images
    always, training images along a dim without a crop (``FolderDataset.validate_all``).

    Summaries are cached in ``run_dir/data_cache.json`` under a file lock: the first rank
    scans, the others (and later restarts) read the cache; changed files are re-scanned.
    Returns the dataset-wide ``(low, high)`` per channel for ``normalize.scope=dataset``
    (from the training split, used for validation too), else None.
    """
    cache = ScanCache(None if run_dir is None else Path(run_dir) / CACHE_NAME)
    with cache.locked():
        train.validate_all(cache, grid=grid, crop=crop)
        val.validate_all(cache, grid=grid)  # validation runs whole images
        dataset_range = train.prepare_normalization(cache)
        val.prepare_normalization(cache, dataset_range)
    return dataset_range
