"""The inputs of ``spconv-train predict``: image or volume files (and masks) by stem, and
the class names of the report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ._errors import PredictError

__all__ = ["_class_names", "_collect"]


def _finder(volumes: bool):
    """(index of a folder: ``(folder, "image" | "mask") -> {stem: path}``, stem of a file)
    for images or, with ``volumes``, 3-D volumes (``.npy``, TIFF stacks, NIfTI)."""
    if volumes:
        from spconv_train.data.volume_folder import _index, _stem

        return _index, _stem
    from spconv_train.data import IMAGE_EXTS, MASK_EXTS, index_folder

    exts = {"image": IMAGE_EXTS, "mask": MASK_EXTS}
    return (lambda folder, what: index_folder(folder, exts[what], what)), (lambda p: p.stem)


def _collect(
    inputs: Sequence[str | Path], masks_dir: str | Path | None, volumes: bool = False
) -> list[tuple]:
    """``(stem, image path, mask path or None)`` of every input image (or, with
    ``volumes``, every input volume), sorted."""
    index, stem_of = _finder(volumes)
    found: dict[str, Path] = {}
    for item in map(Path, inputs):
        if item.is_dir():
            files = list(index(item, "image").values())
        elif item.is_file():
            files = [item]
        else:
            raise PredictError(f"{item}: no such file or folder")
        for f in files:
            stem = stem_of(f)
            if stem in found and found[stem] != f:
                raise PredictError(f"two inputs share the stem {stem!r}: {found[stem]}, {f}")
            found[stem] = f
    if not found:
        raise PredictError(f"no input {'volumes' if volumes else 'images'} found")
    masks = index(Path(masks_dir), "mask") if masks_dir else None
    if masks is not None:
        missing = sorted(s for s in found if s not in masks)
        if missing:
            raise PredictError(f"{masks_dir}: no mask for {', '.join(missing[:10])}")
    return [(s, found[s], masks[s] if masks else None) for s in sorted(found)]


def _class_names(cfg, masks_dir) -> list[str]:
    k = cfg.model.num_classes
    if cfg.data.class_names:
        return list(cfg.data.class_names)
    for root in [Path(masks_dir).parent.parent] if masks_dir else []:
        f = root / "classes.txt"
        names = f.read_text().split() if f.is_file() else []
        if len(names) == k:
            return names
    if cfg.data.source == "synthetic" and k >= 2:
        from spconv_train.data import synthetic_class_names
        from spconv_train.data.synthetic3d import synthetic_volume_class_names

        volume = cfg.data.kind == "volume"
        return (synthetic_volume_class_names if volume else synthetic_class_names)(k)
    return [f"class_{i}" for i in range(k)]
