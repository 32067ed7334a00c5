"""Spike: does a CUDA graph of the whole training step take the host work off a parallelized model?

On one GPU the parallelized model's step is host-bound (the Python of DTensor and the
spatial handlers per layer; docs/benchmarks.md "One GPU"). A CUDA graph of the whole step
(forward, loss, backward, optimizer step; PyTorch's "whole-network capture") replays the
recorded kernels without running any Python. Per model, on a one-rank NCCL mesh, four
variants from the same initial weights and the same batch: the plain model and the
parallelized one, each eager and replayed from a graph. Printed: median milliseconds per
step (CUDA events), the graph's speed-up, and the largest relative parameter difference
between the eager and the graphed copy after the same number of steps (a replay runs the
captured kernels, so it should be 0 or rounding), or the capture's error; beside it the same
difference between two eager copies (what the kernels' own nondeterminism gives).

Usage: ``python scripts/spike_cuda_graph.py [--models unet smp_unet --height 512 --width 1024
--steps 20 --bf16 --channels-last]`` (CUDA only; one rank: NCCL refuses two on one GPU).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))
from bench_compile import build  # noqa: E402
from bench_conv import elapsed, init_worker  # noqa: E402

WARMUP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(model, x, tgt, bf16: bool):
    """A step of ``model`` with its own SGD (momentum), its gradients cleared first."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)

    def step():
        # autocast's weight cache must be off under a graph capture (torch.cuda.graphs docs)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            out = model(x)
        # the mean over the local part: the whole image on one rank. The tool's loss reads
        # its counts and error flags on the host (``.tolist()``), which a capture refuses
        logits = out.to_local() if isinstance(out, DTensor) else out
        F.cross_entropy(logits.float(), tgt).backward()
        opt.step()

    def clear_and_step():
        opt.zero_grad(set_to_none=True)  # a capture starts from no gradients (docs)
        step()

    return clear_and_step, step, opt


def _timed(fn, steps: int) -> float:
    """Median milliseconds of ``steps`` calls of ``fn`` (CUDA events)."""
    return statistics.median(elapsed(fn, "cuda") for _ in range(steps)) * 1e3


def run_variant(model, x, tgt, args) -> dict:
    """Eager and graphed copies of ``model`` trained ``WARMUP + steps`` steps each, and a
    second eager copy as the control."""
    graphed, control = copy.deepcopy(model), copy.deepcopy(model)
    eager_step = _trainer(model, x, tgt, args.bf16)[0]
    for _ in range(WARMUP):
        eager_step()
    result = {"eager": _timed(eager_step, args.steps)}
    control_step = _trainer(control, x, tgt, args.bf16)[0]
    for _ in range(WARMUP + args.steps):
        control_step()
    result["control"] = _max_rel(model, control)
    warm_step, step_g, opt_g = _trainer(graphed, x, tgt, args.bf16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as the docs ask
        for _ in range(WARMUP):
            warm_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    try:
        with torch.cuda.graph(graph):
            step_g()
    except Exception as exc:  # noqa: BLE001 - the spike reports why a capture fails
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return result
    result["graphed"] = _timed(graph.replay, args.steps)
    result["diff"] = _max_rel(model, graphed)
    return result


def _max_rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest parameter difference, relative to the parameter's largest entry."""
    diff = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        scale = pa.detach().abs().max().clamp_min(1e-12)
        diff = max(diff, ((pa.detach() - pb.detach()).abs().max() / scale).item())
    return diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["unet", "smp_unet"])
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--channels-last", action="store_true")
    args = ap.parse_args()
    args.device, args.threads = "cuda", 4
    from spconv_train.parallel import parallelize
    from spconv_train.train.model_setup import to_channels_last

    mesh = init_worker(0, 1, _free_port(), args)
    print(
        f"torch {torch.__version__} | {torch.cuda.get_device_name(0)} | 1x3x{args.height}x"
        f"{args.width}, bf16 {args.bf16}, channels-last {args.channels_last}, SGD"
    )
    print(
        "| model | variant | eager ms/step | graphed ms/step | eager/graphed "
        "| max rel param diff, graphed vs eager | eager vs eager (control) |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    img = torch.randn(1, 3, args.height, args.width, generator=g).cuda()
    target = torch.randint(0, 4, (1, args.height, args.width), generator=g).cuda()
    for name in args.models:
        torch.manual_seed(0)
        base = build(name, args).cuda()
        for variant in ("plain", "parallelized"):
            model = copy.deepcopy(base)
            x, tgt = img, target
            if variant == "parallelized":
                model = parallelize(model, mesh)
                x = distribute_tensor(img, mesh, [Shard(3)])
                tgt = distribute_tensor(target, mesh, [Shard(2)]).to_local()
            to_channels_last(model, "on" if args.channels_last else "off")
            r = run_variant(model, x, tgt, args)
            if "error" in r:
                print(
                    f"| {name} | {variant} | {r['eager']:.2f} | "
                    f"capture failed: {r['error']} | - | - | {r['control']:.1e} |"
                )
            else:
                print(
                    f"| {name} | {variant} | {r['eager']:.2f} | {r['graphed']:.2f} | "
                    f"{r['eager'] / r['graphed']:.1f}x | {r['diff']:.1e} | {r['control']:.1e} |"
                )
            sys.stdout.flush()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
