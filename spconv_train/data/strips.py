"""Per-rank strips, batches of strips, and the data-parallel sampler.

On a ``(dp, sp)`` mesh, the ``sp`` ranks of one data-parallel replica read the same samples
(same ``dp_rank``, hence the same sampler output) with the same augmentation (drawn from
``(seed, epoch, index)``), each only its own columns ``strip_bounds(W, sp, sp_rank)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

from .base import DataError, SegmentationSource
from .transforms import AugmentParams, global_size, load_strip

__all__ = ["make_batch", "make_dp_sampler", "strip_bounds"]


def strip_bounds(width: int, parts: int, rank: int) -> tuple[int, int]:
    """Column range ``[a, b)`` that DTensor ``Shard(dim)`` gives ``rank`` of ``parts``.

    ``torch.chunk`` semantics: every rank gets ``ceil(width / parts)`` columns except at
    the end, where ranks get fewer or none (``a == b == width``).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if not 0 <= rank < parts:
        raise ValueError(f"rank must be in [0, {parts}), got {rank}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    chunk = -(-width // parts)
    return min(rank * chunk, width), min((rank + 1) * chunk, width)


def make_batch(
    source: SegmentationSource,
    indices: list[int],
    cols: tuple[int, int],
    params_list: list[AugmentParams],
    *,
    ignore_index: int | None = None,
    rows: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Stack the strips ``cols`` (tiles ``rows`` x ``cols``) of the augmented samples
    ``indices``.

    All samples must have the same augmented (global) size, so that one ``cols`` range
    means the same thing for each; otherwise a ``DataError`` names the samples.

    Returns:
        images float32 ``[B, C, H, b - a]`` and masks int64 ``[B, H, b - a]`` (``H``: the
        tile's rows when ``rows`` is given).
    """
    if len(indices) != len(params_list):
        raise ValueError(f"{len(indices)} indices but {len(params_list)} augmentation params")
    if not indices:
        raise ValueError("make_batch needs at least one sample")
    sizes = [global_size(source, i, p) for i, p in zip(indices, params_list, strict=True)]
    if len(set(sizes)) > 1:
        listed = ", ".join(
            f"{source.name(i)} {h}x{w}" for i, (h, w) in zip(indices, sizes, strict=True)
        )
        raise DataError(
            f"samples in one batch must have the same size after augmentation (HxW): {listed}; "
            "set a crop size or use batch size 1"
        )
    channels = {source.channels(i) for i in indices}
    if len(channels) > 1:
        listed = ", ".join(f"{source.name(i)}: {source.channels(i)}" for i in indices)
        raise DataError(f"samples in one batch have different channel counts ({listed})")
    strips = [
        load_strip(source, i, cols, p, ignore_index=ignore_index, rows=rows)
        for i, p in zip(indices, params_list, strict=True)
    ]
    return torch.stack([s[0] for s in strips]), torch.stack([s[1] for s in strips])


class _Length:
    """The only thing ``DistributedSampler`` needs from a dataset: its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def make_dp_sampler(
    num_samples: int,
    *,
    dp: int,
    dp_rank: int,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> DistributedSampler:
    """``torch.utils.data.DistributedSampler`` over ``num_samples`` for one data-parallel rank.

    Pass the *data-parallel* size and rank (not the global ones): all spatial ranks of a
    replica must get the same indices. Call ``set_epoch(epoch)`` every epoch to reshuffle.
    With ``drop_last=False`` short ranks are padded by repeating samples, so every rank
    runs the same number of steps (the collectives need that). Needs no process group.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return DistributedSampler(
        _Length(num_samples),  # type: ignore[arg-type]
        num_replicas=dp,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
