"""Ring matmuls: the two products of explicitly written attention over a split sequence
(``q @ k.transpose(-2, -1)`` -> softmax -> ``@ v``, as MiT / SegFormer and timm with fused
attention off do it; ``docs/attention.md``).

* **scores** ``S = q @ k^T``: each rank computes its queries' rows of ``S`` against every
  key, in the global key order, so the softmax over the keys is local afterwards;
* **apply** ``O = A @ v``: this rank's rows of the weights ``A`` against every value.

The key (value) blocks travel whole around the ring of the spatial group (``_ring.Ring``
with one piece per block), never assembled on one rank; the backward's accumulators
follow them home. Memory per rank: its rows of ``S`` (``L_q / P x L_k``), its own blocks,
the one in flight and one accumulator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._ring import Blocks, Item, Ring

SCORES, APPLY = "scores", "apply"


def _block_forward(kind: str, a: Tensor, t: Tensor, cols: Tensor, out: Tensor) -> None:
    if kind == SCORES:  # this block's key columns of the scores
        out.index_copy_(-1, cols, a @ t.transpose(-2, -1))
    else:  # the weights of this block's keys times its values
        out.add_(a.index_select(-1, cols) @ t)


def _block_backward(
    kind: str, a: Tensor, t: Tensor, cols: Tensor, dout: Tensor, da: Tensor
) -> Tensor:
    """Adds the block's part of ``da`` into ``da``; returns this rank's part of the block's
    gradient."""
    if kind == SCORES:
        ds = dout.index_select(-1, cols)
        da.add_(ds @ t)
        return ds.transpose(-2, -1) @ a
    da.index_add_(-1, cols, dout @ t.transpose(-2, -1))
    return a.index_select(-1, cols).transpose(-2, -1) @ dout


class RingMatmul(torch.autograd.Function):
    """``SCORES``: ``a @ t_all^T`` (``a``: ``(*lead, L_r, d)``, result ``(*lead, L_r,
    n_cols)``); ``APPLY``: ``a @ t_all`` (``a``: ``(*lead, L_r, n_cols)``, result
    ``(*lead, L_r, e)``). ``t``: this rank's block ``(*lead, sizes[rank], e)``; ``t_all``
    the blocks of every rank in global order: block ``j`` holds the global indices
    ``cols[j]`` of the ``n_cols`` keys."""

    @staticmethod
    def forward(ctx, a, t, kind: str, group, sizes: tuple[int, ...], cols: tuple, n_cols: int):
        a, t = a.contiguous(), t.contiguous()  # gloo sends dense tensors
        ring = Ring(group, sizes, 1, (t,))
        if kind == SCORES:
            out = a.new_empty(*a.shape[:-1], n_cols)
        else:
            out = a.new_zeros(*a.shape[:-1], t.shape[-1])
        ring.forward((t,), lambda item, tb: _block_forward(kind, a, tb[0], cols[item[0]], out))
        ctx.save_for_backward(a, t)
        ctx.kind, ctx.ring, ctx.cols = kind, ring, cols
        return out

    @staticmethod
    def backward(ctx, dout):
        a, t = ctx.saved_tensors
        kind, cols = ctx.kind, ctx.cols
        dout = dout.contiguous()
        da = torch.zeros_like(a)

        def grads_of(item: Item, tb: Blocks) -> Blocks:
            return (_block_backward(kind, a, tb[0], cols[item[0]], dout, da),)

        (dt,) = ctx.ring.backward((t,), grads_of)
        return da, dt, None, None, None, None, None


def ring_matmul(
    kind: str, a: Tensor, t: Tensor, group, sizes: tuple[int, ...], cols: tuple, n_cols: int
) -> Tensor:
    """Differentiable ``RingMatmul`` (see there); one rank: the plain product."""
    if len(sizes) == 1:  # every key here, in global order
        return a @ t.transpose(-2, -1) if kind == SCORES else a @ t
    return RingMatmul.apply(a, t, kind, group, tuple(sizes), tuple(cols), n_cols)
