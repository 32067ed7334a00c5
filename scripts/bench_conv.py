"""Benchmark: width-sharded halo convolution vs DTensor's own routes vs one process.

Forward+backward time per step and peak memory per rank of ``Conv2d(C, C, 3, padding=1)``
on a ``1 x C x H x W`` image, one thread per process, gloo on CPU (NCCL on GPU with
``--device cuda``), for several world sizes. Rows:

- ``one process``: the plain convolution on the whole image (world size 1);
- ``halo (spconv)``: ``parallelize`` + ``Shard(3)`` input (this project): interior from the
  strip in place, thin edge windows, exchange overlapped with the interior;
- ``halo window``: the same with ``split_halo_conv=False`` (a padded window gathered first,
  exchange not overlapped): the reference for the hidden fraction;
- ``physicsnemo``: NVIDIA PhysicsNeMo's ``ShardTensor`` halo convolution, only when
  ``physicsnemo`` is importable (not a dependency, see docs/benchmarks.md to install it);
- ``dtensor native``: ``nn.Conv2d`` applied to the ``Shard(3)`` DTensor as is (PyTorch's own
  DTensor convolution; its result is checked and flagged when wrong);
- ``dtensor gather``: gather the image (``full_tensor``), convolve, re-shard: the only
  correct DTensor route;
- ``floor (no comm)``: every rank convolves its own strip with no communication at all.

Variants run in fresh processes, interleaved over ``--rounds`` rounds (medians), so a load
change on a shared machine hits every variant alike. The halo rows note the exchange time the
rank was blocked on per step; ``hidden`` = 1 - blocked(halo) / blocked(halo window).
On CPU every rank tunes glibc's malloc as a run does; ``SPCONV_MALLOC_TUNING=0`` in the
environment measures without it (spconv_train/distributed/cpu_malloc.py, docs/benchmarks.md).

Usage: ``python scripts/bench_conv.py [--channels 32 --height 512 --width 2048 --worlds 1 2 4]``
(``make bench-conv``). Prints a table; ``--markdown`` prints it as Markdown for
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from spconv_train.distributed import free_port, shutdown


def _peak_mib(device: str) -> float:
    """Peak memory so far: the CUDA allocator's peak, or the process's peak RSS on CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _current_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def elapsed(fn, device: str) -> float:
    """Seconds of one call of ``fn``: on CUDA the GPU's, between CUDA events recorded around
    the call (host timers would see only the kernel launches); else a host timer."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _time_steps(fn, iters: int, warmup: int, device: str) -> float:
    """Median seconds per call of ``fn`` (max over ranks: a step ends when the slowest does;
    ``elapsed``)."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        seconds = elapsed(fn, device)
        dt = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item())
    return statistics.median(times)


def init_worker(rank: int, world: int, port: int, args):
    """Threads, device, process group (NCCL on CUDA, gloo on CPU) and a 1-D "sp" mesh.
    On CPU, malloc is tuned as ``spconv-train run`` tunes it (``SPCONV_MALLOC_TUNING=0``
    measures without: spconv_train/distributed/cpu_malloc.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from spconv_train.distributed.cpu_affinity import bind_local_rank
    from spconv_train.distributed.cpu_malloc import tune_cpu_allocator
    from spconv_train.parallel import gloo_threads_idle

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        tune_cpu_allocator()
        bind_local_rank(rank, world)  # as a CPU run does (spconv_train/distributed/cpu_affinity.py)
    # gloo's threads idle-only, as a CPU run does (spconv_train/parallel/_comm_threads.py;
    # SPCONV_GLOO_THREADS=normal in the environment: without)
    with gloo_threads_idle() if args.device == "cpu" else contextlib.nullcontext():
        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=30),
        )
        return init_device_mesh(args.device, (world,), mesh_dim_names=("sp",))


VARIANTS = (
    "one process",
    "floor (no comm)",
    "halo (spconv)",
    "halo window",
    "physicsnemo",
    "dtensor gather",
    "dtensor native",
)
HALO_VARIANTS = ("halo (spconv)", "halo window")


def _worker(rank: int, world: int, port: int, variant: str, args, queue) -> None:
    """Measure one variant in a fresh process (so the CPU peak RSS is that variant's)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from spconv_train.parallel import parallelize

    device = args.device
    mesh = init_worker(rank, world, port, args)
    c, h, w = args.channels, args.height, args.width
    torch.manual_seed(0)
    conv = nn.Conv2d(c, c, 3, padding=1).to(device)
    img = torch.randn(1, c, h, w, device=device)
    x_dt = distribute_tensor(img, mesh, [Shard(3)])
    note = ""
    if variant == "one process":
        x0 = img

        def step():
            conv(x0.detach().requires_grad_()).sum().backward()

    elif variant == "floor (no comm)":
        strip = x_dt.to_local().clone()  # this rank's strip, convolved with no halo at all

        def step():
            conv(strip.detach().requires_grad_()).sum().backward()

    elif variant in HALO_VARIANTS:
        model = parallelize(
            nn.Sequential(conv),
            mesh,
            save_windows_by_reference=not args.copy_windows,
            split_halo_conv=variant == "halo (spconv)",
        )
        stats = model.spatial_runtime.stats

        def step():
            model(x_dt.detach().requires_grad_()).sum().backward()

    elif variant == "physicsnemo":
        from _bench_physicsnemo import physicsnemo_step

        step = physicsnemo_step(conv, img, mesh)

    elif variant == "dtensor gather":

        def step():
            x = x_dt.detach().requires_grad_()
            y = DTensor.from_local(conv(x.full_tensor()), mesh, [Replicate()], run_check=False)
            y.redistribute(mesh, [Shard(3)]).sum().backward()

    else:  # PyTorch's own DTensor convolution (parameters replicated), checked first
        from torch.distributed.tensor import distribute_module

        dconv = distribute_module(nn.Conv2d(c, c, 3, padding=1).to(device), mesh)
        with torch.no_grad():
            for p, q in zip(dconv.parameters(), conv.parameters(), strict=True):
                p.to_local().copy_(q)
        try:
            y = dconv(x_dt)
            ok = y.placements[0].is_shard() and torch.allclose(
                y.full_tensor(), conv(img), atol=1e-4
            )
            note = "correct" if ok else f"WRONG result (output {y.placements[0]})"
        except Exception as exc:  # noqa: BLE001 - report, don't crash the benchmark
            queue.put((rank, None, f"raises {type(exc).__name__}"))
            shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)
            return

        def step():
            dconv(x_dt.detach().requires_grad_()).sum().backward()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _current_mib(device)
    try:
        sec = _time_steps(step, args.iters, args.warmup, device)
    except Exception as exc:  # noqa: BLE001 - the parent must not wait forever
        queue.put((rank, None, f"failed: {exc}"))
        raise
    if variant in HALO_VARIANTS:
        stats.reset()
        step()
        note = f"{stats.halo_seconds * 1e3:.2f}"  # ms blocked on the exchange in one step
    queue.put((rank, (sec, _peak_mib(device) - base), note))
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def add_run_args(ap: argparse.ArgumentParser, device: bool = True) -> None:
    """The options of every benchmark's run: ``--threads`` per process, ``--device`` (cpu
    or cuda; left out where the benchmark is CPU only) and ``--markdown``."""
    ap.add_argument("--threads", type=int, default=1)
    if device:
        ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")


def machine() -> str:
    """``<architecture>, <cores> cores, torch <version>``: the end of a set-up line."""
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def print_table(header: tuple, rows: list, markdown: bool, width: int = 12) -> None:
    """Print ``rows`` under ``header``: a markdown table for docs/benchmarks.md, or
    right-aligned columns of ``width`` characters."""
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(map(str, r)) + " |")
    else:
        for r in (header, *rows):
            print("  ".join(f"{c!s:>{width}}" for c in r))


def spawn_ranks(target, world: int, *args, timeout: float = 7200) -> list:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` fresh processes (one
    process group on a free port) and return what each put on ``queue``, in arrival order.
    Every benchmark script starts its ranks through this. ``SPCONV_BENCH_START_METHOD=fork``
    (CPU only: scripts/gpu_check.sh --device cpu sets it) lets the ranks inherit the imported
    torch instead of importing it again, ~3.5 s of CPU per rank."""
    method = os.environ.get("SPCONV_BENCH_START_METHOD", "spawn")
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"SPCONV_BENCH_START_METHOD={method}: use spawn, fork or forkserver")
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join()
    return results


def run_variant(world: int, variant: str, args) -> tuple[float, float, str]:
    """(seconds per step, peak extra MiB on the worst rank, note) of one variant."""
    results = spawn_ranks(_worker, world, variant, args)
    if any(r[1] is None for r in results):
        return float("nan"), float("nan"), results[0][2]
    sec = max(r[1][0] for r in results)
    mem = max(r[1][1] for r in results)
    if variant in HALO_VARIANTS:  # ms blocked on the exchange: the worst rank
        return sec, mem, max(float(r[2]) for r in results)
    return sec, mem, results[0][2]


def _median_run(runs: list) -> tuple[float, float, object]:
    """Median time, median peak memory and the note (median when numeric) of the rounds."""
    notes = [r[2] for r in runs]
    numeric = all(isinstance(n, float) for n in notes)
    return (
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        statistics.median(notes) if numeric else notes[0],
    )


def _runs_at(world: int, variant: str) -> bool:
    """One process only at 1 rank; the sharded variants at more (the halo conv at 1 too)."""
    if world == 1:
        return variant in ("one process", "halo (spconv)")
    return variant != "one process"


def _physicsnemo_importable() -> bool:
    try:
        import physicsnemo  # noqa: F401
    except ImportError:
        print("  physicsnemo not importable: no PhysicsNeMo row", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    add_run_args(ap)
    ap.add_argument(
        "--copy-windows",
        action="store_true",
        help="save halo windows as copies (faster, more memory) instead of by reference",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT"
    )
    args = ap.parse_args(argv)

    print(
        f"Conv2d({args.channels}, {args.channels}, 3, padding=1), input 1x{args.channels}x"
        f"{args.height}x{args.width}, forward+backward, {args.threads} thread(s)/process, "
        f"{args.device}; machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}",
        file=sys.stderr,
    )
    wanted = [v for v in args.variants if v != "physicsnemo" or _physicsnemo_importable()]
    runs: dict[tuple[int, str], list] = {}
    for rnd in range(args.rounds):  # interleaved: every variant once per round
        for world in args.worlds:
            for variant in VARIANTS:
                if variant not in wanted or not _runs_at(world, variant):
                    continue
                res = run_variant(world, variant, args)
                runs.setdefault((world, variant), []).append(res)
                print(
                    f"  round {rnd} {world} rank(s) {variant}: {res[0] * 1e3:.1f} ms",
                    file=sys.stderr,
                )
    table = []
    med = {k: _median_run(v) for k, v in runs.items()}
    for (world, variant), (sec, mem, note) in med.items():
        base = med.get((world, "floor (no comm)"), med.get((1, "one process")))
        single = med.get((1, "one process"), (None,))[0]
        if variant in HALO_VARIANTS:
            blocked = note
            ref = "floor" if world > 1 else "plain"
            note = f"{sec / base[0]:.2f}x {ref}, " if base else ""  # no baseline row asked
            note += f"{blocked:.1f} ms blocked"
            window = med.get((world, "halo window"))
            if variant == "halo (spconv)" and window and window[2] > 0:
                note += f" ({1 - blocked / window[2]:.0%} hidden)"
            if world == 1 and base:
                note += f", peak {mem / base[1]:.2f}x plain"
        elif variant == "physicsnemo" and base:
            note = f"{sec / base[0]:.2f}x floor"
        table.append((world, variant, sec * 1e3, mem, single and single / sec, note))
    mem_label = "peak MiB/rank" if args.device == "cuda" else "peak RSS MiB/rank"
    header = ("ranks", "variant", "ms/step", mem_label, "speed-up vs 1 proc", "note")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    else:
        print(
            f"{header[0]:>5}  {header[1]:<16} {header[2]:>9} {header[3]:>18} {header[4]:>18}  note"
        )
    for world, name, ms, mem, speed, note in table:
        speed_s = f"{speed:.2f}x" if speed else "-"
        if args.markdown:
            print(f"| {world} | {name} | {ms:.1f} | {mem:.0f} | {speed_s} | {note} |")
        else:
            print(f"{world:>5}  {name:<16} {ms:>9.1f} {mem:>18.0f} {speed_s:>18}  {note}")


if __name__ == "__main__":
    main()
