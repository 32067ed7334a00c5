"""Ring matmuls: the two products of explicitly written attention over a split sequence.

Attention written out (``q @ k.transpose(-2, -1)`` -> softmax -> ``@ v``, as MiT / SegFormer
and timm with fused attention off do it) has two products whose contraction meets the
tokens of every rank:

* **scores** ``S = q @ k^T``: this rank's queries against *all* keys. Each rank computes
  its rows of ``S`` (its queries x every key, in the global key order), so the softmax
  over the keys (the last dim) is local afterwards;
* **apply** ``O = A @ v``: this rank's rows of the attention weights ``A`` (every key)
  against the values of every rank.

Either way the key (value) blocks travel around the ring of the spatial group point to
point, whole (``_ring.Ring`` with one piece per block), one hop per step, the next
block's transfer posted before the current block's compute; the keys are never assembled
on one rank. The backward runs the same ring: the blocks travel again and, behind each,
an accumulator of its gradient to which every rank adds its part, back at its owner after
``P`` hops.

Memory per rank: its rows of ``S`` (``L_q / P x L_k``: the one-device score matrix split
``P`` ways; for spatial-reduction attention ``L_k = L / r^2``), its own blocks, the one in
flight and one accumulator.
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
