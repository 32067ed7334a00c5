"""Transposed conv, resize and the norms on every layout: their errors' labels are built once
per module (not on every forward), and the layout's sharded axes cover strips too."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from spconv_train.parallel import parallelize
from spconv_train.parallel._sharding import SpatialLayout
from spconv_train.parallel._tiles import layout_axes
from tests.dist_harness import mesh
from tests.op_check import TOL, check_fn
from tests.reference import check_close, seeded


def _count_extra_repr(model: nn.Module, counts: dict) -> None:
    """Make every submodule's ``extra_repr`` count its calls in ``counts`` (by path)."""
    for path, m in model.named_modules():
        if not path:
            continue
        original = m.extra_repr

        def counted(path=path, original=original):
            counts[path] = counts.get(path, 0) + 1
            return original()

        m.extra_repr = counted


def labels_once(world: int) -> list[str]:
    """Three forwards and backwards of a model with every layer kind of this family on
    strips (2-D) and on blocks (3-D): values and gradients match one device, and no layer
    formats its ``extra_repr`` more than once."""
    failures: list[str] = []
    models = {
        (4, (Shard(3),)): nn.Sequential(
            nn.ConvTranspose2d(2, 3, 3, 2, 1, 1),
            nn.Tanh(),  # between the layers: no bias gradient cancels to rounding noise
            nn.BatchNorm2d(3),
            nn.Tanh(),
            nn.Upsample(scale_factor=1.5, mode="bilinear"),
            nn.GroupNorm(1, 3),
            nn.Tanh(),
            nn.InstanceNorm2d(3, affine=True),
        ).double(),
        (5, (Shard(2), Shard(4))): nn.Sequential(
            nn.ConvTranspose3d(2, 2, 2, 2),
            nn.Tanh(),
            nn.BatchNorm3d(2),
            nn.Tanh(),
            nn.Upsample(scale_factor=2, mode="trilinear"),
            nn.InstanceNorm3d(2, track_running_stats=True),
        ).double(),
    }
    for (ndim, placements), model in models.items():
        dmesh = mesh((1, world), ("sp_d", "sp_w")) if ndim == 5 else mesh(world)
        shape = (2, 2, 3, 4, 2 * world + 1) if ndim == 5 else (2, 2, 5, 3 * world + 1)
        counts: dict = {}
        ref, par = model, parallelize(copy.deepcopy(model), dmesh)
        _count_extra_repr(par, counts)

        def run(t, ref=ref, par=par):
            return (par if isinstance(t, DTensor) else ref)(t)

        for step in range(3):
            label = f"{ndim - 2}-D step {step}"
            x = seeded(step, *shape, dtype=torch.float64)
            check_fn(run, x, dmesh, list(placements), label, failures)
            for (name, p), pr in zip(par.named_parameters(), ref.parameters(), strict=True):
                check_close(f"{label} {name}.grad", p.grad, pr.grad, TOL, failures)
                p.grad = pr.grad = None
        many = {p: n for p, n in counts.items() if n > 1}
        if many:
            failures.append(f"{ndim - 2}-D: extra_repr formatted per forward: {many}")
    return failures


def test_labels_built_once_per_module(dist_pool):
    failures = dist_pool.run(2, labels_once, 2)[0]
    assert not failures, "\n".join(failures)


def test_layout_axes_cover_strips_tiles_and_replicated():
    strip = SpatialLayout(None, (), 1, dim=4)
    assert layout_axes(strip) == ((4, 1),)
    assert layout_axes(SpatialLayout(None, (), 0, width_sharded=False)) == ()
    tiles = SpatialLayout(None, (), 2, dim=3, axes=((2, 1), (3, 2)))
    assert layout_axes(tiles) == ((2, 1), (3, 2))
