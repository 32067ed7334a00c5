"""Benchmark: band-streamed ``spconv-train predict`` on big images, 1 and 2 ranks.

Generates test images of growing size (``--sizes``: squares of N megapixels, 10**6
pixels, or ``ROWSxCOLS``; uint8 RGB noise with discs), exports the default model
(``configs/unet.yaml``, randomly initialised, seeded) once, and runs the real command
``python -m spconv_train predict model.pt IMAGE --out ... --nproc N`` (automatic bands)
for every size and rank count. Each rank writes its peak RSS and its read / forward
seconds (``SPCONV_PREDICT_STATS``); the table shows the largest peak RSS over the ranks,
the image megapixels per second of wall time (whole command: start-up, the band plan's
probe, reads, forward, TIFF writing) and the read time per rank.

Images are written band by band (no image is ever held whole): ``--format npy`` (a
memory-mapped array, read by region) or ``tif`` (tiled, zlib-compressed; its region read
needs a tile-aware TIFF reader in ``spconv_train.data``).

Memory plans: ``--layouts bands tiles`` runs every size once per layout
(``--no-slide-tiles`` / ``--slide-tiles``) under ``--memory-gb`` and adds the plan each
run printed (recompute factor, estimated GB per rank) to its row; ``--plan-sizes`` prints
the plans of bigger slides without running them (the same probe of the model, in this
process, against ``--plan-memory-gb``).

Usage: ``python scripts/bench_predict.py [--sizes 16 100] [--ranks 1 2] [--markdown]``
(``make bench-predict``); files go to ``--work`` (default ``runs/bench_predict``) and are
removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _shape(size: str, multiple: int = 32) -> tuple[int, int]:
    """``(H, W)`` of ``size``: ``"16"`` = a square of 16 megapixels (sides a multiple of
    ``multiple``), ``"768x32768"`` = 768 rows of 32768 columns."""
    if "x" in size:
        h, w = (int(v) for v in size.split("x"))
        return h, w
    side = max(multiple, round(math.sqrt(float(size) * 1e6) / multiple) * multiple)
    return side, side


def _rows(h: int, w: int, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of the test image (``[rows, w, 3]`` uint8): noise plus discs
    on a fixed lattice, so that the model sees structure; deterministic per row."""
    rng = np.random.default_rng(start)
    band = rng.integers(0, 80, (stop - start, w, 3), dtype=np.uint8)
    yy = np.arange(start, stop)[:, None]
    xx = np.arange(w)[None, :]
    disc = ((yy % 97) - 48) ** 2 + ((xx % 89) - 44) ** 2 < 30**2
    band[disc, (start // 97) % 3] += 150
    return band


def make_image(path: Path, h: int, w: int, fmt: str, rows_per_write: int = 512) -> None:
    """Write the ``h x w`` test image to ``path`` band by band."""
    if fmt == "npy":
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(h, w, 3))
        for r in range(0, h, rows_per_write):
            arr[r : r + rows_per_write] = _rows(h, w, r, min(h, r + rows_per_write))
        arr.flush()
        del arr
        return
    import tifffile

    def tiles():
        for r in range(0, h, 512):
            band = _rows(h, w, r, min(h, r + 512))
            for c in range(0, w, 512):
                yield band[:, c : c + 512]

    tifffile.imwrite(
        path, data=tiles(), shape=(h, w, 3), dtype=np.uint8, tile=(512, 512),
        compression="zlib", photometric="rgb", bigtiff=h * w * 3 > 2**31, maxworkers=1,
    )  # fmt: skip


def export_model(path: Path, config: str, sets: list[str]) -> None:
    """The default model, randomly initialised (seed 0), exported with its config."""
    import torch

    from spconv_train.checkpoint import CheckpointManager
    from spconv_train.config import config_to_dict, load_config
    from spconv_train.models import build_model

    cfg = load_config(config, sets, check_paths=False)
    torch.manual_seed(0)
    CheckpointManager.export(build_model(cfg).eval(), path, config=config_to_dict(cfg))


def run_one(
    model: Path, image: Path, out: Path, nproc: int, band_rows: str, timeout: int, sets=(),
    extra=(),
):  # fmt: skip
    """One ``predict`` command (``sets``: its ``--set`` overrides, ``extra``: more options);
    (wall seconds, per-rank stats, the last output line and the plan line)."""
    stats = out / "stats"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPCONV_PREDICT_STATS": str(stats)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "spconv_train", "predict", str(model), str(image)]
    cmd += ["--out", str(out), "--nproc", str(nproc)]
    cmd += [] if band_rows == "auto" else ["--band-rows", band_rows]
    cmd += [word for text in sets for word in ("--set", text)]
    cmd += list(extra)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(stats.glob("rank*.json"))]
    plan = [line for line in proc.stdout.splitlines() if line.startswith("plan ")]
    return wall, ranks, proc.stdout.strip().splitlines()[-1:], plan[:1]


def plan_fields(line: str) -> dict:
    """Layout, recompute factor and estimated GB per rank of a printed plan line."""
    factor = re.search(r"recompute factor ([0-9.]+)", line)
    gb = re.search(r"~([0-9.]+) GB per rank", line)
    fixed = re.search(r"over ([0-9.]+) GB fixed", line)
    layout = "tiles" if ": tiles of" in line else "bands" if ": bands of" in line else "whole"
    piece = re.search(r": (tiles of [0-9]+ x [0-9]+|bands of [0-9]+ rows)", line)
    return {
        "layout": layout,
        "piece": piece.group(1) if piece else "whole image",
        "factor": float(factor.group(1)) if factor else 1.0,
        "planned_gb": float(gb.group(1)) if gb else float("nan"),
        "fixed_gb": float(fixed.group(1)) if fixed else float("nan"),
    }


def planned(config: str, sets: list[str], sizes: list[str], ranks: int, memory_gb: float,
            base_gb: float | None = None):  # fmt: skip
    """The plans of ``sizes`` at ``ranks`` strips, bands only and tiles first, from a probe
    of the exported model in this process (nothing is predicted); the fixed memory per
    rank is ``base_gb`` (default: this process's resident set)."""
    import torch

    from spconv_train.config import load_config
    from spconv_train.models import build_model
    from spconv_train.predict._memory_plan import choose_plan
    from spconv_train.predict._memory_probe import (
        current_bytes,
        io_bytes_per_pixel,
        probe_bytes_per_pixel,
    )
    from spconv_train.predict._receptive import analyse

    cfg = load_config(config, sets, check_paths=False)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    geometry = analyse(model, cfg.model.in_channels)
    bpp = probe_bytes_per_pixel(model, cfg.model.in_channels, geometry.stride)[0]
    bpp += io_bytes_per_pixel(cfg.model.in_channels, cfg.model.num_classes)
    base = int(base_gb * 1e9) if base_gb else current_bytes(torch.device("cpu"))
    rows = []
    for size in sizes:
        h, w = _shape(size)
        for tiles in (False, None):
            plan = choose_plan(
                h, w, (1, ranks), geometry.stride, geometry.margin, bpp, base,
                int(memory_gb * 1e9), tiles=tiles,
            )  # fmt: skip
            rows.append({"shape": f"{h}x{w}", "mpx": h * w / 1e6, "ranks": ranks,
                         "mode": "bands" if tiles is False else "tiles first",
                         **plan_fields(plan.describe()), "fits": plan.fits})  # fmt: skip
            print(plan.describe(), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", nargs="*", default=["4", "16"], help="megapixels (square) or ROWSxCOLS"
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--format", choices=("npy", "tif"), default="npy")
    p.add_argument("--band-rows", default="auto", help="'auto' or N (0 = whole image)")
    p.add_argument("--config", default=str(REPO / "configs" / "unet.yaml"))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--predict-set",
        dest="predict_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for the predict command, e.g. 'parallel.sp=[2, 2]' (H x W tiles)",
    )
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_predict")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per predict command")
    p.add_argument("--keep", action="store_true", help="keep the images and predictions")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--memory-gb", type=float, help="predict --memory-gb (per rank)")
    p.add_argument(
        "--layouts", nargs="+", choices=("auto", "bands", "tiles"), default=["auto"],
        help="bands: --no-slide-tiles; tiles: plan with tiles allowed (the default plan)",
    )  # fmt: skip
    p.add_argument("--plan-sizes", nargs="*", default=[], help="sizes to plan only")
    p.add_argument("--plan-memory-gb", type=float, default=4.0)
    p.add_argument(
        "--plan-base-gb", type=float,
        help="fixed memory per rank of the plans (default: the measured runs' plans, else "
        "this process's resident set)",
    )  # fmt: skip
    args = p.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "model.pt"
    export_model(model, args.config, args.sets)
    rows = []
    for size in args.sizes:
        h, w = _shape(size)
        image = args.work / f"image_{h}x{w}.{args.format}"
        start = time.perf_counter()
        make_image(image, h, w, args.format)
        print(f"# {h}x{w} ({h * w / 1e6:.0f} Mpx) written in "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        for n in args.ranks:
            for layout in args.layouts:
                out = args.work / f"out_{h}x{w}_{n}_{layout}"
                extra = ["--memory-gb", str(args.memory_gb)] if args.memory_gb else []
                extra += {"bands": ["--no-slide-tiles"], "tiles": []}.get(layout, [])
                wall, ranks, tail, plan = run_one(
                    model, image, out, n, args.band_rows, args.timeout, args.predict_sets, extra
                )
                row = {
                    "mpx": h * w / 1e6,
                    "shape": f"{h}x{w}",
                    "ranks": n,
                    "mode": {"bands": "bands", "tiles": "tiles first"}.get(layout, "auto"),
                    **plan_fields(plan[0] if plan else ""),
                    "peak_rss_gb": max(r["peak_rss_mb"] for r in ranks) * 2**20 / 1e9,
                    "mpx_s": h * w / 1e6 / wall,
                    "wall_s": wall,
                    "read_s": max(r["read_s"] for r in ranks),
                    "forward_s": max(r["forward_s"] for r in ranks),
                }
                rows.append(row)
                print(json.dumps(row), *tail, *plan, file=sys.stderr, flush=True)
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            image.unlink()
    if rows:
        _print(rows, args)
    if args.plan_sizes:
        base = args.plan_base_gb or max((r["fixed_gb"] for r in rows), default=None)
        plans = planned(
            args.config, args.sets, args.plan_sizes, max(args.ranks), args.plan_memory_gb, base
        )
        _print_plans(plans, args)
    return 0


def _print_plans(rows: list[dict], args) -> None:
    head = ["image", "ranks", "mode", "plan", "recompute factor", "planned GB / rank", "fits"]
    lines = [
        [f"{r['shape']} ({r['mpx']:.0f} Mpx)", str(r["ranks"]), r["mode"], r["piece"],
         f"{r['factor']:.2f}", f"{r['planned_gb']:.2f}", "yes" if r["fits"] else "no"]
        for r in rows
    ]  # fmt: skip
    print(f"\nplanned only (not run), budget {args.plan_memory_gb} GB per rank, fixed part "
          f"{rows[0]['fixed_gb']:.2f} GB\n")  # fmt: skip
    _table(head, lines, args.markdown)


def _print(rows: list[dict], args) -> None:
    head = ["image", "ranks", "mode", "plan", "recompute factor", "planned GB / rank",
            "peak RSS / rank", "Mpx/s", "wall", "read / rank", "forward / rank"]  # fmt: skip
    lines = [
        [
            f"{r['shape']} ({r['mpx']:.0f} Mpx)",
            str(r["ranks"]),
            r["mode"],
            r["piece"],
            f"{r['factor']:.2f}",
            f"{r['planned_gb']:.2f}",
            f"{r['peak_rss_gb']:.2f} GB",
            f"{r['mpx_s']:.2f}",
            f"{r['wall_s']:.0f} s",
            f"{r['read_s']:.1f} s",
            f"{r['forward_s']:.0f} s",
        ]
        for r in rows
    ]
    info = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {args.format} input, band rows "
        f"{args.band_rows}, memory {args.memory_gb or 'default'} GB per rank, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"\n{info}\n" if args.markdown else info)
    _table(head, lines, args.markdown)


def _table(head: list[str], lines: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for line in lines:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    raise SystemExit(main())
