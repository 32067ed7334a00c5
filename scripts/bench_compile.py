"""Benchmark: ``torch.compile`` vs eager for one training step of the parallelized U-Net, in
the same processes, interleaved step by step (so a load change hits both alike).

Per world size: median seconds per step (max over ranks) of the eager model and of a
compiled copy (same weights), their ratio, and the first compiled step (compile time).
A second table times single element-wise ops compiled alone vs eager on one process, to
show what inductor's CPU kernels cost on this machine independently of this project: on
AVX2 CPUs (torch 2.14.1) a ``bool`` result (``t > 0``, the mask a ReLU saves for its
backward) is stored through scalar loops and runs ~25x slower than eager, which is why the
spatial layer keeps element-wise handlers eager under compile on CPU
(``spconv_train/parallel/_compile.py``).

Usage: ``python scripts/bench_compile.py [--worlds 1 2 --height 256 --width 1024 --rounds 7]``
(``make bench-compile``); ``--markdown`` prints Markdown tables for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import _time_steps, init_worker, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy

    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    net = create_model("unet", num_classes=4, depth=args.depth, base_width=args.base_width)
    eager = parallelize(net.to(args.device), mesh)
    compiled = torch.compile(copy.deepcopy(eager), backend=args.backend, dynamic=False)
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g).to(args.device)
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(args.device)
    x = distribute_tensor(img, mesh, [Shard(3)])
    tgt = distribute_tensor(target, mesh, [Shard(2)]).to_local()

    def step(run):
        return lambda: cross_entropy(run(x), tgt).backward()

    def timed(run) -> float:  # one step, max over ranks
        return _time_steps(step(run), 1, 0, args.device)

    first = timed(compiled)
    timed(eager)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        times["eager"].append(timed(eager))
        times["compiled"].append(timed(compiled))
    queue.put({k: statistics.median(v) for k, v in times.items()} | {"first": first})
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def run_world(world: int, args) -> dict:
    return spawn_ranks(_worker, world, args, timeout=3600)[0]  # every rank: the same maxima


def kernel_rows(device: str, n: int = 1 << 20) -> list[tuple]:
    """Element-wise ops alone, compiled vs eager, ms per call (one process, no spconv)."""
    x = torch.randn(n, device=device)
    xg = x.clone().requires_grad_()
    cases = {
        "t > 0 (bool result)": (lambda t: t > 0, x),
        "relu, no grad": (torch.relu, x),
        "relu, grad (saves a bool mask)": (torch.relu, xg),
        "(t > 0).float()": (lambda t: (t > 0).float(), x),
    }
    rows = []
    for name, (fn, arg) in cases.items():
        comp = torch.compile(fn, dynamic=False)
        ms = []
        for f in (fn, comp):
            for _ in range(3):
                f(arg)
            t0 = time.perf_counter()
            for _ in range(20):
                f(arg)
            if device == "cuda":
                torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) / 20 * 1e3)
        rows.append((name, f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{ms[1] / ms[0]:.1f}x"))
    return rows


def _print(header: tuple, rows: list[tuple], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(map(str, r)) + " |")
    else:
        for r in (header, *rows):
            print("  ".join(f"{c!s:>14}" for c in r))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    print(
        f"U-Net depth {args.depth} base {args.base_width}, 1x3x{args.height}x{args.width}, "
        f"{args.device}, {args.threads} thread(s)/process, backend {args.backend}, "
        f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}",
        file=sys.stderr,
    )
    rows = []
    for world in args.worlds:
        r = run_world(world, args)
        ratio = r["compiled"] / r["eager"]
        rows.append((world, f"{r['eager']:.3f}", f"{r['compiled']:.3f}", f"{ratio:.2f}x"))
        rows[-1] += (f"{r['first']:.1f}",)
        print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    header = ("ranks", "eager s/step", "compiled s/step", "compiled/eager", "first step s")
    _print(header, rows, args.markdown)
    torch.set_num_threads(args.threads)
    header = ("op on 1M floats", "eager ms", "compiled ms", "compiled/eager")
    _print(header, kernel_rows(args.device), args.markdown)


if __name__ == "__main__":
    main()
