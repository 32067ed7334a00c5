"""Probe: which CUDA batch-norm backward kernels give precise per-channel sums for bf16 input.

The parallel batch norm needs, per channel, the local sums ``sum(dy * xhat)`` and
``sum(dy)`` of the backward (then one collective completes them) and ``dx`` from the
global sums. On CUDA with a contiguous (NCHW) bf16 input, the training-form
``native_batch_norm_backward`` returned those sums with bf16-sized errors, so bf16 on CUDA
takes the slower composed path (``parallel/_norm_stats._mixed_ok``). This script compares,
against an fp64 reference, on NCHW and channels-last bf16 inputs with fp32 statistics:

- ``native_bwd``: ``native_batch_norm_backward``'s affine gradients (the CPU fused path);
- ``reduce``: ``batch_norm_backward_reduce`` (SyncBatchNorm's kernel: ``sum(dy)``,
  ``sum(dy * (x - mean))``), then ``* invstd``;
- ``fp32``: the composed sums in fp32 (what the composed path computes);

and for ``dx``: ``batch_norm_backward_elemt`` (SyncBatchNorm's) against the fp64 formula.
Printed: max relative error per channel sum, and median milliseconds (CUDA events).

Usage: ``python scripts/probe_bn_cuda.py [--shape 2 64 256 512]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import elapsed  # noqa: E402


def _ms(fn, iters: int = 20) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after one (CUDA events)."""
    fn()
    return statistics.median(elapsed(fn, "cuda") for _ in range(iters)) * 1e3


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def probe(shape: tuple[int, ...], channels_last: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape, device="cuda", generator=g) * 3 + 1).bfloat16()
    dy = torch.randn(shape, device="cuda", generator=g).bfloat16()
    if channels_last:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    dims = [0, *range(2, x.dim())]
    xd, dyd = x.double(), dy.double()
    mean = xd.mean(dims).float()
    invstd = torch.rsqrt(xd.var(dims, unbiased=False) + 1e-5).float()
    w = torch.rand(c, device="cuda", generator=g) + 0.5
    view = (1, c) + (1,) * (x.dim() - 2)
    xhat = (xd - mean.double().view(view)) * invstd.double().view(view)
    ref_gw, ref_gb = (dyd * xhat).sum(dims), dyd.sum(dims)
    count = x.numel() // c

    def native():
        return torch.ops.aten.native_batch_norm_backward(
            dy, x, w, None, None, mean, invstd, True, 1e-5, [False, True, True]
        )[1:]

    def reduce():
        s_dy, s_xmu, _, _ = torch.batch_norm_backward_reduce(
            dy, x, mean, invstd, w, True, False, False
        )
        return s_xmu * invstd, s_dy

    def fp32():
        xh = (x.float() - mean.view(view)) * invstd.view(view)
        return (dy.float() * xh).sum(dims), dy.float().sum(dims)

    layout = "channels-last" if channels_last else "NCHW"
    for name, fn in (("native_bwd", native), ("reduce", reduce), ("fp32", fp32)):
        gw, gb = fn()
        print(
            f"| {layout} | {name} | {_rel(gw, ref_gw):.2e} | {_rel(gb, ref_gb):.2e} | "
            f"{_ms(fn):.3f} |"
        )
    # dx from the (global) sums: SyncBatchNorm's element-wise kernel vs fp64
    s_dy, s_xmu, _, _ = torch.batch_norm_backward_reduce(dy, x, mean, invstd, w, True, False, False)
    counts = torch.full((1,), count, dtype=torch.int32, device="cuda")

    def elemt():
        return torch.batch_norm_backward_elemt(dy, x, mean, invstd, w, s_dy, s_xmu, counts)

    a = (w.double() * invstd.double()).view(view)
    ref_dx = a * (dyd - ref_gb.view(view) / count - xhat * ref_gw.view(view) / count)
    dx = elemt()
    print(f"| {layout} | elemt dx ({dx.dtype}) | {_rel(dx, ref_dx):.2e} | - | {_ms(elemt):.3f} |")


def probe_dx(shape: tuple[int, ...], device: str, correlated: float) -> None:
    """``dx`` of a bf16 channels-last batch norm from fp32 global sums, three ways, against
    fp64: two bf16 terms (what the fused path once ran: an inference-form ``batch_norm``
    with the correction as its affine, plus ``invstd * w * dy`` from the evaluation-form
    backward), SyncBatchNorm's ``batch_norm_backward_elemt`` (CUDA;
    fp32 inside, one rounding), the composed fp32 formula rounded once, and what the fused
    path runs now (``_dx``: SyncBatchNorm's kernel on CUDA, the fp32 formula on CPU). ``dy`` is
    ``correlated * xhat + noise``: the correction terms cancel more of ``dy`` as it grows."""
    from spconv_train.parallel._norm_stats import _affine_sums, _dx

    g = torch.Generator().manual_seed(1)
    c = shape[1]
    view = (1, c) + (1,) * (len(shape) - 2)
    x = (torch.randn(shape, generator=g) * 3 + 1).bfloat16()
    dims = [0, *range(2, x.dim())]
    xd = x.double()
    mean64, var64 = xd.mean(dims), xd.var(dims, unbiased=False)
    xhat = (xd - mean64.view(view)) * torch.rsqrt(var64 + 1e-5).view(view)
    dy = (correlated * xhat + torch.randn(shape, generator=g, dtype=torch.float64)).bfloat16()
    x, dy = (t.to(device).contiguous(memory_format=torch.channels_last) for t in (x, dy))
    mean, var = mean64.float().to(device), var64.float().to(device)
    invstd = torch.rsqrt(var + 1e-5)
    w = (torch.rand(c, generator=g) + 0.5).to(device)
    n = x.numel() // c
    m, i, wd, dyd = mean.double(), invstd.double(), w.double(), dy.double()
    xh = (x.double() - m.view(view)) * i.view(view)
    gw64, gb64 = (dyd * xh).sum(dims), dyd.sum(dims)
    a64 = (i * wd).view(view)
    ref = a64 * (dyd - gb64.view(view) / n - xh * gw64.view(view) / n)
    gw, gb = _affine_sums(dy, x, w, (mean, var), invstd, 1e-5)
    a = invstd * w
    shift = (a * gw / -n, a * gb / -n)
    two = torch.batch_norm(x, *shift, mean, var, False, 0.0, 1e-5, False)
    scaled = torch.ops.aten.native_batch_norm_backward(  # invstd * w * dy, rounded
        dy, x, w, mean, var, mean, invstd, False, 1e-5, [True, False, False]
    )[0]
    two = two.add_(scaled)
    rows = [
        ("two bf16 terms", two),
        ("parallel/_norm_stats._dx", _dx(dy, x, w, (mean, var), invstd, (gw, gb), n, 1e-5)),
    ]
    if device == "cuda":
        one = torch.ones(1, dtype=torch.int32, device=device)
        elemt = torch.batch_norm_backward_elemt(
            dy, x, mean, invstd, w, gb / n, gw / (invstd * n), one
        )
        rows.append(("batch_norm_backward_elemt", elemt))
    a32 = a.view(view)
    xh32 = (x.float() - mean.view(view)) * invstd.view(view)
    fp32 = (a32 * (dy.float() - (gb / n).view(view) - xh32 * (gw / n).view(view))).bfloat16()
    rows.append(("fp32 formula, one rounding", fp32))
    for name, dx in rows:
        dist = ((dx.double() - ref).norm() / ref.norm()).item()
        print(
            f"| {device} | {correlated} | {name} | {dist:.2e} | "
            f"{dx.is_contiguous(memory_format=torch.channels_last)} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs="+", default=[2, 64, 256, 512])
    args = ap.parse_args()
    print(f"torch {torch.__version__} | {torch.cuda.get_device_name(0)} | shape {args.shape}, bf16")
    print("| layout | kernel | rel err sum(dy*xhat) | rel err sum(dy) | ms |")
    print("|---|---|---|---|---|")
    for cl in (False, True):
        probe(tuple(args.shape), cl)
    print("\n| device | dy = k * xhat + noise, k | dx from | distance from fp64 | channels-last |")
    print("|---|---|---|---|---|")
    for device in ("cpu", "cuda"):
        for k in (0.0, 3.0, 30.0):
            probe_dx(tuple(args.shape), device, k)


if __name__ == "__main__":
    main()
