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
    from spconv_train.train.loop import build_model

    cfg = load_config(config, sets, check_paths=False)
    torch.manual_seed(0)
    CheckpointManager.export(build_model(cfg).eval(), path, config=config_to_dict(cfg))


def run_one(model: Path, image: Path, out: Path, nproc: int, band_rows: str, timeout: int, sets=()):
    """One ``predict`` command (``sets``: its ``--set`` overrides); (wall seconds, per-rank
    stats, command output tail)."""
    stats = out / "stats"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPCONV_PREDICT_STATS": str(stats)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "spconv_train", "predict", str(model), str(image)]
    cmd += ["--out", str(out), "--nproc", str(nproc)]
    cmd += [] if band_rows == "auto" else ["--band-rows", band_rows]
    cmd += [word for text in sets for word in ("--set", text)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(stats.glob("rank*.json"))]
    return wall, ranks, proc.stdout.strip().splitlines()[-1:]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", nargs="+", default=["4", "16"], help="megapixels (square) or ROWSxCOLS"
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
            out = args.work / f"out_{h}x{w}_{n}"
            wall, ranks, tail = run_one(
                model, image, out, n, args.band_rows, args.timeout, args.predict_sets
            )
            row = {
                "mpx": h * w / 1e6,
                "shape": f"{h}x{w}",
                "ranks": n,
                "peak_rss_gb": max(r["peak_rss_mb"] for r in ranks) / 1024,
                "mpx_s": h * w / 1e6 / wall,
                "wall_s": wall,
                "read_s": max(r["read_s"] for r in ranks),
                "forward_s": max(r["forward_s"] for r in ranks),
            }
            rows.append(row)
            print(json.dumps(row), *tail, file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            image.unlink()
    _print(rows, args)
    return 0


def _print(rows: list[dict], args) -> None:
    head = ["image", "ranks", "peak RSS / rank", "Mpx/s", "wall", "read / rank", "forward / rank"]
    lines = [
        [
            f"{r['shape']} ({r['mpx']:.0f} Mpx)",
            str(r["ranks"]),
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
        f"{args.band_rows}, {time.strftime('%Y-%m-%d')}"
    )
    if args.markdown:
        print(f"\n{info}\n")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    print(info)
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for line in lines:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    raise SystemExit(main())
