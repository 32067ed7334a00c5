"""Benchmark: channels-last against NCHW for one training step, plain and parallelized.

Per model and world size, each rank holds two copies of the same model (same weights),
one NCHW and one with channels-last weights (``training.channels_last: on``,
``train/model_setup.to_channels_last``) fed a channels-last image (each rank's part
channels-last); their steps are
interleaved, so a load change hits both alike. Reported: the median CPU seconds per step
(``time.process_time`` of each rank's process, all its threads; max over ranks), which
other processes' load barely moves on a shared machine, and the channels-last / NCHW
ratio. World ``0`` is the model without ``parallelize`` (one process): the layout gain the
parallelized rows are compared with.
Models: the built-in U-Net (``--depth``, ``--base-width``) and ``smp_unet`` (smp Unet on
resnet18, random init), as in ``scripts/bench_compile.py``.

Usage: ``python scripts/bench_channels_last.py [--models unet smp_unet --worlds 0 1 2
--height 64 --width 256 --rounds 15 --markdown]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_compile import MODELS, add_model_args, build, print_setup  # noqa: E402
from bench_conv import add_run_args, init_worker, print_table, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402


def _worker(rank: int, ranks: int, port: int, world: int, name: str, args, queue) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy
    from spconv_train.train.model_setup import to_channels_last

    mesh = init_worker(rank, ranks, port, args)
    torch.manual_seed(0)
    nchw = build(name, args)
    if world:
        nchw = parallelize(nchw, mesh)
    cl = copy.deepcopy(nchw)
    to_channels_last(cl, "on")
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g)
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g)
    inputs = {}
    for key, fmt in (("nchw", torch.contiguous_format), ("cl", torch.channels_last)):
        if world:  # each rank's part in the layout (as a channels-last data pipeline gives it)
            local = (
                distribute_tensor(img, mesh, [Shard(3)]).to_local().contiguous(memory_format=fmt)
            )
            inputs[key] = DTensor.from_local(
                local, mesh, [Shard(3)], shape=img.shape, stride=img.stride()
            )
        else:
            inputs[key] = img.contiguous(memory_format=fmt)
    tgt = distribute_tensor(target, mesh, [Shard(2)]).to_local() if world else target

    def cpu_seconds(model, x) -> float:
        """CPU seconds of one step, max over ranks."""
        dist.barrier()
        cpu0 = time.process_time()
        cross_entropy(model(x), tgt).backward()
        cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
        return cpu.item()

    models = {"nchw": nchw, "cl": cl}
    times: dict[str, list[float]] = {"nchw": [], "cl": []}
    for key, model in models.items():  # warm-up (allocator, mkldnn primitives)
        cpu_seconds(model, inputs[key])
    for _ in range(args.rounds):
        for key, model in models.items():
            times[key].append(cpu_seconds(model, inputs[key]))
    queue.put({k: statistics.median(v) for k, v in times.items()})
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    models, worlds = ["unet", "smp_unet"], [0, 1, 2]
    add_model_args(ap, models, worlds, (64, 256), 15, MODELS[:3], worlds_help="0: plain model")
    add_run_args(ap, device=False)
    args = ap.parse_args(argv)
    args.device = "cpu"
    print_setup(args)
    rows = []
    for name in args.models:
        for world in args.worlds:
            r = spawn_ranks(_worker, max(world, 1), world, name, args, timeout=3600)[0]
            ranks = "plain" if world == 0 else str(world)
            ratio = f"{r['cl'] / r['nchw']:.2f}x"
            load = f"{os.getloadavg()[0]:.1f}"
            rows.append((name, ranks, f"{r['nchw']:.3f}", f"{r['cl']:.3f}", ratio, load))
            print("  " + " | ".join(rows[-1]), file=sys.stderr)
    header = ("model", "ranks", "NCHW CPU s/step", "channels-last CPU s/step", "CL/NCHW", "load")
    print_table(header, rows, args.markdown)


if __name__ == "__main__":
    main()
