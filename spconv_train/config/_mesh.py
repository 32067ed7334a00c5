"""Checks that need the world size, known only once the launcher has started."""

from __future__ import annotations

import math

from ._errors import ConfigError
from .schema import Config

# parallel.shard_dim -> the data key whose extent is split across the sp ranks, and its unit.
_SPLIT_KEYS = {"W": "data.width", "H": "data.height", "D": "data.depth"}
_UNITS = {"W": "columns", "H": "rows", "D": "slices"}


def validate_for_world(cfg: Config, world_size: int) -> tuple[int, int]:
    """Resolve the (dp, sp) mesh shape for ``world_size`` ranks, or raise ``ConfigError``.

    ``parallel.sp = 0`` means every rank shares one image (sp = world_size, dp = 1).
    Otherwise sp must divide the world size. Also checks that the image width, split like
    ``torch.chunk`` (strips of ceil(W / sp) columns), leaves no rank without columns.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    sp = cfg.parallel.sp or world_size
    if world_size % sp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(
            "parallel.sp",
            f"sp={sp} does not divide the world size {world_size}; "
            f"use one of {divisors}, or 0 for all ranks",
        )
    key = _SPLIT_KEYS[cfg.parallel.shard_dim]
    width = getattr(cfg.data, key.split(".")[1])
    if width is not None:
        strip = math.ceil(width / sp)
        filled = math.ceil(width / strip)
        if filled < sp:
            raise ConfigError(
                key,
                f"{width} {_UNITS[cfg.parallel.shard_dim]} split over sp={sp} ranks in strips "
                f"of {strip} leave "
                f"{sp - filled} rank(s) empty; use a size that fills every strip "
                f"(e.g. a multiple of {sp}) or a smaller parallel.sp",
            )
    return world_size // sp, sp


def data_width_per_rank(cfg: Config, sp: int) -> int:
    """Columns of the widest strip when ``data.width`` is split over ``sp`` ranks.

    ``sp`` is the resolved group size (as returned by ``validate_for_world``), not 0.
    """
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp must be a resolved positive group size, got {sp!r}")
    if cfg.data.width is None:
        raise ConfigError(
            "data.width", "is null (full image): the strip width is known only per image"
        )
    return math.ceil(cfg.data.width / sp)
