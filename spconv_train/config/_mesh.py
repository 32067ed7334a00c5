"""Checks that need the world size, known only once the launcher has started."""

from __future__ import annotations

import math

from ._errors import ConfigError
from .schema import Config

# parallel.shard_dim -> the data key whose extent is split across the sp ranks, and its unit.
_SPLIT_KEYS = {"W": "data.width", "H": "data.height", "D": "data.depth"}
_UNITS = {"W": "columns", "H": "rows", "D": "slices"}


def spatial_grid(cfg: Config) -> tuple[int, int] | None:
    """``(p, q)`` when ``parallel.sp`` is a grid (p x q tiles: p along H, q along W), else
    None (width strips)."""
    sp = cfg.parallel.sp
    return None if isinstance(sp, int) else (int(sp[0]), int(sp[1]))


def _check_extent(cfg: Config, key: str, unit: str, parts: int, what: str) -> None:
    """The extent at ``key`` split like ``torch.chunk`` into ``parts`` must leave no rank
    without data."""
    size = getattr(cfg.data, key.split(".")[1])
    if size is None:
        return
    chunk = math.ceil(size / parts)
    filled = math.ceil(size / chunk)
    if filled < parts:
        raise ConfigError(
            key,
            f"{size} {unit} split over {parts} ranks in {what} of {chunk} leave "
            f"{parts - filled} rank(s) empty; use a size that fills every one of them "
            f"(e.g. a multiple of {parts}) or a smaller parallel.sp",
        )


def validate_for_world(cfg: Config, world_size: int) -> tuple[int, int]:
    """Resolve the (dp, sp) mesh shape for ``world_size`` ranks, or raise ``ConfigError``.

    ``parallel.sp = 0`` means every rank shares one image (sp = world_size, dp = 1).
    Otherwise sp must divide the world size. Also checks that the image width, split like
    ``torch.chunk`` (strips of ceil(W / sp) columns), leaves no rank without columns.
    A grid ``[p, q]`` gives sp = p * q (``spatial_grid`` tells the tile shape), and both
    ``data.height`` over p and ``data.width`` over q are checked that way.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    grid = spatial_grid(cfg)
    sp = math.prod(grid) if grid else cfg.parallel.sp or world_size
    if world_size % sp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        what = f"a grid {grid[0]}x{grid[1]} = {sp} ranks" if grid else f"sp={sp}"
        raise ConfigError(
            "parallel.sp",
            f"{what} does not divide the world size {world_size}; "
            f"use one of {divisors}, or 0 for all ranks",
        )
    if grid:
        _check_extent(cfg, "data.height", "rows", grid[0], "tiles")
        _check_extent(cfg, "data.width", "columns", grid[1], "tiles")
    else:
        shard = cfg.parallel.shard_dim
        _check_extent(cfg, _SPLIT_KEYS[shard], _UNITS[shard], sp, "strips")
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
