"""Window saving by reference on volumes and tiles (issue 12 item 4 target, issue 11 item 1
on tiles): a 3-D conv / max pool / transposed conv on a volume sharded along one dim, and
the tile ops (images over H x W, volumes over two or three dims), keep the local block by
reference plus thin halo slabs for the backward instead of a window copy.

Checked: the window rebuilt from that recipe equals the window the forward used (values
and layout, every exchange step, edges and corners, zero and -inf padding); ``unet3d``'s
live activations after the forward drop (exact bytes, ``LiveBytes``) and its logits,
input gradient and every parameter gradient still equal one device's in fp64, with the
option on and off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._sharding import spatial_layout
from spconv_train.parallel._step_meters import LiveBytes
from spconv_train.parallel._tiles import tile_window
from spconv_train.parallel._window import _WindowRecipe
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

#: (mesh shape, mesh dim names, placements, global shape) of the layouts checked at 4 ranks
LAYOUTS = {
    "volume D": ((4,), ("sp",), [Shard(2)], (2, 3, 15, 5, 6)),
    "volume W": ((4,), ("sp",), [Shard(4)], (2, 3, 5, 6, 15)),
    "image tiles": ((2, 2), ("sp_h", "sp_w"), [Shard(2), Shard(3)], (2, 3, 9, 11)),
    "volume tiles hw": ((2, 2), ("sp_h", "sp_w"), [Shard(3), Shard(4)], (2, 3, 5, 9, 11)),
    "volume tiles dhw": (
        (1, 2, 2),
        ("sp_d", "sp_h", "sp_w"),
        [Shard(2), Shard(3), Shard(4)],
        (1, 2, 7, 9, 11),
    ),
}

#: window geometries per spatial dim (kernel, stride, dilation, pad before, pad after)
GEOMS = [(3, 1, 1, 1, 1), (4, 2, 1, 2, 1), (3, 1, 2, 2, 2), (2, 2, 1, 0, 0)]


def recipe_rebuilds_window(key: str) -> list[str]:
    """Every rank: the window rebuilt from (local by reference + halo copies) is the window."""
    shape, names, pl, size = LAYOUTS[key]
    dmesh = mesh(shape, names)
    x = distribute_tensor(seeded(3, *size, dtype=torch.float64), dmesh, pl)
    failures = []
    for geom in GEOMS:
        for value in (0.0, float("-inf")):
            label = f"{key} geometry {geom} value {value}"
            _, layout = spatial_layout(x, "test", ndim=x.ndim, tiles=True)
            local = x.to_local()
            geoms = {d: geom for d in range(2, x.ndim)}
            args = (tuple(x.shape), layout, "test", geoms, "zeros", value)
            tw = tile_window(local, *args, pad_local=False)  # as the conv (zero padding)
            if tw.recipe is None:
                failures.append(f"{label}: window not saved by reference")
                continue
            window, (_, steps, _) = tw.local, tw.recipe
            rebuilt = _WindowRecipe(window, local, steps, value, None).rebuild()
            if not torch.equal(rebuilt, window):
                failures.append(f"{label}: rebuilt window differs")
            if rebuilt.stride() != window.stride():
                failures.append(f"{label}: strides {rebuilt.stride()} != {window.stride()}")
    return failures


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_window_recipe_rebuilds_the_window(dist_pool, key):
    for rank, failures in enumerate(dist_pool.run(4, recipe_rebuilds_window, key)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def unet3d_memory(world: int, names, pl, size) -> dict:
    """``unet3d`` (depth 2, BatchNorm, transposed up-sampling) with window saving by
    reference on and off (and on under activation checkpointing): live bytes after the
    forward per rank, and every mismatch against one device (fp64: logits, loss, input
    gradient, parameter gradients)."""
    from spconv_train.train import cross_entropy
    from spconv_train.train.optim import enable_activation_checkpointing

    shape = (world,) if len(names) == 1 else tuple(2 if n != "sp_d" else 1 for n in names)
    dmesh = mesh(shape, names)
    torch.manual_seed(0)
    ref = create_model("unet3d", num_classes=3, in_channels=1, depth=2, base_width=4).double()
    x = seeded(1, 1, 1, *size, dtype=torch.float64)
    target = torch.randint(0, 3, (1, *size), generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_()
    with LiveBytes() as meter:
        out_r = ref(xr)
    plain = meter.live()
    loss_r = F.cross_entropy(out_r, target)
    loss_r.backward()
    res: dict = {"plain": plain, "failures": []}
    # with activation checkpointing too: the recipe chains to its saved-tensor hooks
    for by_ref, ck in ((True, None), (False, None), (True, ("blocks", 1))):
        par = parallelize(copy.deepcopy(ref), dmesh, save_windows_by_reference=by_ref)
        par.zero_grad(set_to_none=True)
        if ck:
            enable_activation_checkpointing(par, *ck)
        xs = distribute_tensor(x, dmesh, pl).requires_grad_()
        with LiveBytes() as meter:
            out_p = par(xs)
        res[ck or by_ref] = meter.live()
        loss_p = cross_entropy(out_p, target)
        loss_p.backward()
        label, failures = f"by_ref={by_ref} checkpointing={ck} {names} {pl}", res["failures"]
        check_close(f"{label} logits", out_p, out_r, 1e-10, failures)
        check_close(f"{label} loss", loss_p, loss_r, 1e-10, failures)
        check_close(f"{label} input grad", xs.grad, xr.grad, 1e-9, failures)
        for (n, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            check_close(f"{label} {n}.grad", p.grad, q.grad, 1e-8, failures, 1e-9)
    return res


@pytest.mark.parametrize(
    "world,names,pl,size,bound,gain",
    [
        (2, ("sp",), [Shard(2)], (16, 8, 8), 1.1, 0.8),  # over D
        # over W the convs take the overlapped halo conv (no window, option on or off):
        # only the pools and transposed convs gain (measured 0.91x)
        (2, ("sp",), [Shard(4)], (8, 8, 16), 1.1, 0.95),
        (4, ("sp_h", "sp_w"), [Shard(3), Shard(4)], (8, 12, 12), 1.25, 0.8),  # H x W tiles
    ],
)
def test_unet3d_saves_windows_by_reference(dist_pool, world, names, pl, size, bound, gain):
    for rank, res in enumerate(dist_pool.run(world, unet3d_memory, world, names, pl, size)):
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"][:20])
        # a window copy per conv / pool / transposed conv is no longer kept (measured: 0.71x
        # over D at 2 ranks, 0.68x on 2 x 2 tiles, of what is kept without it)
        assert res[True] <= gain * res[False], res
        # what is left above one device's share is the thin halo copies (measured: 1.08x
        # at 2 ranks, 1.20x on 2 x 2 tiles of 6 x 6 pixels, 3 x 3 after pooling; 1.53x and
        # 1.76x without saving by reference)
        assert res[True] <= bound * res["plain"] / world, (rank, res)


def strip_conv_memory(world: int) -> dict:
    """Live bytes after two 3x3 convs on width strips that build a window (the split conv
    off), with window saving by reference on and off."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    x = distribute_tensor(seeded(4, 1, 4, 16, 64), mesh(world), [Shard(3)])
    live = {}
    for by_ref in (True, False):
        opts = dict(save_windows_by_reference=by_ref, split_halo_conv=False)
        par = parallelize(copy.deepcopy(model), mesh(world), **opts)
        with LiveBytes() as meter:
            y = par(x)
        live[by_ref] = meter.live()
        del y
    return live


def test_strip_windows_are_freed(dist_pool):
    """The saved-tensor pack hook lives as long as the saved tensor: it must not hold the
    window (it did: the option then saved nothing, 42.5 kB on vs 42.0 kB off)."""
    for live in dist_pool.run(2, strip_conv_memory, 2):
        assert live[True] <= 0.7 * live[False], live
