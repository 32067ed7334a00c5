"""Which checkpoint made the outputs: printed first and written to ``OUT/predict.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["checkpoint_info", "checkpoint_line", "write_record"]


def checkpoint_info(kind: str, weights: str | Path) -> dict:
    """``{"checkpoint": absolute path, "kind", "step"}`` of the loaded weights (``step``:
    from a checkpoint folder's ``meta.json``, or an export's ``step`` key; None when the
    file does not say)."""
    path = Path(weights).resolve()
    step = None
    if kind == "dcp":
        from spconv_train.checkpoint import read_meta

        meta = read_meta(path) or {}
        step = meta.get("step")
    else:
        from ._checkpoint import load_export

        step = load_export(path).get("step")
    return {"checkpoint": str(path), "kind": kind, "step": None if step is None else int(step)}


def checkpoint_line(source: dict) -> str:
    """``checkpoint PATH (step N)`` for the console."""
    step = "no step recorded" if source["step"] is None else f"step {source['step']}"
    return f"checkpoint {source['checkpoint']} ({step})"


def write_record(out_dir: Path, source: dict, images: int, failed: dict) -> None:
    """``OUT/predict.json``: the checkpoint (path, kind, step), the images predicted and
    the failed ones."""
    record = {
        **source,
        "images": images,
        "failed": sorted(failed),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out_dir / "predict.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
