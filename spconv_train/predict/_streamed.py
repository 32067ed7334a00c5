"""Band-streamed prediction of one big image on the ranks of one spatial group.

Every rank reads only its column strip of each band's rows (``read_rows_cols``), runs the
sharded model on it, keeps the band's own rows and sends them as 1-byte class indices (and,
with ``--probabilities``, K bytes of rounded softmax) plus the sampled pixels of the
downsampled overlay to the group's first rank, which appends them to the tiled TIFFs.
Peak memory per rank therefore follows the band height and the strip width, not the
image height. Which band plan is exact for which network and height is decided by
``choose_rows`` (see ``_receptive``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from spconv_train.data._readers import check_mask_values

from ._bands import Band, auto_band_rows, band_layout, read_mask_rows_cols
from ._receptive import CHECK_RTOL, StreamPlan, check_plan
from ._slide import SlideOptions, finish_streamed
from ._writers import OverlayCanvas, TiledTiffWriter, overlay_factor

__all__ = ["StreamOptions", "choose_rows", "predict_streamed"]


@dataclass(frozen=True)
class StreamOptions:
    """``--band-rows`` (None = auto, 0 = whole image), ``--approximate``, ``--probabilities``,
    the network's plan (from ``_receptive.analyse``; None when band_rows is 0) and the
    output options (``--format``, ``--geojson``, class names; ``_slide``)."""

    band_rows: int | None = None
    approximate: bool = False
    probabilities: bool = False
    plan: StreamPlan | None = None
    slide: SlideOptions = SlideOptions()


def _checked(predictor, plan: StreamPlan, h: int, rows: int) -> StreamPlan | None:
    """``plan`` (or its widened margin) when it is proven exact for height ``h`` on a probe
    column, else None. Every rank of the group checks; the worst result decides."""
    c = predictor.cfg.model.in_channels
    for candidate in (plan, plan.widened()):
        err = torch.tensor([check_plan(predictor.model, candidate, h, rows, c)])
        dist.all_reduce(err, dist.ReduceOp.MAX, group=predictor.space.group)
        if float(err) <= CHECK_RTOL:
            return candidate
    return None


def choose_rows(predictor, opts: StreamOptions, h: int, w: int, console) -> tuple | None:
    """``(band_rows, plan)`` for an image of ``h x w`` (band_rows 0 = one band, the whole
    image) or None for the in-memory PNG path (small image, no ``--probabilities``).
    Prints why an image that should be streamed is predicted whole."""
    wanted = opts.band_rows
    if wanted is None and opts.plan is not None:
        p, q = predictor.space.grid
        wanted = auto_band_rows(h, w, q, opts.plan, row_parts=p)
    banded = bool(wanted) and wanted < h
    if not banded:
        return (0, None) if opts.probabilities else None
    plan = opts.plan
    note = None
    if not plan.exact:
        note = f"the network cannot be streamed exactly: {plan.reason}"
    else:
        proven = _checked(predictor, plan, h, wanted)
        if proven is None:
            note = (
                f"bands of {wanted} rows are not exact at height {h} on a probe column "
                f"(e.g. resampling to sizes computed from the whole height; heights that "
                f"are multiples of {plan.stride} stream exactly)"
            )
        plan = proven or plan
    if note is None or opts.approximate:
        if note and predictor.rank == 0:
            console.print(f"[yellow]approximate[/] {note}; streaming anyway (--approximate)")
        return wanted, plan
    if predictor.rank == 0:
        console.print(
            f"[yellow]whole image[/] {note}; predicting it whole (memory grows with the "
            "image); --approximate streams it in bands instead"
        )
    return 0, None


def _gather(predictor, piece, failure) -> list | None:
    """The group's pieces on its first rank (None elsewhere); every rank raises together
    when any rank failed."""
    from ._run import _SHARED_ERRORS

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
        raise _SHARED_ERRORS.get(name, RuntimeError)(message)
    return parts


def _band_piece(predictor, args, band: Band, mask_path, cm, factor: int, probs: bool):
    """This rank's share of one band's kept rows (all of them on a strip, those of its
    tile on a tile; possibly none): (classes [m, n], probabilities or None, sampled
    overlay [m/f, n/f, 3])."""
    r0, r1 = band.rows
    logits, image, (ra, rb), (t0, t1) = predictor.logits(*args, rows=band.read)
    k0 = min(max(r0, t0), t1)  # the kept rows [k0, k1) of this rank's rows [t0, t1)
    k1 = max(min(r1, t1), k0)
    logits, image = logits[:, k0 - t0 : k1 - t0], image[:, k0 - t0 : k1 - t0]
    cls = logits.argmax(0)
    if mask_path is not None and k1 > k0:
        mask = read_mask_rows_cols(mask_path, (k0, k1), (ra, rb), **predictor.read)
        cfg = predictor.cfg
        k, ignore = cfg.model.num_classes, cfg.data.ignore_index
        check_mask_values(mask, mask_path, k, ignore, col_offset=ra, row_offset=k0)
        cm.update(cls[None].to(cm.local.device), mask[None].to(cm.local.device))
    rows = torch.arange(-(-k0 // factor) * factor, k1, factor) - k0
    cols = torch.arange(-(-ra // factor) * factor, rb, factor) - ra
    sampled = predictor.overlay(image[:, rows][:, :, cols], cls[rows][:, cols])
    prob = None
    if probs:
        prob = (logits.float().softmax(0) * 255).round().to(torch.uint8).permute(1, 2, 0)
        prob = prob.numpy()
    dtype = np.uint8 if predictor.cfg.model.num_classes <= 256 else np.uint16
    return cls.numpy().astype(dtype), prob, sampled.permute(1, 2, 0).numpy()


def predict_streamed(
    predictor, stem: str, args: tuple, mask_path, cm, rows: int, plan, out_dir: Path, probs: bool
) -> str:
    """Predict the image ``args = (path, h, w, c, width)`` band by band (``rows`` kept rows
    per band, 0 = one band); the group's first rank writes ``<stem>.tif`` (class indices),
    ``<stem>_probabilities.tif`` (``[H, W, K]`` uint8, softmax x 255) with ``probs``, and
    ``<stem>_overlay.png`` (downsampled when big). Returns a one-line summary on that rank
    ("" on the others)."""
    _, h, w, _, _ = args
    bands = band_layout(h, rows, plan) if rows else [Band((0, h), (0, h))]
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
    try:
        for band in bands:
            piece, failure = None, None
            try:
                piece = _band_piece(predictor, args, band, mask_path, cm, factor, probs)
            except Exception as exc:  # noqa: BLE001 - every rank stops together in _gather
                failure, piece = exc, {"error": type(exc).__name__, "message": str(exc)}
            parts = _gather(predictor, piece, failure)
            if lead:
                stitch = predictor.space.stitch_image
                writers[0].put(stitch([p[0] for p in parts])[:, :w])
                if probs:
                    writers[1].put(stitch([p[1] for p in parts])[:, :w])
                canvas.put(band.rows, stitch([p[2] for p in parts]))
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
    if len(bands) > 1:
        how += f" (+{plan.margin} context rows each side)"
    return f"{h}x{w}, {how} -> {out_dir}: {', '.join(names)}"
