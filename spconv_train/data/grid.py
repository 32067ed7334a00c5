"""Stitch the pieces of a grid of tiles (strips, H x W tiles, blocks of a volume) back into
one array: the inverse of cutting an image or volume over a grid of ranks.

One helper for numpy arrays and torch tensors, so that ``predict`` (numpy outputs) and the
training panels (torch pieces) place pieces the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

__all__ = ["stitch_grid"]

A = TypeVar("A", np.ndarray, torch.Tensor)


def _cat(parts: list, axis: int):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def stitch_grid(parts: Sequence[A], counts: Sequence[int], axes: Sequence[int]) -> A:
    """Concatenate ``parts``, the pieces of a grid of ``counts`` pieces listed in row-major
    order (the last grid dim fastest), along ``axes`` (one array axis per grid dim).

    The pieces may differ in size (an uneven split) as long as the pieces of one grid row
    agree on the other axes, as those of a split array do. Works on numpy arrays and on
    torch tensors (all ``parts`` of one kind); the result is a new array.
    """
    if len(counts) != len(axes) or not counts:
        raise ValueError(f"one axis per grid dim: counts {tuple(counts)}, axes {tuple(axes)}")
    if len(parts) != math.prod(counts):
        need = math.prod(counts)
        raise ValueError(f"a grid of {tuple(counts)} needs {need} parts, got {len(parts)}")
    if len(counts) == 1:
        return _cat(list(parts), axes[0])
    n = len(parts) // counts[0]
    rows = [stitch_grid(parts[i * n : (i + 1) * n], counts[1:], axes[1:]) for i in range(counts[0])]
    return _cat(rows, axes[0])
