"""The sharded prediction loop of ``spconv-train predict`` (see the package docstring)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.api import CheckpointException

from spconv_train.checkpoint.files import CheckpointError
from spconv_train.checkpoint.safe_load import load_checkpoint_state
from spconv_train.config import grid_mesh_dims, validate_for_world
from spconv_train.data import (
    check_mask_values,
    image_header,
    image_range,
    mask_header,
    normalization_range,
    normalize_image,
    read_image_raw,
    read_mask,
)
from spconv_train.distributed import build_mesh
from spconv_train.logging import class_colors
from spconv_train.models import build_model
from spconv_train.parallel import SpatialShardingError, parallelize
from spconv_train.train.mesh_coords import MeshCoords, to_dtensor
from spconv_train.train.metrics import ConfusionMatrix
from spconv_train.train.val_check import is_geometry_error

from ._checkpoint import PAD_MULTIPLE, any_size, load_export
from ._errors import SHARED_ERRORS, ImagesFailed, PredictError
from ._layout import SpatialGroup
from ._memory_probe import plan_cost
from ._progress import PredictProgress
from ._receptive import analyse
from ._record import checkpoint_info, checkpoint_line, write_record
from ._slide import write_whole
from ._streamed import StreamOptions, choose_pieces, predict_streamed
from ._writers import write_rank_stats

#: ``data.normalize`` of an overlay: stretch the display range to [0, 1].
MINMAX = {"mode": "minmax"}

#: Errors every rank re-raises (by type and message) when one image fails on some rank.

__all__ = ["run_predict"]


def _overlay(image, pred, colors, alpha: float = 0.5):
    """uint8 RGB strip: the image blended with the colour of each pixel's class."""

    rgb = image[:3] if image.shape[0] >= 3 else image[:1].expand(3, -1, -1)
    rgb = rgb.clamp(0, 1) * 255
    blend = (1 - alpha) * rgb + alpha * colors[pred.long()].permute(2, 0, 1)
    return blend.round().to(torch.uint8)


class _Predictor:
    """One image at a time on this rank's strip or tile (see the module docstring)."""

    def __init__(self, cfg, model, space, device, stream=None, out_dir=None, console=None):

        self.cfg, self.model, self.space, self.device = cfg, model, space, device
        self.sp, self.rank = space.size, space.rank
        self.colors = torch.tensor(class_colors(cfg.model.num_classes), dtype=torch.float32)
        self.stream, self.out_dir = stream or StreamOptions(band_rows=0), out_dir
        self.console, self.progress = console, PredictProgress(0, False)  # set by run_predict
        self.timing = {"read_s": 0.0, "forward_s": 0.0}  # this rank's, for the benchmark
        d = cfg.data
        self.read = {"level": d.level, "max_pixels": d.max_image_pixels}
        # Per image: the whole image's normalisation statistics (as in training) and the
        # display range of its overlay (the same on every rank: no seams between strips).
        self.stats = self.display = None

    def _image_ranges(self, path: Path) -> None:
        norm = self.cfg.data.normalize
        self.stats = normalization_range(path, norm, **self.read)
        if norm.mode in ("minmax", "percentile"):  # the input is contrast-stretched already
            self.display = None
        else:  # auto-contrast the overlay: 0.5-99.5 percentiles of the whole image
            self.display = image_range([path], "percentile", [0.5, 99.5], **self.read)

    def logits(self, path: Path, h: int, w: int, c: int, width: int, rows=None, cols=None):
        """(logits piece [K, m, n] on the CPU, display image piece [C, m, n] in [0, 1] for
        the overlay, its columns (a, b), its rows (r, s)) of the image padded to ``width``
        columns, cropped back to the original ``w``; ``rows`` and ``cols`` (default all) are
        the region read and predicted (a band, a tile), of which this rank holds its share."""
        c0, c1 = cols or (0, width)
        a, b = (c0 + t for t in self.space.cols(c1 - c0))
        ra, rb = min(a, w), min(b, w)
        r0, r1 = rows or (0, h)
        t0, t1 = (r0 + t for t in self.space.rows(r1 - r0))
        start = time.perf_counter()
        raw = read_image_raw(path, (ra, rb), (t0, t1), **self.read)
        image = normalize_image(raw, self.cfg.data.normalize, self.stats)
        shown = image if self.display is None else normalize_image(raw, MINMAX, self.display)
        self.timing["read_s"] += time.perf_counter() - start
        padded = F.pad(image, (0, (b - a) - (rb - ra)))
        shape = (1, c, r1 - r0, c1 - c0)
        x = to_dtensor(padded[None].to(self.device), self.space.mesh, self.space.placements, shape)
        bf16 = self.cfg.training.precision == "bf16"
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(self.device.type, torch.bfloat16, enabled=bf16):
            logits = self.model(x)
        self.timing["forward_s"] += time.perf_counter() - start
        return logits.to_local()[0, :, :, : rb - ra].cpu(), shown, (ra, rb), (t0, t1)

    def forward(self, path: Path, h: int, w: int, c: int, width: int):
        """(prediction piece [m, n], image piece [C, m, n], (a, b), (r, s)) for the image
        padded to ``width`` columns, cropped back to the original ``w``."""
        logits, image, cols, rows = self.logits(path, h, w, c, width)
        return logits.argmax(0), image, cols, rows

    def overlay(self, image, pred):
        """uint8 RGB overlay of an image strip and its predicted classes."""
        return _overlay(image, pred, self.colors)

    def _padded(self, run, path: Path, h: int, w: int):
        """``run(width)`` at the image's width, else (a strip too narrow for the network)
        at the width padded to a multiple of ``PAD_MULTIPLE * sp``; (result, width)."""
        try:
            return run(w), w
        except (SpatialShardingError, RuntimeError) as first:
            if not self._too_narrow(first):
                raise
            step = PAD_MULTIPLE * self.space.grid[1]  # ranks along the width
            width = math.ceil(w / step) * step
            if width == w:
                raise self._narrow_error(path, h, w, first, None) from first
            try:
                return run(width), width
            except (SpatialShardingError, RuntimeError) as exc:
                if not self._too_narrow(exc):
                    raise
                raise self._narrow_error(path, h, w, first, (width, exc)) from exc

    def _too_narrow(self, exc: Exception) -> bool:
        """Whether the forward failed on the image's geometry, so padding may help and
        going on with the next image is safe (see ``is_geometry_error``)."""
        return is_geometry_error(exc, self.sp)

    def _narrow_error(self, path, h, w, first, padded) -> SpatialShardingError:
        """The same clear message at any number of ranks (the padded attempt, if any, is
        ``(width, its error)``)."""
        tried = f", not even padded to {padded[0]} columns ({padded[1]})" if padded else ""
        fix = "the image may be smaller than the model's down-sampling needs (height or width)"
        if self.sp > 1:
            fix = "use fewer ranks (--nproc) or --set parallel.sp=<smaller>, or " + fix
        p, q = self.space.grid
        over = f"a grid of {p}x{q} tiles" if self.space.coords.tiled else f"sp={self.sp} rank(s)"
        return SpatialShardingError(
            f"{path}: image {h}x{w} (HxW) cannot be run by this model over {over}{tried}; "
            f"{fix}. Unpadded: {first}"
        )

    def __call__(self, stem: str, path: Path, mask_path: Path | None, cm) -> tuple:

        h, w, c = image_header(path, **self.read)
        self._image_ranges(path)
        if c != self.cfg.model.in_channels:
            raise PredictError(
                f"{path}: {c} channels, the model takes {self.cfg.model.in_channels}"
            )
        if mask_path is not None and mask_header(mask_path, **self.read)[:2] != (h, w):
            raise PredictError(f"{mask_path}: mask size differs from image {path.name} ({h}x{w})")
        choice = choose_pieces(self, self.stream, h, w, self.console)
        if choice is not None:  # big image (or --probabilities): tiled TIFFs, band by band

            def run(width: int) -> str:
                args = (path, h, w, c, width)
                probs = self.stream.probabilities
                return predict_streamed(
                    self, stem, args, mask_path, cm, choice, self.out_dir, probs
                )

            summary, width = self._padded(run, path, h, w)
            return stem, self.rank, None, summary, (w, width)
        self.progress.image(stem, 1)
        (pred, image, cols, rows), width = self._padded(
            lambda width: self.forward(path, h, w, c, width), path, h, w
        )
        self.progress.advance()
        if mask_path is not None:
            mask = read_mask(mask_path, cols, rows, **self.read)
            k, ignore = self.cfg.model.num_classes, self.cfg.data.ignore_index
            check_mask_values(mask, mask_path, k, ignore, col_offset=cols[0], row_offset=rows[0])
            cm.update(pred[None].to(cm.local.device), mask[None].to(cm.local.device))
        small = pred.to(torch.uint8 if self.cfg.model.num_classes <= 256 else torch.int32)
        return stem, self.rank, small, _overlay(image, pred, self.colors), (w, width)


def _write(out_dir: Path, stem: str, parts: list[tuple], predictor, src: Path) -> tuple:
    """Stitch the strips or tiles of one image (by sp rank), write its mask (in the
    ``--format`` asked for) and overlay PNG; ``(H, W, [file names])``."""
    parts.sort(key=lambda q: q[0])
    pred = predictor.space.stitch_image([q[1].numpy() for q in parts])
    overlay = predictor.space.stitch_image([q[2].permute(1, 2, 0).numpy() for q in parts])
    k, level = predictor.cfg.model.num_classes, predictor.read["level"]
    names = write_whole(out_dir, stem, pred, src, level, k, predictor.stream.slide)
    Image.fromarray(np.ascontiguousarray(overlay)).save(out_dir / f"{stem}_overlay.png")
    return (*pred.shape, [*names, f"{stem}_overlay.png"])


def _metrics_json(cm, names: list[str], n_images: int) -> dict:
    def num(x: float) -> float | None:
        return None if math.isnan(x) else x

    m = cm.metrics()
    classes = [
        {"name": n, "iou": num(i), "dice": num(d), "accuracy": num(a)}
        for n, i, d, a in zip(names, m["iou"], m["dice"], m["class_accuracy"], strict=True)
    ]
    keys = ("pixel_accuracy", "miou", "mean_dice", "mean_class_accuracy")
    return {
        "images": n_images,
        "pixels": m["pixels"],
        **{k: num(m[k]) for k in keys},
        "classes": classes,
        "confusion_matrix": cm.total.cpu().tolist(),
        "note": "miou, mean_dice, mean_class_accuracy are macro averages over the classes "
        "present in the masks or the predictions; confusion_matrix[target][prediction]",
    }


def _print_table(console, result: dict) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    table = Table(title=f"Per-class metrics over {result['images']} image(s)")
    for col in ("class", "IoU", "Dice", "Acc"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for c in result["classes"]:
        table.add_row(c["name"], fmt(c["iou"]), fmt(c["dice"]), fmt(c["accuracy"]))
    table.add_section()
    means = (result["miou"], result["mean_dice"], result["mean_class_accuracy"])
    table.add_row("mean (macro)", *map(fmt, means), style="bold")
    console.print(table)


def run_predict(
    cfg,
    kind: str,
    weights: str | Path,
    images: list[tuple],
    out_dir: str | Path,
    *,
    class_names: list[str] | None = None,
    console=None,
    stream: StreamOptions | None = None,
) -> dict | None:
    """Predict ``images`` (from ``_collect``) with the model of ``cfg`` and the checkpoint
    ``weights`` (``kind`` ``"dcp"`` or ``"export"``), inside an initialised process group
    (collective). Rank 0 writes the PNGs and, with masks, ``metrics.json``; returns the
    metrics dict (rank 0, masks given) or None. ``stream`` (default: automatic bands for
    big images) selects band-streamed prediction to tiled TIFFs (see ``_streamed``)."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    cfg = any_size(cfg)
    dp, sp = validate_for_world(cfg, dist.get_world_size())
    mesh = build_mesh(dp, sp, device.type, grid_mesh_dims(cfg))
    coords = MeshCoords.of(mesh)
    model = build_model(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=None))
    )
    try:
        if kind == "dcp":
            state = {"model": model.state_dict()}
            # fills the model's own tensors in place, unpickling nothing from the folder
            load_checkpoint_state(state, weights)
            model.load_state_dict(state["model"])
        else:
            model.load_state_dict(load_export(Path(weights))["model"])
    except PredictError:
        raise
    except CheckpointError as exc:  # a refused or corrupt file: it names the file and why
        raise PredictError(str(exc)) from None
    except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
        raise PredictError(
            f"{weights}: cannot load into the model of the config ({cfg.model.name}, "
            f"{cfg.model.num_classes} classes): {type(exc).__name__}: {exc}"
        ) from exc
    model = model.to(device).eval()
    stream = stream or StreamOptions()
    if class_names and not stream.slide.class_names:  # the outputs' class names
        slide = dataclasses.replace(stream.slide, class_names=tuple(class_names))
        stream = dataclasses.replace(stream, slide=slide)
    volumes = cfg.data.kind == "volume"
    if volumes:  # predicted whole, block by block (no bands)
        stream = dataclasses.replace(stream, band_rows=0)
    elif stream.band_rows != 0:  # the band and memory plans come from the plain network
        plan = analyse(model, cfg.model.in_channels)
        cost = stream.cost or plan_cost(model, cfg, plan.stride, device, stream.memory_gb)
        stream = dataclasses.replace(stream, plan=plan, cost=cost)
    model = parallelize(model, mesh, allow_gather=cfg.parallel.allow_gather)
    out_dir = Path(out_dir)
    console = console or Console()
    space = SpatialGroup.of(mesh)
    if volumes:
        from ._volumes import VolumePredictor

        predictor = VolumePredictor(cfg, model, space, device, stream, out_dir, console)
    else:
        predictor = _Predictor(cfg, model, space, device, stream, out_dir, console)
    with_masks = any(m is not None for _, _, m in images)
    cm = ConfusionMatrix(cfg.model.num_classes, cfg.data.ignore_index, device=device)
    main = dist.get_rank() == 0
    source = checkpoint_info(kind, weights) if main else {}
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        console.print(checkpoint_line(source), soft_wrap=True)
    predictor.progress = PredictProgress(len(range(0, len(images), dp)), main)
    dist.barrier()  # streamed images are written by each replica's first rank
    padded, failed = [], {}  # failed: {stem: message}, the same on every rank
    for first in range(0, len(images), dp):
        mine = first + coords.dp_rank
        piece, failure = None, None
        if mine < len(images):
            try:
                piece = predictor(*images[mine], cm)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it below
                failure = exc
                piece = {"stem": images[mine][0], "error": type(exc).__name__, "message": str(exc)}
        gathered = [None] * dist.get_world_size() if main else None
        dist.gather_object(piece, gathered, dst=0)
        errors: list = [None]
        if main:
            errors = [[p for p in gathered if isinstance(p, dict)]]
        dist.broadcast_object_list(errors, src=0)  # no rank may wait for a failed one
        fatal = [e for e in errors[0] if e["error"] not in SHARED_ERRORS]
        if fatal:  # not an input problem: the process group may be unusable, stop
            if failure is not None and type(failure).__name__ not in SHARED_ERRORS:
                raise failure
            raise RuntimeError(f"another rank failed: {fatal[0]['error']}: {fatal[0]['message']}")
        now = {e["stem"]: e["message"] for e in errors[0]}  # an input problem: go on
        for stem, message in now.items():
            failed.setdefault(stem, message)
            if main:
                console.print(f"[red]failed[/] {stem}: {message}", soft_wrap=True)
        if main:
            strips: dict[str, list] = {}
            ok = (p for p in gathered if p is not None and not isinstance(p, dict))
            for stem, rank, pred, overlay, (w, width) in ok:
                if stem in now:  # failed on another rank of its replica: no partial image
                    continue
                if width != w and rank == 0:
                    padded.append(f"{stem}: width {w} padded to {width}")
                if pred is None:  # streamed: written already by its replica's first rank
                    if overlay:  # the replica leader's summary line
                        console.print(f"{stem}: {overlay}")
                    continue
                strips.setdefault(stem, []).append((rank, pred, overlay))
            for stem, parts in strips.items():
                src = next(p for s, p, _ in images if s == stem)
                h, w, names = _write(out_dir, stem, parts, predictor, src)
                console.print(f"{stem}: {h}x{w} -> {out_dir / names[0]}, {', '.join(names[1:])}")
    predictor.progress.close()
    for line in padded:
        console.print(f"[yellow]padded[/] {line} (zeros on the right, cropped back)")
    if main:
        write_record(out_dir, source, len(images), failed)
    write_rank_stats(predictor.timing)
    result = None
    if with_masks:
        names = class_names or [f"class_{i}" for i in range(cfg.model.num_classes)]
        result = _masks_summary(cm, mesh, names, out_dir, len(images) - len(failed), console)
    if failed:
        raise ImagesFailed(failed, len(images))
    return result


def _masks_summary(cm, mesh, names, out_dir: Path, n_images: int, console) -> dict | None:
    """Reduce the confusion matrix (collective); rank 0 writes ``metrics.json``, prints the
    table and returns the metrics (None on the other ranks)."""
    cm.reduce(mesh)  # every rank counted different pixels
    if dist.get_rank() != 0:
        return None
    result = _metrics_json(cm, names, n_images)
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    _print_table(console, result)
    console.print(
        f"pixel accuracy {result['pixel_accuracy']:.4f}, mIoU {result['miou']:.4f}, mean Dice "
        f"{result['mean_dice']:.4f} (macro) -> {out_dir / 'metrics.json'}"
    )
    return result
