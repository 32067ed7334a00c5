"""Benchmark: one training step (forward, cross-entropy, backward with the bucketed gradient
reduction, SGD step) of registry models at 1, 2 (and 4) spatial ranks, with and without
activation checkpointing and ``torch.compile``.

Per case: median seconds per step (max over ranks), parallel efficiency against one rank
(``t1 / (N * tN)``), activations left alive by the forward (``LiveBytes``, MiB per rank)
and the growth of the peak RSS (CPU) or the CUDA allocator peak. One rank runs the
parallelized model on a one-rank mesh (no exchange; what it costs beyond the plain model is
the parallel layer's own work: docs/benchmarks.md, "One GPU"). A case that fails (e.g.
compile) is reported with its error instead of a time, and the exit status is then 1.

Usage: ``python scripts/bench_step.py [--models unet lraspp_mobilenet_v3_large --worlds 1 2
--height 256 --width 1024 --checkpointing off on --compile off on]`` (``make bench-step``);
``--markdown`` prints a table for ``docs/benchmarks.md``. On a loaded machine the times are
meaningless: note the load (``uptime``) beside the table.

``--reducers builtin ddp fsdp`` compares instead how the parameter gradients are summed over
the ranks, on the same model, image and groups: ``builtin`` (the model's bucketed
``GradReducer``), ``ddp`` (``DistributedDataParallel`` over the mesh's group as training
wraps it, ``replicate_gradients``: the built-in reducer defers to it exactly as it does to
FSDP, partial gradients scaled by the group size, DDP averages) and ``fsdp``
(``shard_parameters``). The variants alternate step by step
in the same processes (a load change hits them alike); the table gives the median s/step
and the largest parameter difference from ``builtin`` after the timed steps (the variants
train identically).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import (  # noqa: E402
    _current_mib,
    _peak_mib,
    _time_steps,
    add_run_args,
    init_worker,
    print_table,
    spawn_ranks,
)

from spconv_train.distributed import shutdown  # noqa: E402


def _build(name: str, args):
    from spconv_train.models import create_model

    torch.manual_seed(0)
    if name == "unet":
        return create_model("unet", num_classes=4, depth=args.depth, base_width=args.base_width)
    return create_model(name, num_classes=4)


def _worker(rank, world, port, name, ck, comp, args, floor, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.parallel import parallelize
    from spconv_train.parallel._step_meters import LiveBytes
    from spconv_train.train import cross_entropy
    from spconv_train.train.optim import enable_activation_checkpointing

    dev = args.device
    mesh = init_worker(rank, world, port, args)
    try:
        # floor: the plain model on the rank's strip, no communication at all (what the
        # ranks' compute alone costs when they share the machine)
        model = _build(name, args).to(dev)
        model = model if floor else parallelize(model, mesh)
        if ck:
            enable_activation_checkpointing(model)
        run = torch.compile(model, backend=args.compile_backend) if comp else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        img = torch.randn(1, 3, args.height, args.width, generator=g).to(dev)
        target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(dev)
        x = distribute_tensor(img, mesh, [Shard(3)], src_data_rank=None)
        tgt = distribute_tensor(target, mesh, [Shard(2)], src_data_rank=None).to_local()
        x = x.to_local() if floor else x

        def step() -> None:
            cross_entropy(run(x), tgt).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step()  # first step: compiles when asked
        first = time.perf_counter() - t0
        base = _current_mib(dev)
        sec = _time_steps(step, args.iters, 0, dev)
        meter = LiveBytes()
        with meter:
            loss = cross_entropy(run(x), tgt)
        live = meter.live() / 2**20
        loss.backward()
        queue.put((rank, None, sec, first, live, _peak_mib(dev) - base))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        queue.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}", 0, 0, 0, 0))
    finally:
        shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def _with_reducer(model, reducer: str):
    """``model`` (parallelized) with its gradients summed by ``reducer`` (module docstring)."""
    from spconv_train.parallel import replicate_gradients, shard_parameters
    from spconv_train.train.optim import checkpoint_blocks

    if reducer == "fsdp":
        return shard_parameters(model, checkpoint_blocks(model))
    if reducer == "ddp":  # as training wraps it (parallel.grad_reduce: ddp)
        return replicate_gradients(model)
    return model


def _reducer_worker(rank, world, port, name, ck, args, queue) -> None:
    """Interleaved steps of one model per reducer: (median s/step, max param diff)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from spconv_train.parallel import parallelize
    from spconv_train.train import cross_entropy
    from spconv_train.train.optim import enable_activation_checkpointing

    dev = args.device
    mesh = init_worker(rank, world, port, args)
    try:
        g = torch.Generator().manual_seed(1)
        img = torch.randn(1, 3, args.height, args.width, generator=g).to(dev)
        target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(dev)
        x = distribute_tensor(img, mesh, [Shard(3)], src_data_rank=None)
        tgt = distribute_tensor(target, mesh, [Shard(2)], src_data_rank=None).to_local()
        steps, times, models = {}, {r: [] for r in args.reducers}, {}
        for reducer in args.reducers:
            model = parallelize(_build(name, args).to(dev), mesh)
            if ck:
                enable_activation_checkpointing(model)
            run = models[reducer] = _with_reducer(model, reducer)
            opt = torch.optim.SGD(run.parameters(), lr=1e-3)

            def step(run=run, opt=opt) -> None:
                cross_entropy(run(x), tgt).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps[reducer] = step
            step()  # warm-up (DDP builds its buckets, FSDP initialises lazily)
        for _ in range(args.iters):
            for reducer, step in steps.items():
                times[reducer].append(_time_steps(step, 1, 0, dev))

        def params(run) -> list[torch.Tensor]:
            out = [p.full_tensor() if isinstance(p, DTensor) else p for p in run.parameters()]
            return [p.detach() for p in out]

        ref = params(models[args.reducers[0]])
        result = {}
        for reducer, run in models.items():
            diff = max((a - b).abs().max().item() for a, b in zip(params(run), ref, strict=True))
            result[reducer] = (statistics.median(times[reducer]), diff)
        queue.put((rank, None, result))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        queue.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}", {}))
    finally:
        shutdown()


def compare_reducers(args) -> None:
    """The ``--reducers`` table: per model, world size and checkpointing setting."""
    header = ("model", "ranks", "ckpt", *(f"{r} s/step" for r in args.reducers))
    header += tuple(f"{r} max param diff" for r in args.reducers[1:])
    rows = []
    for name in args.models:
        for ck in (c == "on" for c in args.checkpointing):
            for world in args.worlds:
                res = spawn_ranks(_reducer_worker, world, name, ck, args)
                errors = [r[1] for r in res if r[1]]
                row = (name, world, "on" if ck else "off")
                if errors:
                    rows.append((*row, "fails", errors[0]))
                    continue
                worst = {r: max(x[2][r][0] for x in res) for r in args.reducers}
                diffs = {r: max(x[2][r][1] for x in res) for r in args.reducers}
                row += tuple(f"{worst[r]:.3f}" for r in args.reducers)
                rows.append(row + tuple(f"{diffs[r]:.1e}" for r in args.reducers[1:]))
                print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    print_table(header, rows, args.markdown)
    exit_on_failures(rows)


def exit_on_failures(rows: list[tuple]) -> None:
    """Exit with status 1 when a case failed (its row says "fails"): scripts such as
    ``gpu_check.sh`` trust the exit code, and the table is printed first."""
    if any("fails" in row for row in rows):
        sys.exit(1)


def run_case(world: int, name: str, ck: bool, comp: bool, args, floor: bool = False):
    """(error or None, seconds, first-step seconds, live MiB, peak MiB): max over ranks."""
    res = spawn_ranks(_worker, world, name, ck, comp, args, floor)
    errors = [r[1] for r in res if r[1]]
    if errors:
        return errors[0], 0.0, 0.0, 0.0, 0.0
    return None, *(max(r[i] for r in res) for i in range(2, 6))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["unet", "lraspp_mobilenet_v3_large"])
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"])
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--iters", type=int, default=3)
    add_run_args(ap)
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also run, per world size > 1, the plain model on each rank's strip without any "
        "communication (the floor; its efficiency column is against one rank too)",
    )
    ap.add_argument(
        "--reducers",
        nargs="+",
        choices=["builtin", "ddp", "fsdp"],
        help="compare gradient reductions instead (module docstring), e.g. builtin ddp fsdp",
    )
    args = ap.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"training step on 1x3x{args.height}x{args.width}, {args.device}, {args.threads} "
        f"thread(s)/process; {platform.machine()}, {os.cpu_count()} cores, load {load:.1f}, "
        f"torch {torch.__version__}",
        file=sys.stderr,
    )
    if args.reducers:
        compare_reducers(args)
        return
    header = ("model", "ranks", "ckpt", "compile", "s/step", "efficiency", "first step s")
    header += ("live act. MiB/rank", "peak MiB/rank" if args.device == "cuda" else "peak RSS +MiB")
    rows = []
    for name in args.models:
        for ck in (c == "on" for c in args.checkpointing):
            for comp in (c == "on" for c in args.compile):
                single = None
                runs = [(w, False) for w in args.worlds]
                runs += [(w, True) for w in args.worlds if args.floor and w > 1]
                for world, floor in runs:
                    err, sec, first, live, peak = run_case(world, name, ck, comp, args, floor)
                    flags = ("on" if ck else "off", "on" if comp else "off")
                    label = f"{world} floor" if floor else world
                    if err:
                        rows.append((name, label, *flags, "fails", err, "-", "-", "-"))
                        continue
                    single = sec if world == 1 else single
                    eff = f"{single / (world * sec):.2f}" if single else "-"
                    row = (name, label, *flags, f"{sec:.3f}", eff, f"{first:.1f}")
                    rows.append((*row, f"{live:.0f}", f"{peak:.0f}"))
                    print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    print_table(header, rows, args.markdown)
    exit_on_failures(rows)


if __name__ == "__main__":
    main()
