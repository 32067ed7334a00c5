"""Split halo convolution (interior from the strip in place, thin edge windows, overlapped
exchange), the 1-rank plain path, and the halo timer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import spconv_train.parallel._conv as conv_module
from spconv_train.parallel import parallelize
from spconv_train.parallel._conv import conv_padding
from spconv_train.parallel._halo_conv import plan_split
from spconv_train.parallel._runtime import SpatialStats
from spconv_train.parallel._window import plan_window
from tests.dist_harness import device, mesh
from tests.op_check import check_module
from tests.reference import compare_module, seeded

# (conv kwargs, input width at 2/3 ranks): strips wide and narrow, stride, dilation, even
# kernels, groups, 1x1; the narrow ones have no interior column and take the window path.
CASES = [
    (dict(kernel_size=3, padding=1), 20),
    (dict(kernel_size=3, padding=1, stride=2), 23),
    (dict(kernel_size=3, padding=2, dilation=2), 25),
    (dict(kernel_size=4, padding=(1, 2)), 21),  # even kernel
    (dict(kernel_size=(3, 4), padding=(1, 1), stride=(1, 2)), 22),  # even, strided
    (dict(kernel_size=5, padding=2, groups=2, out_channels=6), 19),
    (dict(kernel_size=1), 7),
    (dict(kernel_size=7, padding=3), 21),  # strips of 7-11 columns: a thin interior
    (dict(kernel_size=5, padding=2, dilation=2), 15),  # reach 8 > strip: window path
    (dict(kernel_size=3, padding=0), 18),  # no padding: edges read halos only
    (dict(kernel_size=3, padding=1, stride=(2, 1)), 20),  # height stride, whole strip
    (dict(kernel_size=(5, 3), padding=(4, 2), dilation=(2, 2), groups=4), 19),  # depthwise
    # large dilations (ASPP-like): halo runs of 6 columns; two taps per halo for the 5-wide
    (dict(kernel_size=3, padding=6, dilation=6), 42),
    (dict(kernel_size=5, padding=6, dilation=3), 45),
    # strips 4, 4, 2: the last rank has no interior, so all ranks take the window path
    # (a mix of paths deadlocked in the backward: halo p2p vs weight all-reduce order)
    (dict(kernel_size=3, padding=1), 10),
]


def _conv(cfg: dict, seed: int) -> nn.Conv2d:
    cfg = dict(cfg)
    torch.manual_seed(seed)
    return nn.Conv2d(4, cfg.pop("out_channels", 4), **cfg)


def split_grid(world: int) -> tuple[list[str], list[str | None]]:
    """Every case against the single-device conv; also which path ran: "whole" (the whole
    strip convolved, halo edges overwritten), "split" (interior + edges) or None (window)."""
    dmesh = mesh(world)
    failures: list[str] = []
    used = []
    for i, (cfg, width) in enumerate(CASES):
        conv = _conv(cfg, i)
        x = seeded(300 + i, 2, 4, 5, width)
        compare_module(conv, x, dmesh, [Shard(3)], "shard", f"{cfg} W={width}", failures)
        (pl, pr) = conv_padding(conv)[-1]
        k, s, d = conv.kernel_size[1], conv.stride[1], conv.dilation[1]
        wp = plan_window("t", width, world, k, s, d, pl, pr)
        plan = plan_split(wp, dist_rank(), k, s, d, pl)
        used.append(None if plan is None else "whole" if plan.whole_strip else "split")
    return failures, used


def dist_rank() -> int:
    return torch.distributed.get_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_split_conv_matches_single_device(dist_pool, world):
    results = dist_pool.run(world, split_grid, world)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures)
    per_rank = [u for _, u in results]
    assert all(u == per_rank[0] for u in per_rank), per_rank  # one path on every rank
    used = per_rank[0]
    # every path is exercised: "same" convs take the whole strip, strided / asymmetric /
    # unpadded ones the interior + edges split, strips narrower than the reach the window
    whole, split = "whole", "split"
    paths = [whole, split, whole, split, split, whole, whole, whole, None, split, whole, whole]
    paths += [whole, whole]
    assert used == [*paths, None if world == 3 else whole], used


#: world 4 layouts: (mesh shape, names, tensor rank, placements, the fast path applies)
FAST_LAYOUTS = {
    "dp strips": ((2, 2), ("dp", "sp"), 4, [Shard(0), Shard(3)], True),
    "tiles 2x2": ((2, 2), ("sp_h", "sp_w"), 4, [Shard(2), Shard(3)], True),
    "volume W": ((4,), ("sp",), 5, [Shard(4)], True),
    "blocks DHW": ((1, 2, 2), ("sp_d", "sp_h", "sp_w"), 5, [Shard(2), Shard(3), Shard(4)], True),
    "signal": ((4,), ("sp",), 3, [Shard(2)], True),
    "blocks DH": ((2, 2), ("sp_d", "sp_h"), 5, [Shard(2), Shard(3)], False),
    "volume D": ((4,), ("sp",), 5, [Shard(2)], False),
}


def fast_path_layouts(world: int) -> tuple[list[str], dict[str, int]]:
    """A "same" and a strided conv on every layout: the overlapped halo conv runs wherever
    the last dim is sharded (the other sharded dims windowed first), else the window."""
    failures: list[str] = []
    calls: dict[str, int] = {}
    original = conv_module.halo_conv

    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return original(*args, **kwargs)

    conv_module.halo_conv = counted
    try:
        for key, (shape, names, ndim, pl, _) in FAST_LAYOUTS.items():
            dmesh = mesh(shape, names)
            for i, cfg in enumerate(
                (dict(padding=1), dict(stride=2, padding=(1, 0, 2)[-ndim + 2 :]))
            ):
                torch.manual_seed(i)
                conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[ndim - 3](4, 3, 3, **cfg).double()
                x = seeded(i, 2, 4, *[20] * (ndim - 2), dtype=torch.float64)
                check_module(conv, x, dmesh, pl, f"{key} {cfg}", failures)
    finally:
        conv_module.halo_conv = original
    return failures, calls


def test_fast_path_wherever_the_last_dim_is_sharded(dist_pool):
    for failures, calls in dist_pool.run(4, fast_path_layouts, 4):
        assert not failures, "\n".join(failures)
        want = {k: 2 for k, (*_, fast) in FAST_LAYOUTS.items() if fast}
        assert calls == want, calls


def conv_flops(world: int, dilation: int) -> tuple[int, int]:
    """FLOPs (forward + backward) of the rank's sharded "same" conv, and of the plain conv
    of its strip alone."""
    from torch.utils.flop_counter import FlopCounterMode

    dmesh = mesh(world)
    conv = nn.Conv2d(16, 16, 3, padding=dilation, dilation=dilation)
    model = parallelize(nn.Sequential(conv), dmesh)
    x = distribute_tensor(seeded(5, 2, 16, 6, 30 * world), dmesh, [Shard(3)]).requires_grad_()
    counted = []
    for run in (lambda: model(x), lambda: conv(x.to_local().detach().requires_grad_())):
        with FlopCounterMode(display=False) as flops:
            run().sum().backward()
        counted.append(flops.get_total_flops())
    return counted[0], counted[1]


def test_halo_correction_costs_what_the_halo_reads(dist_pool):
    """The halo's share of the edge columns costs one column's conv per halo column and
    tap it meets: at dilation 8 on strips of 30, the middle rank's two halos of 8 columns
    add 2*8/(30*3) ~ 18 % to the strip's conv. (Folding the halo columns into channels cost
    ~ 140 %: a weight edge*halo times the kernel's; 1.8 GB per edge in DeepLabV3's ASPP.)"""
    for sharded, plain in dist_pool.run(3, conv_flops, 3, 8):
        assert plain < sharded <= 1.2 * plain, (sharded, plain)


def _saved_bytes(fn) -> tuple[object, list[int]]:
    """Run ``fn`` recording the numel of every tensor autograd saves."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


def saved_sizes(world: int, split: bool) -> tuple[list[int], int, float, int]:
    """Saved-tensor sizes of a 2-rank conv, the strip size, and the halo stats."""
    dmesh = mesh(world)
    conv = _conv(dict(kernel_size=3, padding=1), 0)
    model = parallelize(
        nn.Sequential(conv), dmesh, split_halo_conv=split, save_windows_by_reference=False
    )
    x = distribute_tensor(seeded(1, 1, 4, 6, 32), dmesh, [Shard(3)]).requires_grad_()
    y, sizes = _saved_bytes(lambda: model(x))
    y.sum().backward()
    stats = model.spatial_runtime.stats
    return sizes, x.to_local().numel(), stats.halo_seconds, stats.halo_bytes


def test_split_conv_saves_no_window_copy(dist_pool):
    """The split conv saves the strip (a reference) and thin halos, never a padded window:
    no saved activation is larger than the strip. The window path saves a strip+halo
    buffer (the old behaviour without saving by reference)."""
    for split in (True, False):
        for sizes, strip, seconds, nbytes in dist_pool.run(2, saved_sizes, 2, split):
            weight = 4 * 4 * 9
            acts = [n for n in sizes if n != weight]
            if split:
                assert max(acts) == strip, (acts, strip)
                assert sum(n for n in acts if n != strip) == 4 * 6  # one halo column
            else:
                assert max(acts) > strip, (acts, strip)
            # one column of 4x6 floats each way, forward and backward
            assert nbytes == 2 * 4 * 6 * 4 and seconds > 0


def one_rank(world: int) -> tuple[list[str], list[int], list[int]]:
    """At one rank the layer runs the plain conv: same result, same saved tensors."""
    dmesh = mesh(world)
    failures: list[str] = []
    conv = _conv(dict(kernel_size=3, padding=1), 3).to(device())
    x = seeded(4, 1, 4, 6, 10).to(device())
    compare_module(conv, x, dmesh, [Shard(3)], "shard", "1 rank", failures)
    model = parallelize(nn.Sequential(_conv(dict(kernel_size=3, padding=1), 3)), dmesh)
    model = model.to(device())
    xs = distribute_tensor(x.clone(), dmesh, [Shard(3)]).requires_grad_()
    _, sizes = _saved_bytes(lambda: model(xs))
    _, plain = _saved_bytes(lambda: conv(x.clone().requires_grad_()))
    return failures, sizes, plain


def test_one_rank_runs_the_plain_conv(dist_pool):
    failures, sizes, plain = dist_pool.run(1, one_rank, 1)[0]
    assert not failures, failures
    assert sorted(sizes) == sorted(plain), (sizes, plain)  # no padded copy saved


class _FakeEvent:
    def __init__(self, ms: float):
        self.ms, self.synced = ms, False

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.ms - self.ms


def test_halo_seconds_settles_cuda_events():
    """CUDA exchanges are timed with event pairs, settled (in ms) when the stat is read."""
    stats = SpatialStats()
    stats.halo_seconds += 0.5  # a host-timed exchange
    end = _FakeEvent(30.0)
    stats._pending += [(_FakeEvent(10.0), _FakeEvent(14.0)), (_FakeEvent(20.0), end)]
    snap = stats.snapshot()
    assert end.synced and stats._pending == []
    assert snap.halo_seconds == pytest.approx(0.5 + 0.014)
    stats.reset()
    assert stats.halo_seconds == 0.0
