"""Benchmark: one sharded ``BatchNorm2d`` forward + backward on one rank, CPU ms per call.

Three columns, interleaved call by call in one process (so a load change hits all alike):
torch's own layer on the plain tensor, the parallelized layer on the composed path (the
fallback of ``spconv_train/parallel/_norm_stats.py`` for inputs the fused kernels refuse,
forced here), and the parallelized layer as it runs (torch's fused batch-norm kernels, the
per-rank moments from one kernel where ``_kernel_stats`` picks it). CPU time of the process
(``time.process_time``, one thread), median over the rounds.

Usage: ``python scripts/bench_norm.py [--rounds 15]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

CASES = [
    (dtype, cl, shape)
    for dtype in (torch.float32, torch.bfloat16)
    for cl in (False, True)
    for shape in ((16, 64, 256), (64, 16, 64))
]


def _ms(fn, rounds: int) -> float:
    """Median CPU ms of one call of ``fn`` (3 calls per round)."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(3):
            fn()
        times.append((time.process_time() - start) / 3 * 1e3)
    return statistics.median(times)


def _case(dtype, cl: bool, shape, mesh, composed, rounds: int, parallelize) -> dict:
    """Median CPU ms per forward + backward of the three columns for one input."""
    c, h, w = shape
    layer = nn.BatchNorm2d(c)
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(1, c, h, w).to(dtype).contiguous(memory_format=fmt)
    dy = torch.randn_like(x)
    par = parallelize(copy.deepcopy(layer), mesh)
    xs = DTensor.from_local(x.clone(), mesh, [Shard(3)]).requires_grad_()
    dys = DTensor.from_local(dy, mesh, [Shard(3)])
    xl = x.clone().requires_grad_()
    runs = {
        "torch": lambda: layer(xl).backward(dy),
        "composed": lambda: (composed(True), par(xs).backward(dys)),
        "fused": lambda: (composed(False), par(xs).backward(dys)),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for _ in range(rounds):  # interleaved, one round of each at a time
        for k, fn in runs.items():
            times[k].append(_ms(fn, 1))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from spconv_train.parallel import _norm_stats, parallelize

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    fused, kernel_stats = _norm_stats._fused, _norm_stats._kernel_stats

    def composed(on: bool) -> None:
        _norm_stats._fused = (lambda *a: False) if on else fused
        _norm_stats._kernel_stats = (lambda *a: False) if on else kernel_stats

    print("| input | C x H x W | torch ms | composed ms | fused ms |")
    print("|---|---|---|---|---|")
    for dtype, cl, shape in CASES:
        r = _case(dtype, cl, shape, mesh, composed, args.rounds, parallelize)
        label = f"{str(dtype).removeprefix('torch.')} {'channels-last' if cl else 'NCHW'}"
        size = "x".join(map(str, shape))
        print(f"| {label} | {size} | {r['torch']:.2f} | {r['composed']:.2f} | {r['fused']:.2f} |")
    composed(False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
