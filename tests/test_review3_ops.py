"""Spatial ops against one device in cases the grids leave out (issue 22, third review).

- ``F.interpolate(mode="area")`` (run by the adaptive-average handler) on images split along
  H and on volumes split along D or H (2 and 3 ranks), with ``size`` / ``scale_factor`` as an
  int, a float, a tuple and a list, ``recompute_scale_factor`` on and off; the other modes
  with list arguments on the same layouts;
- the argument errors torch raises for ``F.interpolate`` (``ValueError``) raised with the
  same type on a sharded input;
- ``ConvTranspose3d`` with a rank whose window is empty along D or H (volumes, 2 ranks).

fp64: output, input and parameter gradients, no activation-sized collective
(``tests/op_check.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

F64 = torch.float64

#: F.interpolate keyword arguments of 2-D images (a volume's: one more entry per sequence)
RESIZES: list[dict] = [
    dict(size=4, mode="area"),
    dict(size=[5, 3], mode="area"),
    dict(size=(2, 4), mode="area"),
    dict(scale_factor=0.5, mode="area"),
    dict(scale_factor=[0.6, 0.5], mode="area"),
    dict(scale_factor=(1.5, 0.7), mode="area", recompute_scale_factor=False),
    dict(scale_factor=2, mode="area", recompute_scale_factor=True),
    dict(size=[9, 7], mode="nearest"),
    dict(scale_factor=[1.5, 2.0], mode="bilinear", align_corners=True),
    dict(scale_factor=[0.7, 1.3], mode="nearest-exact", recompute_scale_factor=True),
]

#: arguments F.interpolate refuses with a ValueError on one device
BAD_RESIZES: list[dict] = [
    dict(size=(3, 4), mode="area", align_corners=False),
    dict(size=[3, 4], mode="nearest", recompute_scale_factor=True),
    dict(size=[3], mode="nearest"),
    dict(scale_factor=[0.5, 0.5, 0.5], mode="area"),
    dict(size=(3, 4), scale_factor=2.0, mode="area"),
    dict(mode="area"),
]


def _volume_kwargs(kw: dict) -> dict:
    """``kw`` for a volume: every per-dim sequence one entry longer (its first repeated),
    bilinear trilinear."""
    kw = {k: type(v)((v[0], *v)) if isinstance(v, (list, tuple)) else v for k, v in kw.items()}
    return {**kw, "mode": "trilinear"} if kw["mode"] == "bilinear" else kw


def _layouts(world: int) -> list[tuple[str, torch.Tensor, object, list]]:
    """``(label, fp64 input, mesh, placements)``: an image split along H, a volume split
    along D and one split along H, sizes uneven over the ranks."""
    n = 3 * world + 1
    return [
        ("rows", seeded(1, 2, 2, n, 5, dtype=F64), mesh(world), [Shard(2)]),
        ("volume D", seeded(2, 1, 2, n, 4, 5, dtype=F64), mesh(world), [Shard(2)]),
        ("volume H", seeded(3, 1, 2, 4, n, 5, dtype=F64), mesh(world), [Shard(3)]),
    ]


def resize_forms(world: int) -> list[str]:
    """Every ``RESIZES`` case on every layout of ``_layouts``, and ``BAD_RESIZES`` refused
    with torch's exception type; returns the failures."""
    failures: list[str] = []
    for label, x, dmesh, pl in _layouts(world):
        volume = x.ndim == 5
        for kw in RESIZES:
            kw = _volume_kwargs(kw) if volume else kw
            fn = lambda t, kw=kw: F.interpolate(t, **kw)  # noqa: E731
            out = tuple(fn(x).shape)
            # an image's adaptive pool with a rank without output cells: all-reduced to
            # Replicate by design (_pool.adaptive_pool), as the pool grid allows
            n = out[pl[0].dim]
            empty = -(-n // world) * (world - 1) >= n  # DTensor's chunks leave a rank none
            replicated = {out} if kw["mode"] == "area" and not volume and empty else ()
            check_fn(fn, x, dmesh, pl, f"{label} interpolate({kw})", failures,
                     param_shapes=frozenset(replicated))  # fmt: skip
        xs = distribute_tensor(x, dmesh, pl)
        for kw in BAD_RESIZES:
            kw = _volume_kwargs(kw) if volume else kw
            raised = []
            for t, ctx in ((x, torch.no_grad()), (xs, SpatialMode())):
                try:
                    with ctx:
                        F.interpolate(t, **kw)
                    raised.append(None)
                except Exception as e:  # noqa: BLE001 - the type is what is compared
                    raised.append(type(e))
            if raised[0] is None or raised[1] is not raised[0]:
                got = f"torch {raised[0]}, sharded {raised[1]}"
                failures.append(f"{label} interpolate({kw}): {got}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_interpolate_area_and_list_forms_match_single_device(dist_pool, world):
    failures = dist_pool.run(world, resize_forms, world)[0]
    assert not failures, "\n".join(failures)


def convt_empty_volume_windows() -> list[str]:
    """``ConvTranspose3d`` (kernel 1 along the split dim, stride 4, padding 2) of a volume
    whose split dim has 2 planes over 2 ranks: no input plane reaches rank 0's output, rank
    1 has none; along D and along H, with bias, every gradient."""
    failures: list[str] = []
    for dim in (2, 3):
        geom = [(3, 1, 1)] * 3  # (kernel, stride, padding) per spatial dim
        geom[dim - 2] = (1, 4, 2)
        k, s, p = zip(*geom, strict=True)
        conv = nn.ConvTranspose3d(2, 3, k, s, p).double()
        shape = [1, 2, 3, 4, 5]
        shape[dim] = 2
        x = seeded(10 + dim, *shape, dtype=F64)
        check_module(conv, x, mesh(2), [Shard(dim)], f"ConvTranspose3d Shard({dim})", failures)
    return failures


def test_conv_transpose3d_empty_windows_match_single_device(dist_pool):
    failures = dist_pool.run(2, convt_empty_volume_windows)[0]
    assert not failures, "\n".join(failures)
