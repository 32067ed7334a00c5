"""Run reporting on rank 0: TensorBoard, ``metrics.jsonl``, a rich progress bar and tables.

``RunLogger(run_dir, enabled=rank == 0)``: on other ranks every method is a no-op and no
file is created. TensorBoard event files go to ``run_dir/tensorboard`` (hyper-parameters
in ``run_dir/tensorboard/hparams``); every ``scalars`` call also appends one JSON line
``{"step": ..., "split": ..., **values}`` to ``run_dir/metrics.jsonl`` (non-finite values
are written as ``null`` so each line is strict JSON).
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from torch import Tensor

# Distinct colours for the first classes (tab10-like); class 0 is black so that a
# background class darkens the image instead of tinting it.
_BASE_COLORS = [
    (0, 0, 0), (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
    (148, 103, 189), (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207),
]  # fmt: skip


def _number(value: Any) -> float | None:
    """A JSON/TensorBoard friendly float (tensors and numpy scalars included)."""
    v = float(value.item() if hasattr(value, "item") else value)
    return v if math.isfinite(v) else None


def _fmt(value: Any) -> str:
    if isinstance(value, float) or hasattr(value, "item"):
        v = float(value.item() if hasattr(value, "item") else value)
        return "—" if math.isnan(v) else f"{v:.4g}"
    return str(value)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:  # lists, None, paths: TensorBoard's hparams take scalars and strings only
            out[key] = str(v)
    return out


class RunLogger:
    """Everything a run reports, written by rank 0 only (``enabled=False`` elsewhere).

    ``resume_step``: when resuming from a checkpoint of that step, drop the lines of
    ``metrics.jsonl`` (and TensorBoard events) of later steps written by the interrupted
    run, so a resumed run's logs read like an uninterrupted one's. ``console``: where rich
    output goes (default: stdout). ``log_every``: without a TTY the progress bar becomes
    one plain line every this many steps (0: about 20 lines per run).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        resume_step: int | None = None,
        console: Console | None = None,
        log_every: int = 0,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.tensorboard_dir = self.run_dir / "tensorboard"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.log_every = log_every
        self._want_progress = progress
        self._progress: Progress | None = None
        self._task = None
        self._last_plain: int | None = None
        self._pace: tuple[int, float] = (0, 0.0)  # (step, time) the s/step is measured from
        self._writer = None
        self._jsonl = None
        if not enabled:
            return
        self.console = console or Console()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_metrics(resume_step)
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge)

    def _truncate_metrics(self, resume_step: int) -> None:
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:  # a torn last line from a killed run does not parse: drop it
                if json.loads(line)["step"] <= resume_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.metrics_path)

    # -- data ------------------------------------------------------------------------------
    def scalars(self, step: int, values: dict[str, Any], prefix: str = "train") -> None:
        """Log ``values`` as TensorBoard scalars ``{prefix}/{name}`` and one metrics.jsonl
        line ``{"step": step, "split": prefix, **values}`` (flushed)."""
        if not self.enabled:
            return
        clean = {k: _number(v) for k, v in values.items()}
        if self._writer is not None:
            for k, v in clean.items():
                self._writer.add_scalar(f"{prefix}/{k}", math.nan if v is None else v, step)
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **clean}) + "\n")
        self._jsonl.flush()

    def record(self, step: int, split: str, values: dict[str, Any]) -> None:
        """One metrics.jsonl line ``{"step": step, "split": split, **values}`` holding any
        JSON values (e.g. the name of a skipped file), not sent to TensorBoard."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "split": split, **values}) + "\n")
        self._jsonl.flush()

    def images(self, step: int, tag: str, image: Tensor) -> None:
        """Log a CHW image (uint8, or float in [0, 1]) to TensorBoard."""
        if self.enabled and self._writer is not None:
            self._writer.add_image(tag, image.detach().cpu(), step, dataformats="CHW")

    def text(self, step: int, tag: str, text: str) -> None:
        """Log a (markdown) text to TensorBoard."""
        if self.enabled and self._writer is not None:
            self._writer.add_text(tag, text, step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """Log hyper-parameters (nested dicts are flattened to dotted keys) with final
        ``metrics`` for TensorBoard's HPARAMS tab."""
        if not self.enabled or self._writer is None:
            return
        metrics = {(k if k.startswith("hparam/") else f"hparam/{k}"): v for k, v in metrics.items()}
        metrics = {k: (math.nan if (v := _number(x)) is None else v) for k, x in metrics.items()}
        self._writer.add_hparams(_flatten(hparams), metrics, run_name="hparams")

    def flush(self) -> None:
        """Push buffered TensorBoard events to disk (metric lines are flushed as written)."""
        if self._writer is not None:  # None when disabled
            self._writer.flush()

    # -- console ---------------------------------------------------------------------------
    def info(self, message: str) -> None:
        """Print one line on rank 0."""
        if self.enabled:
            # soft_wrap: a long line (a path) is never cut or folded by rich
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def progress_start(self, total: int, initial: int = 0) -> None:
        """Start the progress bar at step ``initial`` of ``total`` (plain lines instead when
        progress is off or stdout is not a terminal)."""
        if not self.enabled:
            return
        self.total_steps = total
        self._last_plain = initial
        self._pace = (initial, time.perf_counter())
        if self._want_progress and self.console.is_terminal and self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total, completed=initial, info="")
            self._progress.start()

    def progress_update(self, step: int, **fields: Any) -> None:
        """Move the bar to ``step`` and show ``fields`` (e.g. loss=0.3, lr=1e-3)."""
        if not self.enabled:
            return
        info = "  ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        if self._progress is not None:  # the bar shows the ETA itself
            pace = self._pace_text(step, eta=False)
            self._progress.update(self._task, completed=step, info=f"{info}  {pace}".strip())
            return
        every = self.log_every or max(1, self.total_steps // 20)
        last = self._last_plain
        if last is None or step - last >= every or step == self.total_steps:
            self._last_plain = step
            total = f"/{self.total_steps}" if self.total_steps else ""
            self.info(f"step {step}{total}  {info}  {self._pace_text(step)}".rstrip())

    def _pace_text(self, step: int, eta: bool = True) -> str:
        """``0.52 s/step  ETA 0:01:23``: seconds per step since the last line (validation
        and checkpoints included, as they recur) and that pace over the steps left."""
        first, since = self._pace
        now = time.perf_counter()
        if step <= first:
            return ""
        per_step = (now - since) / (step - first)
        self._pace = (step, now)
        text = f"{per_step:.3g} s/step"
        if eta and self.total_steps:
            left = round(per_step * max(0, self.total_steps - step))
            text += f"  ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"
        return text

    def progress_stop(self) -> None:
        """Remove the progress bar (keeps the final line on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, title: str, rows: list[tuple[str, str]] | dict) -> None:
        """Print a two-column table (name, value)."""
        if not self.enabled:
            return
        table = Table(title=title, show_header=False)
        table.add_column("name", style="bold")
        table.add_column("value", justify="right")
        for name, value in rows.items() if isinstance(rows, dict) else rows:
            table.add_row(str(name), _fmt(value))
        self.console.print(table)

    def per_class_table(
        self, class_names: list[str], iou: list[float], dice: list[float], acc: list[float]
    ) -> None:
        """Print per-class IoU, Dice and accuracy (recall) with their macro averages over
        the classes present (NaN: class absent from labels and predictions, shown as —)."""
        if not self.enabled:
            return
        table = Table(title="Per-class validation metrics")
        table.add_column("class")
        for col in ("IoU", "Dice", "Acc"):
            table.add_column(col, justify="right")
        cols = [[float(v) for v in c] for c in (iou, dice, acc)]
        for i, name in enumerate(class_names):
            table.add_row(name, *(_fmt(c[i]) for c in cols))
        means = []
        for c in cols:
            present = [v for v in c if not math.isnan(v)]
            means.append(sum(present) / len(present) if present else math.nan)
        table.add_section()
        table.add_row("mean (macro)", *(_fmt(m) for m in means), style="bold")
        self.console.print(table)

    def close(self) -> None:
        """Stop the progress bar and close the files."""
        self.progress_stop()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- image panels --------------------------------------------------------------------------
def class_colors(num_classes: int) -> list[tuple[int, int, int]]:
    """A fixed colour per class (same on every call), for overlays."""
    colors = list(_BASE_COLORS[:num_classes])
    for i in range(len(colors), num_classes):
        h = (i * 0.618033988749895) % 1.0  # golden-ratio hues stay apart
        r, g, b = colorsys.hsv_to_rgb(h, 0.75, 0.95)
        colors.append((int(r * 255), int(g * 255), int(b * 255)))
    return colors


def auto_contrast(image: Tensor, low: float = 0.5, high: float = 99.5) -> Tensor:
    """``[C, H, W]`` stretched per channel so its ``low``..``high`` percentiles span [0, 1],
    for display: a dim 16-bit image (values 0..235 of 65535) is not shown black."""
    img = image.float()
    flat = img.flatten(1)
    if flat.shape[1] == 0:
        return img
    sample = flat[:, :: max(1, flat.shape[1] // 1_000_000)]  # quantile of a bounded sample
    q = torch.quantile(sample, torch.tensor([low / 100, high / 100]), dim=1)
    lo, hi = q[0].view(-1, 1, 1), q[1].view(-1, 1, 1)
    return ((img - lo) / (hi - lo).clamp(min=1e-12)).clamp(0, 1)


def _to_rgb_uint8(image: Tensor) -> Tensor:
    img = image.detach().cpu()
    if img.dim() != 3:
        raise ValueError(f"overlay_panel: image must be CHW, got shape {tuple(img.shape)}")
    # RGB(A) shows its first three channels; any other channel count its first as grey.
    img = img[:3] if img.shape[0] >= 3 else img[:1].expand(3, -1, -1)
    if img.dtype == torch.uint8:
        return img.contiguous()
    img = auto_contrast(img)  # any normalisation, any dynamic range: visible
    return (img * 255).round().clamp(0, 255).to(torch.uint8)


def _as_labels(t: Tensor, num_classes: int) -> Tensor:
    t = t.detach().cpu()
    if t.dim() == 3 and t.is_floating_point():  # logits CHW
        t = t.argmax(0)
    elif t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise ValueError(f"overlay_panel: labels must be HW, got shape {tuple(t.shape)}")
    return t.long()


def overlay_panel(
    image: Tensor,
    pred: Tensor,
    target: Tensor,
    num_classes: int,
    *,
    ignore_index: int = 255,
    downsample: int = 4,
    alpha: float = 0.5,
    gap: int = 2,
) -> Tensor:
    """A CHW uint8 panel ``input | prediction overlay | label overlay`` for TensorBoard.

    ``image``: CHW (uint8, float in [0, 1], or normalised float, stretched for display);
    ``pred``: HW class indices (or CHW logits); ``target``: HW labels where
    ``ignore_index`` pixels are left uncoloured. Everything is reduced by ``downsample``
    (image by area averaging, labels by nearest sampling); panels are ``gap`` white
    columns apart. Output shape ``[3, ceil(H/d), 3*ceil(W/d) + 2*gap]``.
    """
    from torchvision.utils import draw_segmentation_masks

    img = _to_rgb_uint8(image)
    pred_l = _as_labels(pred, num_classes)
    tgt_l = _as_labels(target, num_classes)
    if not (img.shape[1:] == pred_l.shape == tgt_l.shape):
        raise ValueError(
            f"overlay_panel: image {tuple(img.shape)}, pred {tuple(pred_l.shape)} and target "
            f"{tuple(tgt_l.shape)} must share H and W"
        )
    d = max(1, int(downsample))
    if d > 1:
        pred_l, tgt_l = pred_l[::d, ::d], tgt_l[::d, ::d]
        small = F.interpolate(img[None].float(), size=tuple(pred_l.shape), mode="area")[0]
        img = small.round().clamp(0, 255).to(torch.uint8)
    classes = torch.arange(num_classes)[:, None, None]
    colors = class_colors(num_classes)

    def overlay(labels: Tensor) -> Tensor:
        # ignore_index (and any other out-of-range value) matches no class: left uncoloured
        masks = (labels[None] == classes) & (labels != ignore_index)[None]
        return draw_segmentation_masks(img, masks, alpha=alpha, colors=colors)

    sep = torch.full((3, img.shape[1], gap), 255, dtype=torch.uint8)
    return torch.cat([img, sep, overlay(pred_l), sep, overlay(tgt_l)], dim=2)


__all__ = ["RunLogger", "auto_contrast", "class_colors", "overlay_panel"]
