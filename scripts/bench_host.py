"""Benchmark: host work per training step of a parallelized model (docs/benchmarks.md, "Host
work per step").

Per model and world size (``0``: the plain model, no ``parallelize``, one process), one fp32
training step (forward + cross-entropy + backward) on a ``1 x 3 x H x W`` image, after two
warm-up steps: the CPU seconds per step (``time.process_time`` of each rank's process, max
over ranks; the minimum over ``--rounds`` rounds of 2 steps), and on rank 0 the Python
function calls of one step (``cProfile``) and its aten ops (a ``TorchDispatchMode``).
``--profile N`` prints rank 0's ``N`` top functions by own time and by calls instead;
``--compile`` compiles the model first (``training.compile``'s default mode).

Usage: ``python scripts/bench_host.py [--models unet smp_unet --worlds 0 1 2 --height 32
--width 64 --rounds 9 --markdown]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from bench_compile import add_model_args, build, print_setup  # noqa: E402
from bench_conv import add_run_args, init_worker, print_table, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402


class _AtenCount(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _worker(rank: int, procs: int, port: int, name: str, world: int, args, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy

    mesh = init_worker(rank, procs, port, args)
    torch.manual_seed(0)
    model = build(name, args)
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g)
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g)
    x, tgt = img, target
    if world:
        model = parallelize(model, mesh)
        x = distribute_tensor(img, mesh, [Shard(3)])
        tgt = distribute_tensor(target, mesh, [Shard(2)]).to_local()
    if args.compile:  # ``training.compile: true`` in its default mode (a graph break around it)
        model = torch.compile(model, dynamic=False)

    def step() -> None:
        cross_entropy(model(x), tgt).backward()

    step(), step()
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    with _AtenCount() as aten:
        step()
    cpu = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.process_time()
        step(), step()
        dt = torch.tensor([(time.process_time() - t0) / 2], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        cpu.append(dt.item())
    top = ""
    if args.profile and rank == 0:
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("ncalls").print_stats(args.profile)
        top = out.getvalue()
    queue.put(
        {"rank": rank, "cpu": min(cpu), "calls": stats.total_calls, "aten": aten.ops, "top": top}
    )
    shutdown()


def _options() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(ap, ["unet", "smp_unet"], [0, 1, 2], (32, 64), 9, worlds_help="0: plain model")
    add_run_args(ap, device=False)
    ap.add_argument("--profile", type=int, default=0, help="print rank 0's top N functions")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the model (default mode) first"
    )
    return ap


def _row(name: str, world: int, args) -> tuple:
    """``(model, world, CPU s, Python calls, aten ops)`` of rank 0 (its profile printed)."""
    results = spawn_ranks(_worker, max(world, 1), name, world, args)
    r0 = next(r for r in results if r["rank"] == 0)
    print(r0["top"], end="")
    label = (f"{world} rank(s)" if world else "plain") + (", compiled" if args.compile else "")
    return (name, label, f"{r0['cpu']:.4f}", r0["calls"], r0["aten"])


def main(argv: list[str] | None = None) -> None:
    args = _options().parse_args(argv)
    args.device = "cpu"
    print_setup(args)
    rows = [_row(name, world, args) for name in args.models for world in args.worlds]
    print_table(("model", "world", "CPU s", "Python calls", "aten ops"), rows, args.markdown)


if __name__ == "__main__":
    main()
