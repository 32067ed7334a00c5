"""Value rules the field types cannot express: a table of per-field checks plus a short
list of cross-field checks.

A per-field check runs on the typed value (``None`` skips it: ``null`` is the type's
business) and fails with ``"<key>: expected <check.expected>, got <value>"``. A cross-field
check sees the whole built ``Config`` and returns ``(key, reason)`` for the first problem.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import Config


@dataclass(frozen=True)
class Check:
    """One rule on one field's value: ``test(value)`` must hold."""

    test: Callable[[Any], bool]
    expected: str
    """Completes the sentence "expected ..."."""


def at_least(low: int | float) -> Check:
    """``value >= low``."""
    return Check(lambda v: v >= low, f"a value >= {low}")


def between(low: float, high: float) -> Check:
    """``low <= value <= high`` (NaN fails)."""
    return Check(lambda v: low <= v <= high, f"a value between {low} and {high}")


POSITIVE = Check(lambda v: v > 0 and math.isfinite(v), "a positive number")
NON_EMPTY = Check(lambda v: v.strip() != "", "a non-empty string")
PAIR = Check(lambda v: len(v) == 2, "a list of two numbers")
# Momentum and Adam betas are decay factors: 1 would never forget, so exclude it.
DECAY = Check(lambda v: 0 <= v < 1, "a value in [0, 1)")
DECAYS = Check(lambda v: all(0 <= b < 1 for b in v), "values in [0, 1)")

# Dotted key -> checks, run in order (a length check must precede index checks).
FIELD_CHECKS: dict[str, tuple[Check, ...]] = {
    "run_dir": (NON_EMPTY,),
    "model.name": (NON_EMPTY,),
    "model.num_classes": (at_least(1),),
    "model.in_channels": (at_least(1),),
    "data.train_split": (NON_EMPTY,),
    "data.val_split": (NON_EMPTY,),
    "data.height": (at_least(1),),
    "data.width": (at_least(1),),
    "data.depth": (at_least(1),),
    "data.num_train": (at_least(1),),
    "data.num_val": (at_least(1),),
    "data.batch_size": (at_least(1),),
    "data.num_workers": (at_least(0),),
    "data.hflip": (between(0, 1),),
    "data.vflip": (between(0, 1),),
    "data.scale": (
        Check(lambda v: len(v) == 2, "a [min, max] pair"),
        Check(lambda v: all(s > 0 for s in v), "positive scale factors"),
        Check(lambda v: v[0] <= v[1], "a [min, max] pair with min <= max"),
    ),
    "data.oversample_fraction": (between(0, 1),),
    "data.level": (at_least(0),),
    "data.max_image_pixels": (at_least(1),),
    "data.normalize.percentile": (
        Check(lambda v: len(v) == 2, "a [low, high] pair"),
        Check(lambda v: 0 <= v[0] < v[1] <= 100, "percentiles with 0 <= low < high <= 100"),
    ),
    "data.normalize.std": (
        Check(lambda v: all(x > 0 and math.isfinite(x) for x in v), "positive numbers"),
    ),
    "parallel.sp": (
        Check(
            lambda v: v >= 0 if isinstance(v, int) else len(v) in (2, 3) and min(v) >= 1,
            "an integer >= 0 (0: automatic), a grid [p, q] of two integers >= 1 (rows x "
            "columns of tiles) or, for volumes, [d, h, w] (ranks along D, H, W)",
        ),
    ),
    "parallel.timeout_s": (POSITIVE,),
    "optimizer.lr": (POSITIVE,),
    "optimizer.weight_decay": (at_least(0),),
    "optimizer.momentum": (DECAY,),
    "optimizer.betas": (PAIR, DECAYS),
    "optimizer.grad_clip": (at_least(0),),
    "schedule.warmup_steps": (at_least(0),),
    "schedule.min_lr": (at_least(0),),
    "schedule.power": (POSITIVE,),
    "training.steps": (at_least(1),),
    "training.val_every": (at_least(1),),
    "training.log_every": (at_least(1),),
    "training.activation_checkpointing_every": (at_least(1),),
    "training.compile_backend": (NON_EMPTY,),
    "training.focal_gamma": (at_least(0),),
    "training.tversky_alpha": (at_least(0),),
    "training.tversky_beta": (at_least(0),),
    "training.class_weights": (
        Check(lambda v: all(w >= 0 and math.isfinite(w) for w in v), "non-negative weights"),
    ),
    "checkpoint.every": (at_least(1),),
    "checkpoint.keep_last": (at_least(1),),
    "logging.num_val_images": (at_least(0),),
    "logging.image_downsample": (at_least(1),),
}

Problem = tuple[str, str] | None


def _per_class_lengths(cfg: Config) -> Problem:
    n = cfg.model.num_classes
    for key, values in (
        ("data.class_names", cfg.data.class_names),
        ("training.class_weights", cfg.training.class_weights),
    ):
        if values is not None and len(values) != n:
            return key, (
                f"expected one entry per class (model.num_classes={n}), got {len(values)}; "
                f"fix the list or model.num_classes, or set it to null"
            )
    return None


def _ignore_index(cfg: Config) -> Problem:
    n, ignore = cfg.model.num_classes, cfg.data.ignore_index
    if 0 <= ignore < n:
        return "data.ignore_index", (
            f"{ignore} is a real class index (model.num_classes={n}); "
            f"use a value outside 0..{n - 1}, e.g. 255"
        )
    return None


def _min_lr(cfg: Config) -> Problem:
    if cfg.schedule.min_lr > cfg.optimizer.lr:
        return "schedule.min_lr", (
            f"expected a value <= optimizer.lr ({cfg.optimizer.lr}), got {cfg.schedule.min_lr}"
        )
    return None


def _normalize(cfg: Config) -> Problem:
    norm, channels = cfg.data.normalize, cfg.model.in_channels
    if norm.mode != "dtype" and cfg.data.source != "folder":
        return "data.normalize.mode", (
            f"{norm.mode} applies to folder data (raw file values); synthetic images are "
            "generated in [0, 1]: use dtype, or data.source=folder"
        )
    if norm.mode != "mean_std":
        return None
    for key, values in (("mean", norm.mean), ("std", norm.std)):
        if values is None or len(values) not in (1, channels):
            got = "null" if values is None else f"{len(values)} values"
            return f"data.normalize.{key}", (
                f"mode=mean_std needs one value per channel (model.in_channels={channels}) "
                f"or a single value, got {got}"
            )
    return None


def _synthetic_size(cfg: Config) -> Problem:
    if cfg.data.source == "synthetic":
        for key, value in (("data.height", cfg.data.height), ("data.width", cfg.data.width)):
            if value is None:
                return key, "synthetic data needs an explicit image size, got null"
    return None


def _volumes(cfg: Config) -> Problem:
    """Volume-only keys and what volumes do not support (yet)."""
    data, shard = cfg.data, cfg.parallel.shard_dim
    grid = cfg.parallel.sp if isinstance(cfg.parallel.sp, list) else None
    if grid is not None and len(grid) != (3 if data.kind == "volume" else 2):
        return "parallel.sp", (
            f"a grid {grid} does not fit data.kind: {data.kind}: [p, q] splits 2-D images "
            "into H x W tiles; volumes split one dim (parallel.shard_dim, with an integer) "
            "or take [d, h, w] (ranks along D, H, W)"
        )
    if grid is not None and shard != "W":
        return "parallel.shard_dim", (
            f"{shard} conflicts with the grid parallel.sp={grid}, which names the split dims "
            "itself; leave parallel.shard_dim at W"
        )
    if data.kind == "image":
        if shard != "W":
            return "parallel.shard_dim", (
                f"{shard} applies to volumes (data.kind: volume); images are split along W"
            )
        return None
    if data.source == "synthetic" and data.depth is None:
        return "data.depth", "synthetic volumes need an explicit depth, got null"
    if list(data.scale) != [1.0, 1.0]:
        return "data.scale", "rescaling volumes is not supported; use [1.0, 1.0]"
    if data.normalize.mode != "dtype":
        return "data.normalize.mode", (
            f"{data.normalize.mode} is not supported for volumes yet; use dtype "
            "(uint8 / 255, uint16 / 65535, floats kept)"
        )
    if data.split_list is not None:
        return "data.split_list", "not supported for volumes yet; use separate split folders"
    return None


def _augment(cfg: Config) -> Problem:
    """``data.augment`` items and ``data.oversample_classes`` (``data.augment_spec``)."""
    from spconv_train.data.augment_spec import AugmentSpecError, parse_augment

    data = cfg.data
    try:
        parse_augment(data.augment)
    except AugmentSpecError as e:
        return e.key, e.reason
    for key, value in (
        ("data.augment", data.augment),
        ("data.oversample_classes", data.oversample_classes),
    ):
        if value and data.kind == "volume":
            return key, "not supported for volumes (data.kind: volume) yet; remove it"
    n = cfg.model.num_classes
    bad = [c for c in data.oversample_classes if not 0 <= c < n or c == data.ignore_index]
    if bad:
        return "data.oversample_classes", (
            f"{bad} are not class indices: expected values in [0, {n}) other than "
            f"data.ignore_index ({data.ignore_index})"
        )
    return None


def _compile_mode(cfg: Config) -> Problem:
    t = cfg.training
    if t.compile_mode != "default" and not t.compile:
        return "training.compile_mode", (
            f"{t.compile_mode!r} chooses what torch.compile compiles, but training.compile is "
            "false; set training.compile: true, or leave compile_mode at 'default'"
        )
    return None


CROSS_CHECKS: tuple[Callable[[Config], Problem], ...] = (
    _per_class_lengths,
    _ignore_index,
    _min_lr,
    _synthetic_size,
    _volumes,
    _normalize,
    _augment,
    _compile_mode,
)


def _folder_paths(cfg: Config) -> Problem:
    data = cfg.data
    if data.source != "folder":
        return None
    if data.root is None:
        return "data.root", "required when data.source is 'folder' (images/{split}, masks/{split})"
    root = Path(data.root).expanduser()
    if not root.is_dir():
        return "data.root", f"directory not found: {root.resolve()}"
    for key, split in (("data.train_split", data.train_split), ("data.val_split", data.val_split)):
        for sub in ("images", "masks"):
            if not (root / sub / split).is_dir():
                return key, (
                    f"folder not found: {(root / sub / split).resolve()} "
                    f"(data.root must contain images/{{split}} and masks/{{split}})"
                )
    split_list = None if data.split_list is None else Path(data.split_list).expanduser()
    if split_list is not None and not (split_list.is_file() or (root / split_list).is_file()):
        return "data.split_list", (
            f"file not found: {split_list.resolve()} (nor under data.root: {root / split_list})"
        )
    return None


def _weights_file(cfg: Config) -> Problem:
    weights = cfg.model.weights
    if weights is not None and not Path(weights).expanduser().is_file():
        return "model.weights", f"file not found: {Path(weights).resolve()}"
    return None


# Checks that look at the file system; load_config(check_paths=False) skips them.
PATH_CHECKS: tuple[Callable[[Config], Problem], ...] = (_folder_paths, _weights_file)
