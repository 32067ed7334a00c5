"""Benchmark: per-rank memory of one U-Net training step, 1 vs 2 vs 4 spatial ranks.

Activation memory is measured exactly, independent of the allocator: the bytes of every
distinct tensor storage that autograd saves for the backward (``saved_tensors_hooks``),
which is what spatial parallelism divides by N. One rank runs the plain, unparallelized
model (the true single-device baseline). The sharded windows of convolutions and max
pools are saved as a reference to the strip plus their halo columns
(``parallel._window.saving_steps_by_reference``); those few halo columns per layer are not
in this count. Also reported: peak memory of the step
(CUDA allocator peak, or the growth of the process's peak RSS on CPU), time per step, and
the widest image that fits a per-rank activation budget (extrapolated linearly in width:
activations of a fully convolutional net grow linearly with the width at fixed height).

Usage: ``python scripts/bench_memory.py [--height 512 --width 2048 --worlds 1 2 4
--budget-gib 16]`` (``make bench-memory``); ``--markdown`` for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import (  # noqa: E402
    _current_mib,
    _peak_mib,
    add_run_args,
    init_worker,
    machine,
    print_table,
    spawn_ranks,
)

from spconv_train.distributed import shutdown  # noqa: E402


class SavedBytes:
    """Sum of the distinct storages autograd saves for backward while active."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            st = local.untyped_storage()
            self.seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @property
    def mib(self) -> float:
        return sum(self.seen.values()) / 2**20


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy

    dev = args.device
    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    model = create_model(
        "unet", num_classes=4, depth=args.depth, base_width=args.base_width, norm="batch"
    ).to(dev)
    if world > 1:  # world 1 is the plain single-device model: the true baseline
        model = parallelize(model, mesh)
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g).to(dev)
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(dev)
    if world > 1:
        x = distribute_tensor(img, mesh, [Shard(3)], src_data_rank=None)
        tgt = distribute_tensor(target, mesh, [Shard(2)], src_data_rank=None).to_local()
    else:
        x, tgt = img, target
    del img, target
    saved = SavedBytes()
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _current_mib(dev)
    dist.barrier()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = cross_entropy(model(x), tgt)
    loss.backward()
    dist.barrier()
    sec = time.perf_counter() - t0
    queue.put((rank, saved.mib, _peak_mib(dev) - base, sec))
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def run_world(world: int, args) -> tuple[float, float, float]:
    """(max activation MiB, max peak MiB, seconds) over the ranks of one run."""
    res = spawn_ranks(_worker, world, args)
    return max(r[1] for r in res), max(r[2] for r in res), max(r[3] for r in res)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--budget-gib", type=float, default=16.0, help="per-rank activation budget")
    add_run_args(ap)
    args = ap.parse_args(argv)
    print(
        f"U-Net depth {args.depth} base width {args.base_width} (BatchNorm), one training step "
        f"on 1x3x{args.height}x{args.width}, {args.device}, {args.threads} thread(s)/process; "
        + machine(),
        file=sys.stderr,
    )
    rows, single = [], None
    for world in args.worlds:
        act, peak, sec = run_world(world, args)
        single = act if world == 1 else single
        ideal = f"{act / (single / world):.2f}x" if single else "-"
        cols = args.budget_gib * 1024 / act * args.width / world  # width per rank that fits
        widest = int(cols * world)
        rows.append((world, act, ideal, peak, sec, widest))
        print(f"  {world} rank(s): {act:.0f} MiB saved activations, {sec:.1f} s", file=sys.stderr)
    peak_label = "peak MiB/rank" if args.device == "cuda" else "peak RSS growth MiB/rank"
    header = (
        "ranks",
        "activations MiB/rank",
        "vs single/N",
        peak_label,
        "s/step",
        f"widest W at {args.budget_gib:g} GiB/rank (H={args.height})",
    )
    cells = [
        (w, f"{act:.0f}", ideal, f"{peak:.0f}", f"{sec:.1f}", f"{widest:,}")
        for w, act, ideal, peak, sec, widest in rows
    ]
    print_table(header, cells, args.markdown, width=20)


if __name__ == "__main__":
    main()
