"""Memory layout of local blocks: channels-last activations stay channels-last (``to_local`` /
``from_local`` give a size-1 batch dim the stride ``C``, which torch's kernels read as NCHW;
docs/design.md)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: the channels-last memory format per tensor rank
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_format(t: Tensor) -> torch.memory_format:
    """``t``'s channels-last format if stored so (and not also contiguous), else contiguous."""
    fmt = CHANNELS_LAST.get(t.dim())
    if fmt is not None and t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
        return fmt
    return torch.contiguous_format


def in_layout(t: Tensor) -> Tensor:
    """``t``, or a channels-last batch-1 block viewed with canonical strides (no copy)."""
    if t.shape[0] != 1 or memory_format(t) is torch.contiguous_format:
        return t
    if t.stride(0) == math.prod(t.shape):
        return t
    # Batch squeezed, a size-1 dim inserted before the outermost spatial dim (stride H*W*C)
    # gets stride C*H*W; moved to the front, it is the batch dim. Views of plain tensors:
    # past the spatial mode's handler lookup (``_mode.py``), which costs more.
    with torch._C.DisableTorchFunction():
        return t.squeeze(0).unsqueeze(1).transpose(0, 1)


def grad_in_layout(t: Tensor) -> Tensor:
    """``t`` as views whose backward hands the gradient on with canonical channels-last
    strides (``in_layout``'s, for a gradient about to reach a backward kernel that reads
    the layout off it); ``t`` itself unless a channels-last block of batch 1."""
    if t.shape[0] != 1 or memory_format(t) is torch.contiguous_format:
        return t
    # The backward of this chain is the same chain on the gradient: channels moved last,
    # the batch dim squeezed and re-inserted in front (stride size * stride = C*H*W).
    with torch._C.DisableTorchFunction():
        return t.movedim(1, -1).squeeze(0).unsqueeze(0).movedim(-1, 1)


def empty_as(like: Tensor, shape) -> Tensor:
    """An uninitialised tensor of ``shape`` like ``like``, dims in memory in its order."""
    if like.is_contiguous():
        return like.new_empty(shape)
    # outermost dim first; on equal strides (size-1 dims) the tensor's own order
    order = sorted(range(like.dim()), key=lambda i: (-like.stride(i), i))
    buf = like.new_empty([shape[i] for i in order])
    return buf.permute([order.index(i) for i in range(like.dim())])


def reshape_kept(t: Tensor, shape) -> Tensor:
    """``t.reshape(shape)``, or ``t`` itself when it already has that shape: a same-shape
    reshape is a view whose backward gives a channels-last gradient of batch 1 the broken
    batch stride again (``in_layout``), and the next backward kernel then runs it NCHW."""
    return t if t.shape == torch.Size(shape) else t.reshape(shape)
