"""Band-streamed prediction of one big image on the ranks of one spatial group.

Every rank reads only its column strip of each band's rows (``read_rows_cols``), runs the
sharded model on it, keeps the band's own rows and sends them as 1-byte class indices (and,
with ``--probabilities``, K bytes of rounded softmax) plus the sampled pixels of the
downsampled overlay to the group's first rank, which appends them to the tiled TIFFs.
Peak memory per rank therefore follows the band height and the strip width, not the
image height. Which band plan is exact for which network and height is decided by
``choose_pieces`` (``_memory_plan``, ``_receptive``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from spconv_train.data._readers import check_mask_values

from ._bands import Band, band_layout, read_mask_rows_cols
from ._memory_plan import MemoryPlan, choose_plan
from ._oom import OOM_NAMES, announce, fault_hook
from ._receptive import CHECK_RTOL, StreamPlan, check_plan
from ._slide import SlideOptions, finish_streamed
from ._writers import OverlayCanvas, TiledTiffWriter, overlay_factor

__all__ = ["StreamOptions", "choose_pieces", "memory_plan", "predict_streamed"]


@dataclass(frozen=True)
class StreamOptions:
    """``--band-rows`` (None = planned from memory, 0 = whole image), ``--approximate``,
    ``--probabilities``, ``--memory-gb`` and ``--slide-tiles`` (None = when it lowers the
    recompute factor), the network's plan (from ``_receptive.analyse``; None when
    band_rows is 0), the memory model (``_memory_probe``: bytes per pixel, fixed bytes,
    budget, how the bytes per pixel were found; set by ``run_predict``) and the output
    options (``--format``, ``--geojson``, class names; ``_slide``)."""

    band_rows: int | None = None
    approximate: bool = False
    probabilities: bool = False
    plan: StreamPlan | None = None
    memory_gb: float | None = None
    tiles: bool | None = None
    cost: tuple | None = None
    slide: SlideOptions = SlideOptions()


def _checked(predictor, plan: StreamPlan, pieces: dict[int, tuple[int, int]]) -> StreamPlan | None:
    """``plan`` (or its widened margin) when it is proven exact on a probe column (rows)
    and a probe row (columns) for every ``{axis: (image size, kept pixels)}``, else None.
    Every rank of the group checks; the worst result decides."""
    c = predictor.cfg.model.in_channels
    for candidate in (plan, plan.widened()):
        err = max(
            check_plan(predictor.model, candidate, n, kept, c, axis=axis)
            for axis, (n, kept) in pieces.items()
        )
        err = torch.tensor([err])
        dist.all_reduce(err, dist.ReduceOp.MAX, group=predictor.space.group)
        if float(err) <= CHECK_RTOL:
            return candidate
    return None


def memory_plan(predictor, opts: StreamOptions, h: int, w: int) -> MemoryPlan | None:
    """The memory plan of an ``h x w`` image (None without a band plan: whole images)."""
    if opts.plan is None or opts.cost is None:
        return None
    bpp, base, budget, _ = opts.cost
    k = predictor.cfg.model.num_classes
    out_bytes = (1 if k <= 256 else 2) + (k if opts.probabilities else 0)
    return choose_plan(
        h, w, predictor.space.grid, opts.plan.stride, opts.plan.margin, bpp, base, budget,
        band_rows=opts.band_rows, tiles=opts.tiles, extra_bytes_per_pixel=out_bytes,
    )  # fmt: skip


def choose_pieces(predictor, opts: StreamOptions, h: int, w: int, console) -> tuple | None:
    """``(band_rows, block_cols, plan)`` for an image of ``h x w`` (band_rows 0 = the whole
    height, block_cols 0 = the whole width) or None for the in-memory PNG path (an image
    that fits whole, no ``--probabilities``). Prints the memory plan, and why an image
    that should be streamed is predicted whole."""
    planned = memory_plan(predictor, opts, h, w)
    if planned is not None:
        announce(planned, opts.cost[3], predictor.rank == 0, console)
    rows, cols = (planned.band_rows, planned.block_cols) if planned else (0, 0)
    if not rows and not cols:
        return (0, 0, None) if opts.probabilities else None
    plan = opts.plan
    note = None
    if not plan.exact:
        note = f"the network cannot be streamed exactly: {plan.reason}"
    else:
        pieces = {axis: (n, k) for axis, n, k in ((2, h, rows), (3, w, cols)) if k}
        proven = _checked(predictor, plan, pieces)
        if proven is None:
            what = f"bands of {rows} rows are not exact at height {h} on a probe column"
            if cols:
                what = f"tiles of {rows or h} x {cols} px are not exact at size {h}x{w}"
            note = (
                f"{what} (e.g. resampling to sizes computed from the whole image; sizes "
                f"that are multiples of {plan.stride} stream exactly)"
            )
        plan = proven or plan
    if note is None or opts.approximate:
        if note and predictor.rank == 0:
            console.print(f"[yellow]approximate[/] {note}; streaming anyway (--approximate)")
        return rows, cols, plan
    if predictor.rank == 0:
        console.print(
            f"[yellow]whole image[/] {note}; predicting it whole (memory grows with the "
            "image); --approximate streams it in bands instead"
        )
    return 0, 0, None


def _gather(predictor, piece, failure) -> list | None:
    """The group's pieces on its first rank (None elsewhere); every rank raises together
    when any rank failed."""
    from ._errors import SHARED_ERRORS

    group = predictor.space.group
    lead = dist.get_global_rank(group, 0)
    parts = [None] * predictor.sp if predictor.rank == 0 else None
    dist.gather_object(piece, parts, dst=lead, group=group)
    errors = [next((p for p in parts if isinstance(p, dict)), None) if parts else None]
    dist.broadcast_object_list(errors, src=lead, group=group)
    if failure is not None:
        raise failure
    if errors[0] is not None:
        name, message = errors[0]["error"], errors[0]["message"]
        raise SHARED_ERRORS.get(name, MemoryError if name in OOM_NAMES else RuntimeError)(message)
    return parts


def _band_piece(predictor, args, band: Band, block: Band | None, mask_path, cm, factor, probs):
    """This rank's share of the kept pixels of one band (``block``: of one tile of it;
    None: the full width): all of a strip's rows, those of its tile on a tile, possibly
    none. (classes [m, n], probabilities or None, sampled overlay [m/f, n/f, 3])."""
    (r0, r1), (c0, c1) = band.rows, (block.rows if block else (0, args[2]))
    cols = block.read if block else None
    logits, image, (ra, rb), (t0, t1) = predictor.logits(*args, rows=band.read, cols=cols)
    fault_hook()  # after the forward, which every rank of the group runs together
    k0 = min(max(r0, t0), t1)  # the kept rows [k0, k1) of this rank's rows [t0, t1)
    k1 = max(min(r1, t1), k0)
    j0 = min(max(c0, ra), rb)  # the kept columns [j0, j1) of its columns [ra, rb)
    j1 = max(min(c1, rb), j0)
    logits = logits[:, k0 - t0 : k1 - t0, j0 - ra : j1 - ra]
    image = image[:, k0 - t0 : k1 - t0, j0 - ra : j1 - ra]
    cls = logits.argmax(0)
    if mask_path is not None and k1 > k0 and j1 > j0:
        mask = read_mask_rows_cols(mask_path, (k0, k1), (j0, j1), **predictor.read)
        cfg = predictor.cfg
        k, ignore = cfg.model.num_classes, cfg.data.ignore_index
        check_mask_values(mask, mask_path, k, ignore, col_offset=j0, row_offset=k0)
        cm.update(cls[None].to(cm.local.device), mask[None].to(cm.local.device))
    rows = torch.arange(-(-k0 // factor) * factor, k1, factor) - k0
    cols = torch.arange(-(-j0 // factor) * factor, j1, factor) - j0
    sampled = predictor.overlay(image[:, rows][:, :, cols], cls[rows][:, cols])
    prob = None
    if probs:
        prob = (logits.float().softmax(0) * 255).round().to(torch.uint8).permute(1, 2, 0)
        prob = prob.numpy()
    dtype = np.uint8 if predictor.cfg.model.num_classes <= 256 else np.uint16
    return cls.numpy().astype(dtype), prob, sampled.permute(1, 2, 0).numpy()


def _stitched(predictor, args, band, block, mask_path, cm, factor, probs) -> list | None:
    """One piece (a band, or one tile of it) predicted by the group and stitched on its
    first rank: [classes, probabilities or None, sampled overlay] (None elsewhere)."""
    piece, failure = None, None
    try:
        piece = _band_piece(predictor, args, band, block, mask_path, cm, factor, probs)
    except Exception as exc:  # noqa: BLE001 - every rank stops together in _gather
        failure, piece = exc, {"error": type(exc).__name__, "message": str(exc)}
    parts = _gather(predictor, piece, failure)
    if predictor.rank != 0:
        return None
    stitch = predictor.space.stitch_image
    return [stitch([p[i] for p in parts]) if parts[0][i] is not None else None for i in range(3)]


def predict_streamed(
    predictor, stem: str, args: tuple, mask_path, cm, pieces: tuple, out_dir: Path, probs: bool
) -> str:
    """Predict the image ``args = (path, h, w, c, width)`` piece by piece (``pieces =
    (band rows, tile columns, plan)`` from ``choose_pieces``: full-width bands when the
    tile columns are 0, one band when the rows are 0); the group's first rank writes
    ``<stem>.tif`` (class indices), ``<stem>_probabilities.tif`` (``[H, W, K]`` uint8,
    softmax x 255) with ``probs``, and ``<stem>_overlay.png`` (downsampled when big), band
    by band. Returns a one-line summary on that rank ("" on the others)."""
    _, h, w, _, _ = args
    rows, cols, plan = pieces
    bands = band_layout(h, rows, plan) if rows else [Band((0, h), (0, h))]
    blocks = band_layout(w, cols, plan) if cols else [None]
    factor = overlay_factor(h, w)
    k = predictor.cfg.model.num_classes
    lead = predictor.rank == 0
    writers: list[TiledTiffWriter] = []
    if lead:
        dtype = np.uint8 if k <= 256 else np.uint16
        writers.append(TiledTiffWriter(out_dir / f"{stem}.tif", (h, w), dtype))
        if probs:
            path = out_dir / f"{stem}_probabilities.tif"
            writers.append(TiledTiffWriter(path, (h, w, k), np.uint8))
        canvas = OverlayCanvas(h, w, factor)
    progress = predictor.progress
    progress.image(stem, len(bands) * len(blocks))
    try:
        for band in bands:
            done = []
            for block in blocks:
                done.append(_stitched(predictor, args, band, block, mask_path, cm, factor, probs))
                progress.advance()
            if lead:  # the tiles of a band side by side: its full width
                cls, prob, sampled = (
                    np.concatenate([d[i] for d in done], axis=1) if done[0][i] is not None
                    else None for i in range(3)
                )  # fmt: skip
                writers[0].put(cls[:, :w])
                if probs:
                    writers[1].put(prob[:, :w])
                canvas.put(band.rows, sampled)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    if not lead:
        return ""
    for writer in writers:
        writer.close()
    canvas.save(out_dir / f"{stem}_overlay.png")
    written = [wr.path for wr in writers]  # single-level TIFFs: into the --format asked for
    names = finish_streamed(written, args[0], predictor.read["level"], k, predictor.stream.slide)
    names.append(f"{stem}_overlay.png")
    if factor > 1:
        names[-1] += f" (1/{factor} scale)"
    how = "whole" if len(bands) == 1 else f"{len(bands)} bands of {rows} rows"
    if len(blocks) > 1:
        how = f"{len(bands)} x {len(blocks)} tiles of {rows or h} x {cols} px"
    if len(bands) * len(blocks) > 1:
        how += f" (+{plan.margin} context px each side)"
    return f"{h}x{w}, {how} -> {out_dir}: {', '.join(names)}"
