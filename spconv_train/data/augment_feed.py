"""The training feed's use of ``data.augment`` and class oversampling.

``load_planned_strips`` is what ``train.data_feed.load_train_strips`` calls when either is
configured: it draws every sample's plan (identical on all ranks of a replica) and loads
only this rank's strip or tile of each.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

from .augment_spec import parse_augment
from .augment_v2 import AugmentPlan, draw_plan, make_plan_batch, value_range
from .base import SegmentationSource
from .class_sampling import ClassSampler

__all__ = ["class_sampler", "draw_plans", "load_planned_strips"]

# One sampler (and its in-memory location index) per training source and setting.
_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def class_sampler(source: SegmentationSource, cfg: Any) -> ClassSampler | None:
    """The ``ClassSampler`` of ``source`` for ``cfg.data`` (None without
    ``data.oversample_classes``); its index is cached under ``cfg.run_dir``."""
    d = cfg.data
    if not d.oversample_classes:
        return None
    key = (tuple(d.oversample_classes), d.oversample_fraction, cfg.training.seed, cfg.run_dir)
    per_source = _SAMPLERS.setdefault(source, {})
    if key not in per_source:
        per_source[key] = ClassSampler(
            source,
            d.oversample_classes,
            d.oversample_fraction,
            seed=cfg.training.seed,
            cache_dir=cfg.run_dir,
        )
    return per_source[key]


def draw_plans(
    source: SegmentationSource, cfg: Any, epoch: int, indices: list[int]
) -> list[AugmentPlan]:
    """The plans of training samples ``indices`` for ``epoch`` (crop ``data.height`` x
    ``data.width``, flips, scale, ``data.augment``, class oversampling)."""
    d = cfg.data
    specs = parse_augment(d.augment)
    sampler = class_sampler(source, cfg)
    plans = []
    for i in indices:
        h, w = source.size(i)
        crop = None if d.height is None and d.width is None else (d.height or h, d.width or w)
        plans.append(
            draw_plan(
                cfg.training.seed,
                epoch,
                i,
                image_hw=(h, w),
                crop_hw=crop,
                specs=specs,
                hflip=d.hflip,
                vflip=d.vflip,
                scale=tuple(d.scale),
                recentre=None if sampler is None else sampler.recentre(i, epoch),
            )
        )
    return plans


def load_planned_strips(
    source: SegmentationSource, cfg: Any, coords: Any, epoch: int, indices: list[int]
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """This rank's strips (tiles: ``coords.tiled``) of the planned samples ``indices``, and
    their global (H, W): ``train.data_feed.load_train_strips`` with ``data.augment``."""
    plans = draw_plans(source, cfg, epoch, indices)
    hw = plans[0].out_hw
    rows = coords.rows(hw[0]) if coords.tiled else None
    values = value_range(cfg.data.normalize, source.channels(indices[0]))
    image, mask = make_plan_batch(
        source,
        indices,
        plans,
        coords.cols(hw[1]),
        rows=rows,
        ignore_index=cfg.data.ignore_index,
        values=values,
    )
    return image, mask, hw
