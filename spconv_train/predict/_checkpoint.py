"""What ``predict`` loads: the checkpoint a path names (run folder, step folder or exported
``.pt``), the exported file itself (weights-only), the config to build the model with, and
that config without the training crop size."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from ._errors import PredictError

__all__ = ["PAD_MULTIPLE", "any_size", "load_export", "resolve_checkpoint"]

#: Padded widths are multiples of ``PAD_MULTIPLE * sp`` (32 = the output stride of the
#: usual backbones, and 2**5 for a U-Net of depth <= 6).
PAD_MULTIPLE = 32


def resolve_checkpoint(path: str | Path) -> tuple[str, Path, Path | None]:
    """``(kind, weights, config.yaml or None)`` for a run folder, a checkpoint folder or an
    exported ``.pt`` (kind ``"dcp"`` or ``"export"``)."""
    p = Path(path)
    if p.is_file():
        return "export", p, None
    if (p / "meta.json").is_file():
        return "dcp", p, p.parent.parent / "config.yaml"
    if (p / "checkpoints").is_dir() or (p / "model.pt").is_file():
        for pointer in ("best", "latest"):
            f = p / "checkpoints" / pointer
            name = f.read_text().strip() if f.is_file() else ""
            if name and (p / "checkpoints" / name / "meta.json").is_file():
                return "dcp", p / "checkpoints" / name, p / "config.yaml"
        if (p / "model.pt").is_file():
            return "export", p / "model.pt", p / "config.yaml"
    raise PredictError(
        f"{p}: not a run folder, a checkpoint folder (with meta.json) or an exported .pt file"
    )


_NOT_EXPORT_HINT = (
    "give a run folder, a checkpoints/step-N folder or the model.pt written by spconv-train run"
)


def load_export(path: Path) -> dict:
    """The ``{"model", "config"}`` dict of an exported ``.pt`` file, read with
    ``weights_only=True``; anything else raises ``PredictError`` naming the file (never
    torch's advice to retry with ``weights_only`` off, which would run arbitrary code
    from a file that is not a spconv-train export)."""
    import pickle

    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, ValueError) as exc:
        # UnpicklingError: bytes that are not a weights-only pickle; RuntimeError: not a
        # torch zip archive; the others: truncated or random bytes.
        raise PredictError(
            f"{path}: not a spconv-train checkpoint (cannot be read as a weights-only torch "
            f"file: {type(exc).__name__}); {_NOT_EXPORT_HINT}"
        ) from None
    except OSError as exc:
        raise PredictError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise PredictError(
            f"{path}: not a spconv-train checkpoint (no 'model' state dict in it); "
            + _NOT_EXPORT_HINT
        )
    return saved


def _load_config(kind: str, weights: Path, config_yaml: Path | None, overrides, config_path):
    """The config to build the model with (the saved one unless ``config_path``)."""
    from spconv_train.config import load_config

    overrides = list(overrides)
    if not any(o.strip().startswith("parallel.sp") for o in overrides):
        overrides.append("parallel.sp=0")  # every rank shares each image by default
    source = config_path or (config_yaml if config_yaml and config_yaml.is_file() else None)
    if source is not None:
        return load_config(source, overrides, check_paths=False)
    if kind == "export":
        import yaml

        saved = load_export(weights).get("config")
        if saved:
            with tempfile.TemporaryDirectory() as tmp:
                f = Path(tmp) / "config.yaml"
                f.write_text(yaml.safe_dump(saved), encoding="utf-8")
                return load_config(f, overrides, check_paths=False)
    raise PredictError(f"{weights}: no saved config found; pass --config CONFIG")


def any_size(cfg):
    """``cfg`` without the training crop size (``data.depth/height/width`` null): predict
    takes every image or volume at its own size."""
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, depth=None, height=None, width=None)
    )
