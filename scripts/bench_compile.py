"""Benchmark: ``torch.compile`` vs eager for one training step of a parallelized model, in
the same processes, interleaved step by step (so a load change hits both alike).

Per model and world size: median seconds per step (max over ranks) of the eager model and
of a compiled copy (same weights), their ratio, the first compiled step (compile time),
and what Dynamo made of it (graphs, graph breaks, frames compiled after the first step).
Models (``--models``): the built-in U-Net, ``lraspp`` (torchvision LR-ASPP MobileNetV3),
``smp_unet`` (smp Unet on resnet18, random init) and ``convnext`` (the ConvNeXt-style
user block of ``tests/test_compile_models.py``).
``--trace-under-compile`` and ``--trace-dtensor-ops`` select the ``parallelize`` option of
that name (``spconv_train/parallel/_compile.py``: what each compiles).
A second table times single element-wise ops compiled alone vs eager on one process, to
show what inductor's CPU kernels cost on this machine independently of this project: on
the CPUs measured (torch 2.14.1) a ``bool`` result (``t > 0``, the mask a ReLU saves for
its backward) runs 20-60x slower than eager, which makes the ReLU graphs of
``trace_dtensor_ops`` slower than eager on CPU (docs/benchmarks.md).

Usage: ``python scripts/bench_compile.py [--models unet lraspp --worlds 1 2 --height 256
--width 1024 --rounds 7 --trace-dtensor-ops]``
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
from bench_conv import _time_steps, init_worker, print_table, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402

MODELS = ("unet", "lraspp", "smp_unet", "convnext")


def build(name: str, args) -> torch.nn.Module:
    """One of ``MODELS`` with 4 classes."""
    from spconv_train.models import create_model

    if name == "unet":
        return create_model("unet", num_classes=4, depth=args.depth, base_width=args.base_width)
    if name == "lraspp":
        return create_model("lraspp_mobilenet_v3_large", num_classes=4)
    if name == "smp_unet":
        kw = {"encoder_name": "resnet18", "encoder_weights": None}
        return create_model("smp.Unet", num_classes=4, **kw)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.test_compile_models import ConvNeXtStyle

    return ConvNeXtStyle(channels=args.base_width, num_classes=4)


def _worker(rank: int, world: int, port: int, name: str, args, queue) -> None:
    import torch._dynamo as dynamo
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy

    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    opts = {"trace_under_compile": args.trace_under_compile}
    opts["trace_dtensor_ops"] = args.trace_dtensor_ops
    eager = parallelize(build(name, args).to(args.device), mesh, **opts)
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

    dynamo.utils.counters.clear()
    first = timed(compiled)
    counters = dynamo.utils.counters
    frames_first = counters["frames"]["ok"]
    dynamo_stats = {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "frames": frames_first,
    }
    timed(eager)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        times["eager"].append(timed(eager))
        times["compiled"].append(timed(compiled))
    dynamo_stats["recompiled"] = counters["frames"]["ok"] - frames_first
    result = {k: statistics.median(v) for k, v in times.items()} | {"first": first}
    queue.put(result | dynamo_stats)
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def run_world(name: str, world: int, args) -> dict:
    return spawn_ranks(_worker, world, name, args, timeout=3600)[0]  # same maxima on every rank


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["unet"], choices=MODELS)
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
    ap.add_argument("--no-kernels", action="store_true", help="skip the element-wise table")
    ap.add_argument(
        "--trace-under-compile",
        action="store_true",
        help="parallelize(..., trace_under_compile=True): Dynamo traces the model's code",
    )
    ap.add_argument(
        "--trace-dtensor-ops",
        action="store_true",
        help="parallelize(..., trace_dtensor_ops=True): DTensor ops in the compiled graphs",
    )
    args = ap.parse_args(argv)
    print(
        f"models {args.models} (U-Net depth {args.depth}, base width {args.base_width}), "
        f"1x3x{args.height}x{args.width}, {args.device}, {args.threads} thread(s)/process, "
        f"backend {args.backend}, trace_under_compile {args.trace_under_compile}, "
        f"trace_dtensor_ops {args.trace_dtensor_ops}, "
        f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}",
        file=sys.stderr,
    )
    rows = []
    for name in args.models:
        for world in args.worlds:
            r = run_world(name, world, args)
            ratio = r["compiled"] / r["eager"]
            rows.append((name, world, f"{r['eager']:.3f}", f"{r['compiled']:.3f}"))
            rows[-1] += (f"{ratio:.2f}x", f"{r['first']:.1f}", r["graphs"], r["breaks"])
            rows[-1] += (r["frames"], r["recompiled"], f"{os.getloadavg()[0]:.1f}")
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    header = ("model", "ranks", "eager s/step", "compiled s/step", "compiled/eager")
    header += ("first step s", "graphs", "graph breaks", "frames", "recompiled", "load")
    print_table(header, rows, args.markdown)
    if args.no_kernels:
        return
    torch.set_num_threads(args.threads)
    header = ("op on 1M floats", "eager ms", "compiled ms", "compiled/eager")
    print_table(header, kernel_rows(args.device), args.markdown)


if __name__ == "__main__":
    main()
