"""Checks that need the world size, known only once the launcher has started, and the
spatial layout they resolve (``parallel.sp: 0`` = automatic, see ``resolve_grid``)."""

from __future__ import annotations

import math

from ._errors import ConfigError
from ._grid import choose_grid, empty_ranks
from .schema import Config

# A spatial axis -> the data key whose extent it splits, its unit and its mesh dim name.
_SPLIT_KEYS = {"W": "data.width", "H": "data.height", "D": "data.depth"}
_UNITS = {"W": "columns", "H": "rows", "D": "slices"}
#: ``ParallelDims.AXIS`` (spconv_train.parallel) spelled out: config stays importable without
#: torch (tests/test_parallel_dims.py checks they agree)
MESH_DIMS = {"D": "sp_d", "H": "sp_h", "W": "sp_w"}
IMAGE_AXES, VOLUME_AXES = ("H", "W"), ("D", "H", "W")


def grid_axes(cfg: Config) -> tuple[str, ...]:
    """The axes a grid ``parallel.sp`` lists: ``(H, W)`` for images, ``(D, H, W)`` for
    volumes."""
    return VOLUME_AXES if cfg.data.kind == "volume" else IMAGE_AXES


def spatial_grid(cfg: Config) -> tuple[int, ...] | None:
    """The grid of ``parallel.sp`` when it is a list, else None (an integer: one split dim).

    Images: ``(p, q)``, p x q tiles (p along H, q along W). Volumes: ``(d, h, w)`` ranks
    along D, H, W (1: not split). After ``resolve_grid`` an automatic choice is a grid too.
    """
    sp = cfg.parallel.sp
    return None if isinstance(sp, int) else tuple(int(n) for n in sp)


def grid_mesh_dims(cfg: Config) -> dict[str, int] | None:
    """The spatial mesh dims ``{name: ranks}`` that ``distributed.build_mesh`` builds for a
    grid, or None for one split dim (``("dp", "sp")``, ``split_dim`` names the dim).

    Images: ``{"sp_h": p, "sp_w": q}`` (a 1 x q grid still runs as tiles). Volumes: the
    dims split over more than one rank (``sp_d``, ``sp_h``, ``sp_w``, in that order), or
    None when at most one is (a grid ``[1, 1, n]`` runs as n strips along W).
    """
    grid = spatial_grid(cfg)
    if grid is None:
        return None
    if cfg.data.kind != "volume":
        return {"sp_h": grid[0], "sp_w": grid[1]}
    dims = {MESH_DIMS[a]: n for a, n in zip(VOLUME_AXES, grid, strict=True) if n > 1}
    return dims if len(dims) > 1 else None


def split_dim(cfg: Config) -> str:
    """The one split axis (``"D"``, ``"H"``, ``"W"``) of a layout without ``grid_mesh_dims``:
    the only axis a volume grid splits, else ``parallel.shard_dim``."""
    grid = spatial_grid(cfg)
    if grid is not None and cfg.data.kind == "volume":
        split = [a for a, n in zip(VOLUME_AXES, grid, strict=True) if n > 1]
        if len(split) == 1:
            return split[0]
    return cfg.parallel.shard_dim


def _pool_levels(cfg: Config) -> int:
    """How often ``unet3d`` halves every extent (``depth - 1`` max-poolings); 0 otherwise.
    DTensor chunks each level's extent again, so every level must fill every rank."""
    if cfg.data.kind != "volume" or cfg.model.name != "unet3d":
        return 0
    depth = cfg.model.kwargs.get("depth", 4)  # UNet's default
    return max(int(depth) - 1, 0) if isinstance(depth, int) else 0


def _check_extent(cfg: Config, key: str, unit: str, parts: int, what: str) -> None:
    """The extent at ``key`` split like ``torch.chunk`` into ``parts`` must leave no rank
    without data, also after the network's poolings (``_pool_levels``)."""
    size = getattr(cfg.data, key.split(".")[1])
    if size is None or parts == 1:
        return
    levels = _pool_levels(cfg)
    level, empty = empty_ranks(size, parts, levels)
    if not empty:
        return
    if level == 0:
        chunk = math.ceil(size / parts)
        raise ConfigError(
            key,
            f"{size} {unit} split over {parts} ranks in {what} of {chunk} leave "
            f"{empty} rank(s) empty; use a size that fills every one of them "
            f"(e.g. a multiple of {parts}) or a smaller parallel.sp",
        )
    raise ConfigError(
        key,
        f"{size} {unit} split over {parts} ranks in {what}: after {level} of the "
        f"{levels} max-poolings of {cfg.model.name} ({size // 2**level} {unit}) "
        f"{empty} rank(s) would be empty and the network fails; use a multiple of "
        f"{parts * 2**levels} (parts * 2 ** (depth - 1)) or fewer ranks along this dim",
    )


def _auto_grid(cfg: Config, world_size: int) -> tuple[int, ...] | None:
    """What ``parallel.sp: 0`` means at ``world_size`` ranks: the most square tile (most
    cubic block) for the configured size (``choose_grid``), or None for all ranks along
    one dim (``parallel.shard_dim``, W by default).

    None when the choice is strips of that dim anyway, when a size is null (full images of
    unknown size: strips, as the size is known only per image), when a volume's
    ``parallel.shard_dim`` is set to H or D (the user named the split dim), or when every
    split leaves a rank empty (the strips' check then says why).
    """
    d = cfg.data
    volume = d.kind == "volume"
    shape = (d.depth, d.height, d.width) if volume else (d.height, d.width)
    if any(n is None for n in shape) or (volume and cfg.parallel.shard_dim != "W"):
        return None
    grid = choose_grid(shape, world_size, _pool_levels(cfg))
    if grid is None or grid[-1] == world_size:  # all ranks along W: strips
        return None
    return grid


def _layout(cfg: Config, world_size: int) -> tuple[tuple[int, ...] | None, int]:
    """``(grid, sp)``: the grid in use (automatic for ``parallel.sp: 0``) and its ranks."""
    if cfg.parallel.sp == 0:
        grid = _auto_grid(cfg, world_size)
        return grid, math.prod(grid) if grid else world_size
    grid = spatial_grid(cfg)
    return grid, math.prod(grid) if grid else cfg.parallel.sp


def validate_for_world(cfg: Config, world_size: int) -> tuple[int, int]:
    """Resolve the (dp, sp) mesh shape for ``world_size`` ranks, or raise ``ConfigError``.

    ``parallel.sp = 0`` means every rank shares one image (sp = world_size, dp = 1), laid
    out automatically (``resolve_grid``). Otherwise sp must divide the world size, and
    dp = world_size // sp. Also checks that every split extent, chunked like
    ``torch.chunk`` (strips of ceil(W / sp) columns), leaves no rank without data: the
    width for strips, ``data.height`` over p and ``data.width`` over q for a grid
    ``[p, q]`` (sp = p * q; ``spatial_grid`` tells the tile shape), each of D, H, W over
    its ranks for a volume grid ``[d, h, w]``; for ``unet3d`` also after each of its
    ``depth - 1`` poolings. Does not change ``cfg`` (``resolve_grid`` records the choice).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    grid, sp = _layout(cfg, world_size)
    if world_size % sp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        what = f"a grid {'x'.join(map(str, grid))} = {sp} ranks" if grid else f"sp={sp}"
        raise ConfigError(
            "parallel.sp",
            f"{what} does not divide the world size {world_size}; "
            f"use one of {divisors}, or 0 for all ranks",
        )
    if grid:
        what = "blocks" if cfg.data.kind == "volume" else "tiles"
        for axis, parts in zip(grid_axes(cfg), grid, strict=True):
            _check_extent(cfg, _SPLIT_KEYS[axis], _UNITS[axis], parts, what)
    else:
        shard = split_dim(cfg)
        _check_extent(cfg, _SPLIT_KEYS[shard], _UNITS[shard], sp, "strips")
    return world_size // sp, sp


def resolve_grid(cfg: Config, world_size: int) -> tuple[int, int]:
    """``validate_for_world``, and record the automatic layout of ``parallel.sp: 0`` in
    ``cfg``: ``parallel.sp`` becomes the chosen grid (``[p, q]`` tiles, ``[d, h, w]`` for
    volumes) unless the choice is all ranks along one dim (``parallel.sp`` stays 0).

    Call it once where the mesh is built (``run``, ``verify``, ``config --world-size``):
    the resolved config saved in the run folder then names the grid, and a resume of the
    same config at the same world size chooses it again. Idempotent.
    """
    dp, sp = validate_for_world(cfg, world_size)
    if cfg.parallel.sp == 0:
        grid = _auto_grid(cfg, world_size)
        if grid is not None:
            cfg.parallel.sp = list(grid)
    return dp, sp


def describe_grid(cfg: Config) -> str:
    """`` (2x2 tiles)`` / `` (1x2x2 blocks)`` for a grid ``parallel.sp``, else ``""``:
    for the messages that show the mesh."""
    grid = spatial_grid(cfg)
    if grid is None:
        return ""
    return f" ({'x'.join(map(str, grid))} {'blocks' if cfg.data.kind == 'volume' else 'tiles'})"


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
