"""Benchmark: what splitting more than one dim buys.

1. **Halo traffic, W strips vs H x W tiles** (2-D U-Net forward + backward): bytes each rank
   sends per step (``SpatialStats.halo_bytes``, forward and backward exchanges) and the
   step time, measured at 4 ranks as 1x4 strips (``("sp",)`` mesh, ``[Shard(3)]``) and 2x2
   tiles (``("sp_h", "sp_w")`` mesh, ``[Shard(2), Shard(3)]``); where ``parallelize``
   refuses the tile mesh the row says so. Beyond 4 ranks the bytes are *modelled*: a rank
   exchanges the edges of its block, so per rank strips cost ~ 2H and p x q tiles
   ~ 2H/p + 2W/q (corners are second order); the modelled rows scale the measured 4-rank
   strip bytes by that perimeter ratio.
2. **Saved activations of the 3-D U-Net** per rank at 1, 2 and 4 ranks, volume split over
   D and over W, and over H x W (2 x 2) at 4 ranks: ``LiveBytes`` after the forward (exact,
   allocator independent), against the target of <= 1.1x (one rank's) / N; the plain
   single-device model's bytes for reference. ``--save-windows off`` measures without
   window saving by reference.

Usage: ``python scripts/bench_tiles.py [--markdown] [--part halo|volume]
[--save-windows on|off]`` (CPU, gloo, 1 thread per process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402


def _mesh(grid: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    from spconv_train.parallel import gloo_threads_idle

    names = ("sp",) if len(grid) == 1 else ("sp_h", "sp_w")
    with gloo_threads_idle():  # as a CPU run does (spconv_train/parallel/_comm_threads.py)
        return init_device_mesh("cpu", grid, mesh_dim_names=names)


def _halo_case(grid, args) -> dict:
    """Forward + backward of the 2-D U-Net on a strip (grid (N,)) or a tile (grid (p, q))."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize

    torch.manual_seed(0)
    model = create_model("unet", num_classes=3, depth=args.depth, base_width=args.base_width)
    mesh = _mesh(grid)
    placements = [Shard(3)] if len(grid) == 1 else [Shard(2), Shard(3)]
    try:
        model = parallelize(model, mesh)
        img = torch.randn(1, 3, args.height, args.width, generator=torch.Generator().manual_seed(1))
        x = distribute_tensor(img, mesh, placements)
        model(x).sum().backward()  # warm-up (plans, buffers)
    except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"}
    stats = model.spatial_runtime.stats
    times = []
    stats.reset()
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        model(x.detach().requires_grad_()).sum().backward()
        times.append(time.perf_counter() - t0)
    return {"bytes": stats.halo_bytes / args.iters, "s": statistics.median(times)}


def _volume_case(world: int, dim: int, args) -> dict:
    """Activations the 3-D U-Net's forward leaves alive, per rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize
    from spconv_train.parallel._step_meters import LiveBytes

    torch.manual_seed(0)
    model = create_model("unet3d", num_classes=3, in_channels=1, depth=2, base_width=4)
    d = args.volume
    vol = torch.randn(1, 1, d, d, d, generator=torch.Generator().manual_seed(2))
    if dim == "plain":  # the single-device model, not parallelized: the reference
        x = vol
    else:  # dim 2 (D) or 4 (W) over ("sp",), or "hw": H x W tiles over a 2 x 2 mesh
        by_ref = args.save_windows == "on"
        mesh = _mesh((2, 2) if dim == "hw" else (world,))
        model = parallelize(model, mesh, save_windows_by_reference=by_ref)
        pl = [Shard(3), Shard(4)] if dim == "hw" else [Shard(dim)]
        x = distribute_tensor(vol, mesh, pl)
    with LiveBytes() as meter:
        y = model(x)
    live = meter.live()
    del y
    return {"live": live}


def _worker(rank, world, port, job, args, queue) -> None:
    from spconv_train.distributed.cpu_malloc import tune_cpu_allocator

    torch.set_num_threads(1)
    tune_cpu_allocator()  # as a CPU run does (spconv_train/distributed/cpu_malloc.py)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=30),
    )
    try:
        kind, spec = job
        out = _halo_case(spec, args) if kind == "halo" else _volume_case(world, spec, args)
        queue.put((rank, out))
    finally:
        shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def _run(world: int, job, args) -> list[dict]:
    res = dict(spawn_ranks(_worker, world, job, args, timeout=3600))
    return [res[r] for r in range(world)]


def _halo_table(args) -> list[str]:
    h, w = args.height, args.width
    rows = ["| layout | ranks | halo MB / rank / step (max) | s / step | source |"]
    rows.append("|---|---|---|---|---|")
    strip = None
    for grid in [(4,), (2, 2)]:
        res = _run(4, ("halo", grid), args)
        name = "1x4 strips (W)" if len(grid) == 1 else "2x2 tiles (H x W)"
        if "error" in res[0]:
            rows.append(f"| {name} | 4 | - | - | refused: {res[0]['error']} |")
            continue
        mb = max(r["bytes"] for r in res) / 1e6
        strip = mb if len(grid) == 1 else strip
        sec = max(r["s"] for r in res)
        rows.append(f"| {name} | 4 | {mb:.2f} | {sec:.3f} | measured |")
    if strip is not None:
        for p, q in [(1, 16), (4, 4)]:
            ratio = 1.0 if p == 1 else (h / p + w / q) / h
            name = f"{p}x{q} {'strips (W)' if p == 1 else 'tiles (H x W)'}"
            rows.append(f"| {name} | 16 | {strip * ratio:.2f} | - | modelled from 1x4 |")
    return rows


def _volume_table(args) -> list[str]:
    rows = [
        "| split | ranks | live act. MiB / rank (max) | x (one rank / N) |",
        "|---|---|---|---|",
    ]
    plain = _run(1, ("volume", "plain"), args)[0]["live"]
    one = _run(1, ("volume", 4), args)[0]["live"]
    for dim, name, worlds in [(2, "D", (1, 2, 4)), (4, "W", (1, 2, 4)), ("hw", "H x W", (4,))]:
        for world in worlds:
            live = one if world == 1 else max(r["live"] for r in _run(world, ("volume", dim), args))
            rows.append(f"| {name} | {world} | {live / 2**20:.1f} | {live / (one / world):.2f} |")
    rows.append(f"| one device, plain model | 1 | {plain / 2**20:.1f} | {plain / one:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3, help="2-D U-Net depth")
    ap.add_argument("--base-width", type=int, default=8)
    ap.add_argument("--volume", type=int, default=32, help="3-D U-Net volume edge (D=H=W)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    ap.add_argument(
        "--part", choices=("all", "halo", "volume"), default="all", help="which table(s)"
    )
    ap.add_argument(
        "--save-windows",
        choices=("on", "off"),
        default="on",
        help="3-D U-Net: parallelize(save_windows_by_reference=...)",
    )
    args = ap.parse_args(argv)
    print(
        f"2-D U-Net depth {args.depth}, base width {args.base_width}, 1x3x{args.height}x"
        f"{args.width}; 3-D U-Net depth 2, base width 4, 1x1x{args.volume}^3; CPU, gloo"
    )
    parts = {"halo": _halo_table, "volume": _volume_table}
    for name, table_of in parts.items():
        if args.part not in ("all", name):
            continue
        table = table_of(args)
        print("\n".join(table) if args.markdown else "\n".join(r.replace("|", " ") for r in table))
        print()


if __name__ == "__main__":
    main()
