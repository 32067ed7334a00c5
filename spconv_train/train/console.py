"""The training console's text: one line per validation (with every class's IoU) and the
run summary's closing lines (best step, full paths).

Paths are printed as plain lines, never inside a table: a table cell is folded or cut at the
terminal's width, and a path is only useful whole (to copy it into ``predict``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from spconv_train.checkpoint import CheckpointManager, read_meta

__all__ = ["summary_lines", "validation_line"]


def _num(value: Any) -> str:
    v = float(value)
    return "—" if math.isnan(v) else f"{v:.4g}"


def validation_line(step: int, scores: dict, class_names: list[str]) -> str:
    """``val step N: loss=.. mIoU=.. mDice=.. acc=.. | IoU class=..  class=..`` (absent
    classes, NaN, as ``—``; skipped images counted when there are any)."""
    head = (
        f"val step {step}: loss={_num(scores['loss'])}  mIoU={_num(scores['miou'])}  "
        f"mDice={_num(scores['mean_dice'])}  acc={_num(scores['pixel_accuracy'])}"
    )
    if scores.get("skipped_images"):
        head += f"  skipped={scores['skipped_images']}"
    per_class = "  ".join(
        f"{name}={_num(v)}" for name, v in zip(class_names, scores["iou"], strict=True)
    )
    return f"{head} | IoU {per_class}"


def summary_lines(ckpt: CheckpointManager, run_dir: str | Path, export: Path) -> list[str]:
    """The summary's lines after its table: the best step with its metric and the full
    paths of the best and latest checkpoints, the exported model and the run folder."""
    best, lines = ckpt.best(), []
    if best is not None:
        meta = read_meta(best) or {}
        metric = meta.get("metric")
        extra = f" (val mIoU {_num(metric)})" if metric is not None else ""
        lines.append(f"best step: {meta.get('step', '?')}{extra}")
        lines.append(f"best checkpoint: {best.resolve()}")
    else:
        lines.append("best checkpoint: - (checkpoint.keep_best off or no finite val mIoU)")
    latest = ckpt.latest()
    lines.append(f"latest checkpoint: {latest.resolve() if latest else '-'}")
    lines.append(f"exported model: {Path(export).resolve()}")
    lines.append(f"run folder: {Path(run_dir).resolve()}")
    return lines
