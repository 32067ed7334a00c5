"""Benchmark: ring attention over a sequence split across ranks vs the no-communication
floor vs one process.

Forward + backward of ``F.scaled_dot_product_attention`` on ``1 x heads x L x E`` fp32
tokens, one thread per process, gloo on CPU, as ``L`` grows. Rows:

- ``one process``: plain SDPA on the whole sequence (1 rank);
- ``floor (no comm)``: every rank attends its own ``L / P`` tokens to its own tokens only,
  no communication: the lower bound of any exact scheme (it computes ``1 / P`` of the
  scores);
- ``compute floor (no comm)``: every rank attends its own queries to *all* keys and values,
  already local (no communication): the work of exact attention per rank, the lower bound
  of the ring's time (its memory holds the whole key / value sequence: not a memory row);
- ``ring (spconv)``: ``spconv_train.parallel._ring.ring_attention``: exact attention of each
  rank's queries to all keys, key / value blocks passed around the ring in ``m`` pieces
  (``_ring.py``; ``m`` automatic, ``_ring.auto_pieces``, or ``--pieces``);
- ``ring, whole blocks (m = 1)``: the same with each block sent whole;
- ``ring (PhysicsNeMo)``: NVIDIA PhysicsNeMo's ring attention (``F.scaled_dot_product_attention``
  on ``ShardTensor`` sequence shards, ``scripts/_bench_physicsnemo.py``), only when
  ``physicsnemo`` is importable (not a dependency, see docs/benchmarks.md to install it). Its
  ring needs CUDA (PhysicsNeMo 2.2.2 computes each block with the memory-efficient SDPA
  kernel, which has no CPU kernel): on CPU the row says so; ``--device cuda`` (NCCL, one GPU
  per rank) measures it. Its note: the max abs difference of its output from plain SDPA.

Columns: "ms/step" median over the rounds (max over the ranks); "x floor" / "x compute
floor" the time over the floor's / the compute floor's; "peak MiB/rank": the peak of the
bytes held by live tensors during the step (inputs, outputs, gradients, saved tensors,
communication buffers; counted exactly by a dispatch mode, independent of the allocator),
worst rank; "x one process" that peak over
the one-process peak. Variants run in fresh processes, interleaved over ``--rounds``.

Usage: ``python scripts/bench_attention.py [--lengths 1024 2048 4096 --world 2]``
(``PYTHONPATH=.:.physicsnemo`` adds the PhysicsNeMo row);
``--markdown`` prints the table as Markdown for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_conv import (
    _physicsnemo_importable,
    _time_steps,
    init_worker,
    print_table,
    spawn_ranks,
)

from spconv_train.distributed import shutdown
from spconv_train.parallel._step_meters import PeakBytes

VARIANTS = (
    "one process",
    "floor (no comm)",
    "compute floor (no comm)",
    "ring (spconv)",
    "ring, whole blocks (m = 1)",
)
PHYSICSNEMO = "ring (PhysicsNeMo)"


def _worker(rank: int, world: int, port: int, variant: str, args, queue) -> None:
    """One variant at every length in a fresh process: ``{L: (seconds, peak MiB, note)}``,
    or ``None`` and why when the variant cannot run here."""
    from spconv_train.parallel._geometry import all_shard_bounds
    from spconv_train.parallel._ring import ring_attention

    mesh = init_worker(rank, world, port, args)
    device = torch.device(args.device)
    found = {}
    for length in args.lengths:
        bounds = all_shard_bounds(length, world)
        a, b = (0, length) if variant == "one process" else bounds[rank]
        sizes = tuple(hi - lo for lo, hi in bounds)
        kv_len = length if variant == "compute floor (no comm)" else b - a
        note = ""
        if variant == PHYSICSNEMO:
            from _bench_physicsnemo import physicsnemo_attention_step

            try:
                shape = (1, args.heads, length, args.dim)
                step, diff = physicsnemo_attention_step(shape, sizes, mesh, device)
            except Exception as exc:  # noqa: BLE001 - report, don't crash the benchmark
                queue.put((rank, None, f"not run: {exc}"))
                shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)
                return
            note = f"max abs diff {diff:.1e}"

        def plain_step(a=a, b=b, sizes=sizes, kv_len=kv_len) -> None:
            torch.manual_seed(rank)
            q = torch.randn(1, args.heads, b - a, args.dim, device=device).requires_grad_()
            k, v = (
                torch.randn(1, args.heads, kv_len, args.dim, device=device).requires_grad_()
                for _ in "kv"
            )
            if variant.startswith("ring"):
                m = 1 if variant.endswith("(m = 1)") else args.pieces
                out = ring_attention(q, k, v, dist.group.WORLD, sizes, pieces=m)
            else:
                out = F.scaled_dot_product_attention(q, k, v)
            out.backward(torch.ones_like(out))

        if variant != PHYSICSNEMO:
            step = plain_step
        sec = _time_steps(step, args.iters, args.warmup, args.device)
        with PeakBytes() as meter:
            step()
        found[length] = (sec, meter.peak / 2**20, note)
    queue.put((rank, found, ""))
    shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="head size E")
    ap.add_argument("--pieces", type=int, default=None, help="ring pieces m (default: automatic)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank"
    )
    args = ap.parse_args(argv)
    variants = VARIANTS + ((PHYSICSNEMO,) if _physicsnemo_importable() else ())
    runs: dict[tuple[int, str], list] = {}
    notes: dict[tuple[int, str], str] = {}
    for _ in range(args.rounds):
        for variant in variants:
            world = 1 if variant == "one process" else args.world
            res = spawn_ranks(_worker, world, variant, args)
            for length in args.lengths:
                if any(r[1] is None for r in res):  # cannot run here: say why, no numbers
                    notes[(length, variant)] = res[0][2]
                    runs.setdefault((length, variant), []).append((float("nan"),) * 2)
                    continue
                sec = max(r[1][length][0] for r in res)
                mem = max(r[1][length][1] for r in res)
                notes[(length, variant)] = res[0][1][length][2]
                runs.setdefault((length, variant), []).append((sec, mem))
    rows = []
    for length in args.lengths:
        med = {
            v: tuple(statistics.median(r[i] for r in runs[(length, v)]) for i in range(2))
            for v in variants
        }
        floor, compute, one = (
            med[v] for v in ("floor (no comm)", "compute floor (no comm)", "one process")
        )
        for v in variants:
            sec, mem = med[v]
            world = 1 if v == "one process" else args.world
            if math.isnan(sec):  # not run here: the note says why
                rows.append((length, v, world, "-", "", "", "-", "", notes[(length, v)]))
                continue
            rows.append(
                (
                    length,
                    v,
                    world,
                    f"{sec * 1e3:.1f}",
                    f"{sec / floor[0]:.2f}" if world > 1 else "",
                    f"{sec / compute[0]:.2f}" if world > 1 else "",
                    f"{mem:.1f}",
                    f"{mem / one[1]:.2f}",
                    notes[(length, v)],
                )
            )
    header = (
        "L",
        "variant",
        "ranks",
        "ms/step",
        "x floor",
        "x compute floor",
        "peak MiB/rank",
        "x one process",
        "note",
    )
    print_table(header, rows, args.markdown, width=14)


if __name__ == "__main__":
    main()
