"""Max, average and adaptive pooling on every layout against one device: one grid.

Window pools (every kernel / stride / padding / dilation / ``ceil_mode`` /
``count_include_pad`` / ``divisor_override`` configuration, int and per-dim) and adaptive
pools (global, small, larger than the world, ``None`` sizes) x spatial rank (1-D signals,
2-D images, 3-D volumes) x sharded axes (the layouts of ``tests/test_conv_grid.py``: strips,
rows, tiles, a volume along D, H or W, volume blocks, with a ``dp`` batch dim; one rank)
x world size (1, 2, 3, 4; sizes that do not split evenly). fp64; output (with
``return_indices`` the global indices, images and signals), input gradient under a
``Shard``, ``Replicate`` or ``Partial`` upstream gradient, output placements, and no
activation-sized collective (``tests/op_check.py``). Modules go through ``parallelize``,
functions through ``SpatialMode``.

Ties: every layout (but the ``dp`` ones) also runs max pooling on integer-valued inputs
full of exact ties, with maxima planted on both sides of every shard boundary and a later
rank holding the row-major first maximum: the values, indices and the input gradient (which
shows the element each tie went to) equal one device's (torch's tie-break: the first
maximum in row-major order).

All cases of a world size run in one worker call; each config runs at two of the worlds,
on the layout its index picks there, so the configs spread over every layout family.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded
from tests.test_conv_grid import LAYOUTS as CONV_LAYOUTS
from tests.test_conv_grid import _for_rank, _parts

WORLDS = (2, 3, 4)
#: per world: label -> (mesh shape, mesh dim names, tensor rank, placements): the conv
#: grid's image and volume layouts (pools of 1-D signals are not sharded ops)
LAYOUTS = {1: {"one rank": ((1,), ("sp",), 4, [Shard(3)])}}
LAYOUTS |= {w: {k: v for k, v in CONV_LAYOUTS[w].items() if v[2] > 3} for w in WORLDS}
GRAD_KINDS = ("shard", "replicate", "partial")
_CLS = {("max", 2): nn.MaxPool2d, ("max", 3): nn.MaxPool3d}
_CLS |= {("avg", 2): nn.AvgPool2d, ("avg", 3): nn.AvgPool3d}
_ADAPTIVE = {(k, n): getattr(F, f"adaptive_{k}_pool{n}d") for k in ("avg", "max") for n in (2, 3)}


def window_configs() -> list[tuple[str, dict]]:
    """(kind, kwargs) of the window pools; a 3-tuple is per (D, H, W), a lower rank takes
    its last entries."""
    cfgs: list[tuple[str, dict]] = []
    for ceil in (False, True):
        for k, s, p in [(2, 2, 0), (3, 2, 1), (3, 1, 1), (3, 3, 1), (4, 3, 2), (5, 2, 2)]:
            kw = dict(kernel_size=k, stride=s, padding=p, ceil_mode=ceil)
            cfgs.append(("max", kw))
            cfgs += [("avg", dict(kw, count_include_pad=cip)) for cip in (True, False)]
        for d in (2, 3):
            cfgs.append(
                ("max", dict(kernel_size=3, stride=2, padding=1, dilation=d, ceil_mode=ceil))
            )
        cfgs.append(("max", dict(kernel_size=(2, 3, 2), stride=(2, 1, 3), padding=(1, 1, 1),
                                 dilation=(1, 2, 3), ceil_mode=ceil)))  # fmt: skip
        cfgs.append(("avg", dict(kernel_size=3, stride=2, padding=1, ceil_mode=ceil,
                                 divisor_override=5)))  # fmt: skip
        cfgs.append(("avg", dict(kernel_size=(3, 2, 5), stride=(1, 3, 2), padding=(1, 1, 2),
                                 ceil_mode=ceil, count_include_pad=False)))  # fmt: skip
    return cfgs


#: adaptive output sizes; on tiles and blocks only outputs of at most a quarter of a tile
#: run (larger ones are refused: ``tests/test_tiles_adaptive_max.py``)
ADAPTIVE_SIZES = [1, (2, 3, 5), (2, None, 4), (1, 2, 1), (3, 4, 2), 3, (2, 1, 7), (1, 2, 13)]


def _pool_sizes(cfg: dict, parts: list[int], extra: int) -> list[int]:
    """Per spatial dim a size every rank can run: a sharded dim holds a window's extent and
    a stride per rank plus ``extra`` (its remainder modulo the stride decides whether a
    ceil-mode window overhangs); an unsharded one just fits the kernel."""
    n = len(parts)
    k, s, p, d = (
        (v,) * n if isinstance(v, int) else v
        for v in (cfg["kernel_size"], cfg.get("stride") or cfg["kernel_size"],
                  cfg.get("padding", 0), cfg.get("dilation", 1))
    )  # fmt: skip
    return [
        q * (d[j] * (k[j] - 1) + p[j] + s[j] + 1) + extra if q > 1 else d[j] * (k[j] - 1) + 3
        for j, q in enumerate(parts)
    ]


def _smallest(size: int, parts: int) -> int:
    """The smallest of DTensor's chunks of ``size`` over ``parts`` ranks (0: one is empty)."""
    chunks = torch.arange(size).chunk(parts)
    return min(len(c) for c in chunks) if len(chunks) == parts else 0


def _adaptive_out(size, shape: tuple[int, ...]) -> tuple[int, ...]:
    size = (size,) * len(shape) if isinstance(size, int) else size[-len(shape) :]
    return tuple(m if o is None else o for o, m in zip(size, shape, strict=True))


def _adaptive_placements(pl, dmesh, ndim: int, out: tuple[int, ...]) -> list:
    """The output placements of an adaptive pool (``_pool.py``): a single sharded dim
    pooled to more than one cell keeps its ``Shard`` (images and signals: only when every
    rank gets an output cell), everything else is ``Replicate`` on the spatial mesh dims."""
    spatial = [(m, p.dim) for m, p in enumerate(pl) if p.dim >= 2]  # size-1 mesh dims too
    keep = len(spatial) == 1 and out[spatial[0][1] - 2] > 1
    if keep and ndim < 5:
        m, d = spatial[0]
        o, q = out[d - 2], dmesh.size(m)
        keep = -(-o // q) * (q - 1) < o
    return [p if p.dim < 2 or keep else Replicate() for p in pl]


def tied(seed: int, shape: tuple[int, ...], pl, dmesh) -> torch.Tensor:
    """Values in {-1, 0, 1}; the maximum 3 planted on both sides of every shard boundary
    and 9 at the start of the last shard of the last sharded dim (first row, so that a later
    rank holds the row-major first maximum while rank 0 holds one in a later row)."""
    x = (seeded(seed, *shape, dtype=torch.float64) * 1.2).round().clamp(-1, 1)
    dims = [(p.dim, dmesh.size(m)) for m, p in enumerate(pl) if p.dim >= 2]
    for d, n in dims:
        for r in range(1, n):
            b = -(-shape[d] // n) * r  # DTensor's chunk boundary
            if 0 < b < shape[d]:
                x.narrow(d, b - 1, 2).fill_(3.0)
    last, n = dims[-1]
    first, later = [0] * (len(shape) - 2), [0] * (len(shape) - 2)
    first[last - 2] = min(-(-shape[last] // n) * (n - 1), shape[last] - 1)
    later[1 if last == 2 and len(shape) > 3 else 0] = 1  # a later row, on rank 0
    x[(..., *first)] = x[(..., *later)] = 9.0
    return x


def runs_window(world: int, name: str, ci: int) -> bool:
    """Whether window config ``ci`` runs on layout ``name`` at ``world``: at two of the
    worlds, on the layout its index picks there (three mesh dims, the costliest layouts, run
    ties and adaptive pools only); at one rank every eighth config."""
    if world == 1:
        return ci % 8 == 0
    names = [k for k, v in LAYOUTS[world].items() if len(v[0]) < 3]
    if name not in names or WORLDS[ci % 3] == world:
        return False
    return (ci // 3) % len(names) == names.index(name)


def _window_cases(world: int, li: int, name: str, spec, dmesh, failures: list[str]) -> None:
    shape, names, ndim, pl = spec
    n, batch = ndim - 2, 2 if "dp" in names else 1
    for ci, (kind, cfg) in enumerate(window_configs()):
        if not runs_window(world, name, ci):
            continue
        cfg = _for_rank(cfg, n)
        parts = _parts(dmesh, pl, ndim)
        x = seeded(ci + 31 * li, batch, 3, *_pool_sizes(cfg, parts, (ci + world) % 3),
                   dtype=torch.float64)  # fmt: skip
        grad = GRAD_KINDS[(ci + world) % 3]
        label = f"{name} {kind} {cfg} {tuple(x.shape)} grad={grad}"
        mod = _CLS[kind, n](**cfg)
        check_module(mod, x, dmesh, pl, label, failures, grad=grad, out_placements=pl)
        if kind == "max" and n == 2 and ci % 4 == 1:  # global indices, as torch's
            fn = lambda t, c=cfg: F.max_pool2d(t, **c, return_indices=True)  # noqa: E731
            check_fn(fn, x, dmesh, pl, f"{label} indices", failures)


def _adaptive_cases(world: int, li: int, name: str, spec, dmesh, failures: list[str]) -> None:
    shape, names, ndim, pl = spec
    n, batch = ndim - 2, 2 if "dp" in names else 1
    parts = _parts(dmesh, pl, ndim)
    multi = sum(p.dim >= 2 for p in pl) > 1  # tiles and blocks (size-1 mesh dims too)
    for si, size in enumerate(ADAPTIVE_SIZES):
        if world > 1 and (WORLDS[si % 3] == world or si % len(LAYOUTS[world]) != li):
            continue
        sizes = [(5 * q + 2, 9 * q + 1)[(si + world) % 2] if q > 1 else 6 for q in parts]
        out = _adaptive_out(size, tuple(sizes))
        if multi and 4 * math.prod(out) > math.prod(map(_smallest, sizes, parts)):
            out = (1,) * (n - 1) + (2,)  # tiles: small outputs only
        x = seeded(7 * si + li, batch, 3, *sizes, dtype=torch.float64)
        want = _adaptive_placements(pl, dmesh, ndim, out)
        # a replicated output is the all-reduce of every rank's part, by design: not a gather
        replicated = {(batch, 3, *out)} if want != list(pl) else frozenset()
        for j, kind in enumerate(("avg", "max")):
            grad = GRAD_KINDS[(si + j + world) % 3]
            idx = kind == "max" and n < 3  # volumes refuse return_indices
            fn = lambda t, f=_ADAPTIVE[kind, n], o=out, i=idx: f(t, o, i) if i else f(t, o)  # noqa: E731
            label = f"{name} adaptive_{kind}_pool{n}d({out}) {tuple(x.shape)} grad={grad}"
            check = dict(grad=grad, out_placements=want, param_shapes=replicated)
            check_fn(fn, x, dmesh, pl, label, failures, **check)


def _tie_cases(world: int, li: int, name: str, spec, dmesh, failures: list[str]) -> None:
    shape, names, ndim, pl = spec
    n, batch = ndim - 2, 1
    parts = _parts(dmesh, pl, ndim)
    sizes = [3 * q + 2 + j if q > 1 else 4 + j for j, q in enumerate(parts)]
    x = tied(li + 10 * world, (batch, 2, *sizes), pl, dmesh)
    idx = n < 3  # volumes refuse return_indices: the gradient shows where ties went
    small = (1,) * (n - 1) + (2,)
    ops = {
        f"max_pool{n}d 3/1/1": lambda t: getattr(F, f"max_pool{n}d")(t, 3, 1, 1, 1, False, idx),
        f"max_pool{n}d 2/2 ceil": lambda t: getattr(F, f"max_pool{n}d")(t, 2, 2, 0, 1, True, idx),
        f"adaptive_max_pool{n}d 1": lambda t: _ADAPTIVE["max", n](t, 1, idx),
        f"adaptive_max_pool{n}d {small}": lambda t: _ADAPTIVE["max", n](t, small, idx),
    }
    for j, (label, fn) in enumerate(ops.items()):
        if (j + li + world) % 2 == 0:  # half of them per layout: across the worlds, all
            check_fn(fn, x, dmesh, pl, f"ties {name} {label} {tuple(x.shape)}", failures)


def pool_grid(world: int) -> list[str]:
    failures: list[str] = []
    for li, (name, spec) in enumerate(LAYOUTS[world].items()):
        dmesh = mesh(spec[0], spec[1])
        _window_cases(world, li, name, spec, dmesh, failures)
        _adaptive_cases(world, li, name, spec, dmesh, failures)
        if world > 1 and "dp" not in spec[1]:  # ties do not depend on the batch split
            _tie_cases(world, li, name, spec, dmesh, failures)
    return failures


@pytest.mark.parametrize("world", [1, *WORLDS])
def test_pool_grid_matches_single_device(dist_pool, world):
    failures = dist_pool.run(world, pool_grid, world)[0]
    assert not failures, "\n".join(failures)


def test_grid_covers_every_config_on_two_worlds():
    """Each window config runs at two worlds, once at each, and both kinds of layout (one
    sharded axis, several) get configs of every kind; each adaptive size runs at two worlds."""
    cfgs = window_configs()
    kinds = {(k, c["ceil_mode"], c.get("count_include_pad")) for k, c in cfgs}
    for ceil in (False, True):  # max, avg counting padding or not, with and without ceil
        assert {("max", ceil, None), ("avg", ceil, True), ("avg", ceil, False)} <= kinds
    ran: dict[str, set] = {"one": set(), "multi": set()}
    for ci, (kind, cfg) in enumerate(cfgs):
        runs = [(w, n) for w in WORLDS for n in LAYOUTS[w] if runs_window(w, n, ci)]
        assert sorted(w for w, _ in runs) == sorted(set(w for w, _ in runs)), runs
        assert len(runs) == 2, (cfg, runs)
        for w, n in runs:
            multi = sum(p.dim >= 2 for p in LAYOUTS[w][n][3]) > 1
            ran["multi" if multi else "one"].add((kind, cfg["ceil_mode"]))
    assert ran["one"] == ran["multi"] == {(k, c) for k in ("max", "avg") for c in (False, True)}
    for si in range(len(ADAPTIVE_SIZES)):
        assert sum(WORLDS[si % 3] != w for w in WORLDS) == 2
    assert {name.split()[0] for w in WORLDS for name in LAYOUTS[w]} >= {
        "strips", "rows", "tiles", "volume", "blocks", "dp"
    }  # fmt: skip
