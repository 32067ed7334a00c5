"""Bad samples: agreed on by every rank, skipped or fatal, and reported by name.

``data.on_bad_sample: skip`` promises that bad samples are skipped *and counted*. Two kinds:

- found up front by ``FolderDataset.validate_all`` (``source.skipped``): reported once
  at the start;
- found while training (a file that passed the cheap up-front checks but does not decode,
  or changed on disk): a rank that fails to load its strip of a batch cannot simply drop
  the sample, because the ranks reading other strips of the same image (and the other
  data-parallel replicas, which form one global batch) would then build batches of
  other shapes and hang in the next collective. ``agree_on_failures`` makes every rank
  learn every rank's failures of the step (one tiny all-reduce per step; the names
  travel only when something failed), so all ranks skip the step's batch together, or
  all stop with the same ``DataError`` in ``error`` mode;
- found while validating (``train/validation.py``): a validation image that does not load,
  or whose model output is non-finite, is agreed on by the ranks of its spatial group and
  skipped (left out of the loss and the metrics, counted in ``val/skipped_images``) or
  fatal in the same way.

Every skipped file is printed on the console, written to ``metrics.jsonl`` as a
``{"split": "skipped", ...}`` line and counted in the final summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spconv_train.data import DataError

__all__ = [
    "SkipRecord",
    "agree_on_failures",
    "note_training_skips",
    "report_skipped",
    "sample_file",
    "skipped_summary",
    "training_failure",
    "upfront_skips",
]


@dataclass(frozen=True)
class SkipRecord:
    """One skipped file: which split, why, and the step it was found at (0: up front)."""

    split: str
    file: str
    reason: str
    step: int = 0


def agree_on_failures(
    local: list[tuple[str, str]], device: torch.device, groups: tuple | None = None
) -> list[tuple[str, str]]:
    """Every rank's ``(file, reason)`` load failures of this step, on every rank, in rank
    order without repeats (collective over the default group, or over every rank of the
    mesh dims whose process ``groups`` are given: a validation image's spatial ranks)."""
    if groups is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return list(dict.fromkeys(local))
        groups = (None,)
    groups = tuple(g for g in groups if g is None or dist.get_world_size(g) > 1)
    if not groups:
        return list(dict.fromkeys(local))
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return []
    items = list(local)
    for group in groups:  # over each mesh dim in turn: every rank's items in the end
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, items, group=group)
        items = [item for rank_items in gathered for item in rank_items]
    return list(dict.fromkeys(items))


def sample_file(source, i: int) -> str:
    """The image file of sample ``i`` of ``source`` for messages (its name if it has none)."""
    files = getattr(source, "files", None)
    return str(files(i)[0]) if files is not None else source.name(i)


def training_failure(
    failures: list[tuple[str, str]], where: str = "while loading a training batch"
) -> DataError:
    """The ``DataError`` every rank raises in ``error`` mode (the same on every rank)."""
    file, reason = failures[0]
    more = f" (and {len(failures) - 1} more: {', '.join(f for f, _ in failures[1:4])})"
    return DataError(
        f"{file}: {reason} ({where}"
        + (more if len(failures) > 1 else "")
        + "); fix or remove the file, or set data.on_bad_sample: skip to skip such samples",
        path=file,
        reason=reason,
    )


def report_skipped(logger, records: list[SkipRecord], *, write: bool = True) -> None:
    """Print each skipped file and (``write``) add it to ``metrics.jsonl`` (rank 0 only)."""
    for r in records:
        when = "up front" if r.step == 0 else f"at step {r.step}"
        logger.info(f"skipped {r.split} sample {r.file} ({when}): {r.reason}")
        if write:
            logger.record(
                r.step, "skipped", {"data_split": r.split, "file": r.file, "reason": r.reason}
            )


def upfront_skips(*sources) -> list[SkipRecord]:
    """The samples ``validate_all`` dropped in skip mode, from each source's ``skipped``."""
    return [
        SkipRecord(getattr(source, "split", "?"), file, reason)
        for source in sources
        for file, reason in getattr(source, "skipped", [])
    ]


def note_training_skips(logger, feed, step: int) -> list[SkipRecord]:
    """Report the files ``feed`` skipped before the batch of ``step``; returns them."""
    records = [SkipRecord("train", f, r, step) for f, r in feed.pop_skipped()]
    report_skipped(logger, records)
    return records


def skipped_summary(records: list[SkipRecord]) -> str:
    """The summary row: how many files were skipped, where to find their names."""
    if not records:
        return "0"
    return f"{len(records)} (named above and in metrics.jsonl, split 'skipped')"
