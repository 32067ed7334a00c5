"""What a non-finite loss or gradient means: the step's files, and data or divergence.

``train_step`` stops at a non-finite loss or gradient norm (``NonFiniteStep``) before the
weights change. The message the user needs names the samples of that step and says which
of the two usual causes it is: the batch's input holds NaN / Inf (a data problem: the
file is named; loads check the raw pixels, so such a value comes from the normalisation
or from a file that changed), or every input is finite and the model diverged (lower the
learning rate, clip the gradients). Every rank takes this path at the same step (the loss
and the gradient norm are global), so one object all-gather, only here, collects every
rank's view of its piece of the batch.
"""

from __future__ import annotations

import math

import torch

from spconv_train.config import Config
from spconv_train.data import SegmentationSource
from spconv_train.distributed import gather_all
from spconv_train.train.bad_samples import sample_file
from spconv_train.train.step import NonFiniteStep

__all__ = ["explain_non_finite"]

_LARGE_INPUT = 1e4  # normalised inputs beyond this suggest a normalisation problem
_LISTED = 8


def _listing(files: list[str]) -> str:
    more = len(files) - _LISTED
    return ", ".join(files[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def _local_view(image, source: SegmentationSource, samples: tuple[int, ...]) -> tuple:
    """``([(file, finite)] per sample of this rank's piece, largest finite |input|)``."""
    local = image.to_local() if hasattr(image, "to_local") else image
    flat = local.detach().flatten(1).float()
    finite = torch.isfinite(flat).all(1).tolist() if flat.numel() else [True] * len(samples)
    values = flat[torch.isfinite(flat)]
    peak = float(values.abs().max()) if values.numel() else 0.0
    files = [sample_file(source, i) for i in samples]
    return list(zip(files, finite, strict=False)), peak


def explain_non_finite(
    exc: NonFiniteStep, image, samples: tuple[int, ...], source: SegmentationSource, cfg: Config
) -> str:
    """The message for ``exc`` raised on the batch ``image`` (this rank's DTensor or plain
    tensor) of ``samples`` (this replica's indices in ``source``); collective over the
    default group (every rank stops at the same step)."""
    views = gather_all(_local_view(image, source, samples))
    files = list(dict.fromkeys(f for view, _ in views for f, _ in view))
    bad = list(dict.fromkeys(f for view, _ in views for f, ok in view if not ok))
    peak = max((p for _, p in views), default=0.0)
    head = f"non-finite {exc.what} ({exc.value}) at step {exc.step + 1}"
    if bad:
        return (
            f"{head}: the input of {_listing(bad)} holds NaN / Inf after loading and "
            "data.normalize (the file's pixels were finite when checked: it changed since, or "
            "the normalisation divides by zero); fix or remove the file, or check "
            "data.normalize; stopping without a checkpoint"
        )
    o = cfg.optimizer
    clip = "set optimizer.grad_clip" if not o.grad_clip else "lower optimizer.grad_clip"
    large = (
        f"; the inputs reach |x| = {peak:.3g}: check data.normalize"
        if peak > _LARGE_INPUT and math.isfinite(peak)
        else ""
    )
    return (
        f"{head} on the batch of {_listing(files)}; its inputs are all finite (largest |x| = "
        f"{peak:.3g}), so the model diverged: lower optimizer.lr (now {o.lr:g}) or {clip}"
        f"{large}; stopping without a checkpoint"
    )
