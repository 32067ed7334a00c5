"""Benchmark: ``torch.compile`` vs eager for one training step of a parallelized model, in
the same processes, interleaved step by step (so a load change hits both alike).

Per model and world size: median seconds per step (max over ranks) of the eager model and
of a compiled copy (same weights), their ratio, the first compiled step (compile time),
and what Dynamo made of it (graphs, graph breaks, frames compiled after the first step).
``--cpu-time`` adds the CPU seconds of each rank's process per step (``time.process_time``,
all its threads; max over ranks, median over the rounds): other processes' load barely
moves it, so on a shared machine it is the column to read.
Models (``--models``): the built-in U-Net, ``lraspp`` (torchvision LR-ASPP MobileNetV3),
``smp_unet`` (smp Unet on resnet18, random init) and ``convnext`` (the ConvNeXt-style
user block of ``tests/test_compile_models.py``).
``--compile-mode`` is ``training.compile_mode`` (``default``, ``trace``, ``dtensor_graphs``:
the ``parallelize`` options of ``spconv_train/train/model_setup.py``; what each compiles:
``spconv_train/parallel/_compile.py``), or ``plain``: the model without ``parallelize`` (one
rank only), what inductor makes of the model itself. ``--channels-last`` makes the weights
channels-last first (``training.channels_last: on``).
A second table times single element-wise ops compiled alone vs eager on one process, to
show what inductor's CPU kernels cost on this machine independently of this project: on
the CPUs measured (torch 2.14.1) a ``bool`` result (``t > 0``, the mask a ReLU saves for
its backward) runs 20-60x slower than eager, which makes the ReLU graphs of
``dtensor_graphs`` slower than eager on CPU (docs/benchmarks.md).

Usage: ``python scripts/bench_compile.py [--models unet lraspp --worlds 1 2 --height 256
--width 1024 --rounds 7 --compile-mode dtensor_graphs --channels-last --cpu-time]``
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
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import _time_steps, add_run_args, init_worker, print_table, spawn_ranks  # noqa: E402

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
    from spconv_train.train.model_setup import COMPILE_MODES, to_channels_last

    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    eager = build(name, args).to(args.device)
    if args.compile_mode != "plain":
        eager = parallelize(eager, mesh, **COMPILE_MODES[args.compile_mode])
    to_channels_last(eager, "on" if args.channels_last else "off")
    compiled = torch.compile(copy.deepcopy(eager), backend=args.backend, dynamic=False)
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g).to(args.device)
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(args.device)
    if args.compile_mode == "plain":
        x, tgt = img, target
    else:
        x = distribute_tensor(img, mesh, [Shard(3)])
        tgt = distribute_tensor(target, mesh, [Shard(2)]).to_local()

    def step(run):
        def one():
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16):
                out = run(x)
            cross_entropy(out.float(), tgt).backward()

        return one

    def timed(run) -> tuple[float, float]:
        """(wall, CPU) seconds of one step, each max over ranks."""
        cpu0 = time.process_time()
        wall = _time_steps(step(run), 1, 0, args.device)
        cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64, device=args.device)
        dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
        return wall, cpu.item()

    dynamo.utils.counters.clear()
    first = timed(compiled)[0]
    counters = dynamo.utils.counters
    frames_first = counters["frames"]["ok"]
    dynamo_stats = {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "frames": frames_first,
    }
    timed(eager)
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        times["eager"].append(timed(eager))
        times["compiled"].append(timed(compiled))
    dynamo_stats["recompiled"] = counters["frames"]["ok"] - frames_first
    result = {"first": first}
    for k, v in times.items():
        result[k] = statistics.median(t[0] for t in v)
        result[f"{k}_cpu"] = statistics.median(t[1] for t in v)
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


def add_model_args(
    ap: argparse.ArgumentParser,
    models: list[str],
    worlds: list[int],
    size: tuple[int, int],
    rounds: int,
    choices: tuple[str, ...] = MODELS,
    worlds_help: str | None = None,
) -> None:
    """The options of a benchmark over ``MODELS`` (``build``): ``--models`` (default
    ``models``, among ``choices``), ``--worlds``, ``--height`` / ``--width`` (default
    ``size``), the U-Net's ``--depth`` / ``--base-width``, ``--rounds``."""
    ap.add_argument("--models", nargs="+", default=models, choices=choices)
    ap.add_argument("--worlds", type=int, nargs="+", default=worlds, help=worlds_help)
    ap.add_argument("--height", type=int, default=size[0])
    ap.add_argument("--width", type=int, default=size[1])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=rounds)


def print_setup(args, *extra: str) -> None:
    """The set-up line on stderr: models, image, device, threads, ``extra``, load, torch."""
    print(
        f"models {args.models} (U-Net depth {args.depth}, base width {args.base_width}), "
        f"1x3x{args.height}x{args.width}, {args.device}, {args.threads} thread(s)/process, "
        + "".join(f"{e}, " for e in extra)
        + f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(ap, ["unet"], [1, 2], (256, 1024), 7)
    ap.add_argument("--backend", default="inductor")
    add_run_args(ap)
    ap.add_argument("--no-kernels", action="store_true", help="skip the element-wise table")
    ap.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "trace", "dtensor_graphs", "plain"],
        help="training.compile_mode, or plain: the model without parallelize (1 rank)",
    )
    ap.add_argument(
        "--channels-last", action="store_true", help="channels-last weights (and activations)"
    )
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay fp32)")
    ap.add_argument(
        "--cpu-time", action="store_true", help="CPU seconds per step too (max over ranks)"
    )
    args = ap.parse_args(argv)
    if args.compile_mode == "plain" and args.worlds != [1]:
        ap.error("--compile-mode plain runs the model without parallelize: --worlds 1 only")
    print_setup(
        args,
        f"backend {args.backend}, compile mode {args.compile_mode}",
        f"channels-last {args.channels_last}, bf16 {args.bf16}",
    )
    rows = []
    for name in args.models:
        for world in args.worlds:
            r = run_world(name, world, args)
            rows.append((args.compile_mode, "on" if args.channels_last else "off", name, world))
            if args.cpu_time:
                cpu = (r["eager_cpu"], r["compiled_cpu"])
                rows[-1] += (f"{cpu[0]:.3f}", f"{cpu[1]:.3f}", f"{cpu[1] / cpu[0]:.2f}x")
            wall = (r["eager"], r["compiled"])
            rows[-1] += (f"{wall[0]:.3f}", f"{wall[1]:.3f}", f"{wall[1] / wall[0]:.2f}x")
            rows[-1] += (f"{r['first']:.1f}", r["graphs"], r["breaks"])
            rows[-1] += (r["frames"], r["recompiled"], f"{os.getloadavg()[0]:.1f}")
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    header = ("mode", "channels-last", "model", "ranks")
    if args.cpu_time:
        header += ("eager CPU s/step", "compiled CPU s/step", "CPU compiled/eager")
    header += ("eager s/step", "compiled s/step", "compiled/eager")
    header += ("first step s", "graphs", "graph breaks", "frames", "recompiled", "load")
    print_table(header, rows, args.markdown)
    if args.no_kernels:
        return
    torch.set_num_threads(args.threads)
    header = ("op on 1M floats", "eager ms", "compiled ms", "compiled/eager")
    print_table(header, kernel_rows(args.device), args.markdown)


if __name__ == "__main__":
    main()
