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
point, one hop per step, the next block's transfer posted before the current block's
compute (as in ``_ring.py``); the keys are never assembled on one rank. The backward
runs the same ring: the blocks travel again and, behind each, an accumulator of its
gradient to which every rank adds its part, back at its owner after ``P`` hops.

Memory per rank: its rows of ``S`` (``L_q / P x L_k``: the one-device score matrix split
``P`` ways; for spatial-reduction attention ``L_k = L / r^2``), its own blocks, the one in
flight and one accumulator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._halo import post_p2p
from ._ring_blocks import GRAD, KV
from ._runtime import current_runtime

SCORES, APPLY = "scores", "apply"


class _BlockRing:
    """One tensor block per rank, ``(*lead, sizes[rank], e)``, passed to the next rank."""

    def __init__(self, group, sizes: tuple[int, ...], like: Tensor):
        self.group, self.sizes, self.like = group, sizes, like
        self.parts = len(sizes)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.parts, (self.rank - 1) % self.parts

    def owner(self, step: int) -> int:
        """The rank whose block this rank works on at ``step``."""
        return (self.rank - step) % self.parts

    def post(self, sends: tuple[Tensor, ...], recv_owner: int | None, tag: int):
        """Post ``sends`` to the next rank and, for ``recv_owner``, the receive of its block
        from the previous one (messages match in posting order per ``tag``)."""
        recv = None
        if recv_owner is not None:
            shape = (*self.like.shape[:-2], self.sizes[recv_owner], self.like.shape[-1])
            recv = self.like.new_empty(shape)
        pending = post_p2p(
            self.group,
            [(self.next, t) for t in sends],
            [(self.prev, recv)] if recv is not None else [],
            current_runtime().stats,
            tag=tag,
        )
        return pending, recv


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
        ring = _BlockRing(group, sizes, t)
        if kind == SCORES:
            out = a.new_empty(*a.shape[:-1], n_cols)
        else:
            out = a.new_zeros(*a.shape[:-1], t.shape[-1])
        tb = t
        for step in range(ring.parts):
            pending = nxt = None
            if step < ring.parts - 1:  # the next block travels while this one is computed
                pending, nxt = ring.post((tb,), ring.owner(step + 1), KV)
            _block_forward(kind, a, tb, cols[ring.owner(step)], out)
            if pending is not None:
                pending.wait()
                tb = nxt
        ctx.save_for_backward(a, t)
        ctx.kind, ctx.ring, ctx.cols = kind, ring, cols
        return out

    @staticmethod
    def backward(ctx, dout):
        a, t = ctx.saved_tensors
        ring, kind, cols = ctx.ring, ctx.kind, ctx.cols
        dout = dout.contiguous()
        da = torch.zeros_like(a)
        tb, sent = t, None
        for step in range(ring.parts):
            owner = ring.owner(step)
            acc = nxt = None
            if step > 0:  # this block's accumulator, sent by the previous rank last step
                acc = ring.post((), owner, GRAD)
            if step < ring.parts - 1:
                nxt = ring.post((tb,), ring.owner(step + 1), KV)
            if sent is not None:
                sent.wait()
            dt = _block_backward(kind, a, tb, cols[owner], dout, da)
            if acc is not None:
                acc[0].wait()
                grad = acc[1].add_(dt)
            else:
                grad = dt.contiguous()
            del dt, acc
            sent = ring.post((grad,), None, GRAD)[0]
            del grad
            if nxt is not None:  # the block received replaces this one
                nxt[0].wait()
                tb = nxt[1]
        # this rank's own accumulator, after its last hop
        pending, dt_home = ring.post((), ring.rank, GRAD)
        pending.wait()
        sent.wait()
        return da, dt_home, None, None, None, None, None


def ring_matmul(
    kind: str, a: Tensor, t: Tensor, group, sizes: tuple[int, ...], cols: tuple, n_cols: int
) -> Tensor:
    """Differentiable ``RingMatmul`` (see there); one rank: the plain product."""
    if len(sizes) == 1:  # every key here, in global order
        return a @ t.transpose(-2, -1) if kind == SCORES else a @ t
    return RingMatmul.apply(a, t, kind, group, tuple(sizes), tuple(cols), n_cols)
