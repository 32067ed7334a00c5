"""Memory layout of local blocks: channels-last activations stay channels-last.

With ``training.channels_last`` the convolutions compute channels-last (NHWC / NDHWC in
memory) and so should everything between them: a layer whose output comes back NCHW
makes the next convolution copy its input to channels-last, and its backward the gradient
both ways. Two things here keep the layout:

- ``in_layout``: the local block a DTensor hands to local code. ``DTensor.to_local`` and
  ``DTensor.from_local`` each take a ``view_as`` of the local tensor, and a view gives a
  size-1 dim the stride ``size * stride`` of the dim after it: a channels-last block of
  batch 1 (the usual per-rank batch of a spatially sharded image) comes out with the batch
  stride ``C`` instead of ``C*H*W``. Still channels-last-contiguous, but torch's
  ``suggest_memory_format`` no longer calls it channels-last, so ``torch.cat``,
  ``max_pool2d``, ``interpolate`` and the batch norm return NCHW results for it (and their
  backward NCHW gradients). ``in_layout`` gives such a block its canonical strides again,
  as views (no copy; autograd and in-place ops see ordinary views).
- ``empty_as``: a new buffer (a halo window) in the layout of the block it is built from;
  ``new_empty`` would allocate NCHW. (Likewise ops that allocate their result contiguous,
  such as ``index_select``, run on the channels-moved-last view: ``_interpolate._apply``.)
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the channels-last memory format per tensor rank
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_format(t: Tensor) -> torch.memory_format:
    """``t``'s dense memory format: channels-last when ``t`` is an image or volume batch
    stored channels-last (and not also contiguous: one channel, or 1x1 maps), else
    ``torch.contiguous_format``."""
    fmt = CHANNELS_LAST.get(t.dim())
    if fmt is not None and t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
        return fmt
    return torch.contiguous_format


def in_layout(t: Tensor, grad: bool = False) -> Tensor:
    """``t`` itself, or for a channels-last block of batch 1 whose batch stride is not
    ``C*H*W`` (module docstring) the same memory viewed with the canonical strides.

    ``grad=True`` (a block about to be wrapped into a DTensor, ``_dims.from_local``): the
    views are taken even when ``t``'s strides are canonical already, for their backward:
    it is the same chain of views applied to the gradient, which ``from_local``'s backward
    hands over with the batch stride broken."""
    if t.shape[0] != 1 or memory_format(t) is torch.contiguous_format:
        return t
    if not grad and t.stride(0) == t[0].numel():
        return t
    # Channels last: squeezing and re-inserting the batch dim in front of a dim of stride
    # H*W*C (the outermost spatial dim of the channels-moved-last view) gives it the
    # stride size * stride = C*H*W.
    return t.movedim(1, -1).squeeze(0).unsqueeze(0).movedim(-1, 1)


def empty_as(like: Tensor, shape) -> Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype and device, its dims
    ordered in memory as ``like``'s are (as ``torch.empty_like`` keeps a dense layout):
    channels-last for a channels-last ``like``, also when ``like`` is a permuted view of
    one (``_tiles.along``)."""
    if like.is_contiguous():
        return like.new_empty(shape)
    # outermost dim first; on equal strides (size-1 dims) the tensor's own order
    order = sorted(range(like.dim()), key=lambda i: (-like.stride(i), i))
    buf = like.new_empty([shape[i] for i in order])
    return buf.permute([order.index(i) for i in range(like.dim())])
