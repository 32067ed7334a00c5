"""Benchmark: the local kernels one rank runs, on one device, in float32 and bf16 (autocast)
with contiguous (NCHW) and channels-last activations.

A sharded step runs the same kernels on each rank's part (plus the halo), so this is the
ceiling of per-rank speed: which precision and memory format the local work should use.
Cases: a 3x3 convolution (C -> C) forward + backward, and one training step (forward,
cross-entropy, backward) of the registry U-Net. Per case: median milliseconds (CUDA events
on the GPU, a host timer on the CPU), megapixels per second, the allocator peak (CUDA) and
the speed-up over float32 contiguous.

Usage: ``python scripts/bench_kernels.py --device cuda [--height 1024 --width 4096]``;
``--markdown`` prints a table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import elapsed, print_table  # noqa: E402

from spconv_train.models import create_model  # noqa: E402


def _timed(fn, iters: int, warmup: int, device: str) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls (``bench_conv.elapsed``)."""
    times = [elapsed(fn, device) for _ in range(warmup + iters)]
    return statistics.median(times[warmup:])


def _case(name: str, args, dev: torch.device):
    """(module, input, target or None) for one case, on ``dev``."""
    g = torch.Generator().manual_seed(0)
    if name == "conv3x3":
        c = args.channels
        mod = torch.nn.Conv2d(c, c, 3, padding=1)
        x = torch.randn(1, c, args.height, args.width, generator=g)
        return mod.to(dev), x.to(dev), None
    torch.manual_seed(0)
    mod = create_model("unet", num_classes=4, depth=args.depth, base_width=args.base_width)
    x = torch.randn(1, 3, args.height, args.width, generator=g)
    y = torch.randint(0, 4, (1, args.height, args.width), generator=g)
    return mod.to(dev), x.to(dev), y.to(dev)


def run(name: str, bf16: bool, channels_last: bool, args) -> tuple[float, float]:
    """(median seconds, peak MiB) of forward + backward of one case."""
    dev = torch.device(args.device)
    mod, x, y = _case(name, args, dev)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    mod = mod.to(memory_format=fmt)
    x = x.contiguous(memory_format=fmt).requires_grad_(name == "conv3x3")

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16):
            out = mod(x)
        loss = out.float().square().mean() if y is None else F.cross_entropy(out.float(), y)
        loss.backward()
        mod.zero_grad(set_to_none=True)

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sec = _timed(step, args.iters, args.warmup, args.device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else float("nan")
    return sec, peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", nargs="+", default=["conv3x3", "unet"], choices=["conv3x3", "unet"])
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--base-width", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest algorithm per shape, once
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.height}x{args.width}", file=sys.stderr)
    rows = []
    mpx = args.height * args.width / 1e6
    for name in args.cases:
        base = None
        for bf16 in (False, True):
            for cl in (False, True):
                sec, peak = run(name, bf16, cl, args)
                base = base or sec
                rows.append((name, "bf16" if bf16 else "fp32", "channels_last" if cl else "NCHW",
                             sec * 1e3, mpx / sec, peak, base / sec))  # fmt: skip
                print(f"  {rows[-1]}", file=sys.stderr)
    head = ["case", "dtype", "layout", "ms / step", "Mpx/s", "peak MiB", "speed-up"]
    cells = [
        (r[0], r[1], r[2], f"{r[3]:.2f}", f"{r[4]:.1f}", f"{r[5]:.0f}", f"{r[6]:.2f}x")
        for r in rows
    ]
    print_table(tuple(head), cells, args.markdown, width=13)


if __name__ == "__main__":
    main()
