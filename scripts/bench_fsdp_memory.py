"""Benchmark: bytes per rank of parameters, gradients and optimizer state, with and without
FSDP (``parallel.fsdp``), for a large encoder.

The model (default: smp ``Unet`` on timm's ``tu-convnext_base``, random initialisation,
nothing downloaded) is built on the meta device, parallelized over a ``("dp", "sp")`` mesh of
``1 x N`` ranks, sharded with ``shard_parameters`` (``fsdp``) or left replicated, then
materialised on the device (``to_empty``: an FSDP rank never allocates the whole model), and
trained one AdamW step on a small image. Then the tensors each rank actually holds are
counted: the distinct storages of the parameters (FSDP: the local, padded shards), of their
``.grad`` (FSDP: the reduce-scatter output the sharded gradients view) and of the optimizer
state (moments and step counters). Activations and BatchNorm buffers are not counted. The
target (issue 25): FSDP at most 1.1x (replicated / world).

Memory: a replicated rank holds about 16 bytes per parameter (1.4 GiB for convnext_base)
whatever the number of ranks; ``--replicated-worlds 1`` measures that once instead of on
every rank of every world size (the ratio column needs the one-rank replicated run).

Usage: ``python scripts/bench_fsdp_memory.py [--encoder tu-convnext_base --worlds 1 2 4
--modes replicated fsdp --markdown]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import add_run_args, init_worker, machine, print_table, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _materialise(model, device: str) -> None:
    """Storage for the (local shards of the) meta parameters and buffers: random weights,
    fresh BatchNorm statistics."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).normal_(0.0, 0.02, generator=g)
        for m in model.modules():
            if hasattr(m, "reset_running_stats"):
                m.reset_running_stats()


def _worker(rank: int, world: int, port: int, mode: str, args, queue) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize, shard_parameters
    from spconv_train.train import cross_entropy
    from spconv_train.train.optim import checkpoint_blocks

    dev = args.device
    init_worker(rank, world, port, args)
    from spconv_train.distributed import build_mesh

    mesh = build_mesh(1, world, dev)
    try:
        with torch.device("meta"):
            model = create_model(
                "smp.Unet", num_classes=4, in_channels=3, encoder_name=args.encoder
            )
        total = sum(p.numel() for p in model.parameters())
        model = parallelize(model, mesh, sync_state=False)  # materialised alike below
        if mode == "fsdp":
            shard_parameters(model, checkpoint_blocks(model))
        _materialise(model, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        img = torch.randn(1, 3, args.height, args.width, generator=g).to(dev)
        target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(dev)
        x = distribute_tensor(img, mesh, [Shard(0), Shard(3)], src_data_rank=None)
        cross_entropy(model(x), target).backward()
        opt.step()
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        counts = (_storage_bytes(params), _storage_bytes(grads), _storage_bytes(state))
        queue.put((rank, None, total, counts))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        queue.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", 0, ()))
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--encoder", default="tu-convnext_base")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="+", default=["replicated", "fsdp"])
    ap.add_argument(
        "--replicated-worlds",
        type=int,
        nargs="+",
        help="world sizes of the replicated runs (default: --worlds)",
    )
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=512)
    add_run_args(ap)
    args = ap.parse_args(argv)
    print(
        f"smp Unet on {args.encoder} (random init), AdamW, one step on 1x3x{args.height}x"
        f"{args.width}, {args.device}; " + machine(),
        file=sys.stderr,
    )
    mib = 2**20
    header = ("ranks", "mode", "params MiB", "grads MiB", "optimizer MiB", "total MiB/rank")
    header += ("vs replicated / world",)
    rows, replicated = [], None
    for mode in args.modes:
        worlds = args.worlds
        if mode == "replicated" and args.replicated_worlds:
            worlds = args.replicated_worlds
        for world in worlds:
            res = spawn_ranks(_worker, world, mode, args)
            errors = [r[1] for r in res if r[1]]
            if errors:
                rows.append((world, mode, "fails", errors[0], "", "", ""))
                continue
            counts = max((r[3] for r in res), key=sum)  # the rank holding the most
            total = sum(counts)
            if mode == "replicated" and world == 1:
                replicated = total
            ratio = f"{total / (replicated / world):.3f}x" if replicated else "-"
            cells = [f"{c / mib:,.1f}" for c in counts]
            rows.append((world, mode, *cells, f"{total / mib:,.1f}", ratio))
            print(f"  {res[0][2]:,} parameters: " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    print_table(header, rows, args.markdown, width=14)


if __name__ == "__main__":
    main()
