"""Ring attention: exact softmax attention over a sequence split across a process group.

Every rank holds the queries, keys and values of *its own* tokens (any subset of the
sequence, in any order: softmax over all keys does not depend on their order, only q, k
and v must agree). The key / value blocks travel around the ring of the group point to
point (``post_p2p``), cut into ``m`` pieces (``_ring_blocks.py``: the schedule); each rank
attends its queries to every piece in turn and merges the partial results with an online
log-sum-exp softmax. Memory per rank is O(L / P): its own tensors and a few pieces of
``L / (P m)`` tokens.

The backward runs the same ring: the pieces travel again and, one step behind each, an
accumulator of its key / value gradients, to which every rank adds its part; after ``P``
visits the accumulator is back at the piece's owner. Each piece's transfer is posted before
the compute of the current piece, so it overlaps with it; the accumulator of a piece is
posted right after its compute and is needed one step later, so it overlaps with the next
piece's compute.

Per piece, the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward, which take the *global* output and log-sum-exp, the ring form of flash
attention) runs where it applies; elsewhere (another device, a value head size different
from the query's) the same piece is done with plain matmuls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._ring_blocks import Ring, auto_pieces, block_backward, block_forward


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale) v`` over the keys of every rank of ``group``.

    ``q``, ``k``, ``v``: this rank's tokens, ``(..., L_r, E)`` (``v``: ``(..., L_r, Ev)``),
    the same leading dims on every rank; ``sizes``: ``L_r`` of every rank of the group;
    ``pieces``: ``m``, the pieces each key / value block travels in. Memory: besides its
    own tensors a rank holds the piece it works on, the one in flight, one output (forward)
    or query gradient (backward) of the kernel and, in the backward, a piece's gradients and
    its received accumulator; the online-softmax updates run in place."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, group, sizes: tuple[int, ...], pieces: int):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ring = Ring(group, sizes, pieces, q, q.shape[-1], v.shape[-1])
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        cur = None
        for step in range(ring.steps):
            if step % ring.parts == 0:
                cur = ring.own((k, v), step // ring.parts)
            pending, nxt = ring.pass_on(step, cur)  # the next piece travels meanwhile
            if q.shape[-2] and cur[0].shape[-2]:
                o_b, lse_b = block_forward(q, *cur, scale)
                new = torch.logaddexp(lse, lse_b)
                out.mul_(torch.exp(lse - new).unsqueeze(-1))
                out.add_(o_b.mul_(torch.exp(lse_b - new).unsqueeze(-1)))
                lse = new
                del o_b, lse_b
            pending.wait()
            cur = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        # dk, dv take the own pieces' gradients as they come home (the first after P steps)
        home_grads = _HomeGrads(ring, k, v)
        cur = sent = None  # the piece worked on; the accumulator sent last step
        for step in range(ring.steps):
            home = step % ring.parts == 0  # an own piece (and a finished accumulator arrives)
            if home:
                cur = ring.own((k, v), step // ring.parts)
            acc = ring.recv_grads(step) if step else None
            pending, nxt = ring.pass_on(step, cur)
            if sent is not None:
                # the next rank posted its receive at the start of this step too: the wait
                # is short, and frees the accumulator before this compute
                sent.wait()
                sent = None  # (it holds a buffer)
            if q.shape[-2] and cur[0].shape[-2]:
                dq_b, dk_b, dv_b = block_backward(dout, q, *cur, out, lse, scale)
                dq += dq_b
                del dq_b
            else:
                dk_b, dv_b = (t.zero_() for t in ring.empty(ring.item(step)))
            cur = None
            if acc is not None:
                acc[0].wait()
                if home:  # an own piece's gradients, after their last visit
                    home_grads.store(step // ring.parts - 1, acc[1])
                else:  # add this rank's part into the received accumulator
                    acc[1][0].add_(dk_b)
                    acc[1][1].add_(dv_b)
                    dk_b, dv_b = acc[1]
            acc = None
            sent = ring.send_grads((dk_b, dv_b))
            del dk_b, dv_b
            pending.wait()
            cur = nxt
        last, grads = ring.recv_grads(ring.steps)  # this rank's last piece, home
        last.wait()
        home_grads.store(ring.pieces - 1, grads)
        sent.wait()
        return dq, *home_grads.grads, None, None, None, None


class _HomeGrads:
    """This rank's key / value gradients, filled piece by piece as the accumulators come
    home; allocated at the first (with one piece: after the ring, when the pieces in flight
    are gone, so the peak does not hold them)."""

    def __init__(self, ring: Ring, k: Tensor, v: Tensor) -> None:
        self.ring, self.like, self.grads = ring, (k, v), None

    def store(self, piece: int, grads: tuple[Tensor, Tensor]) -> None:
        if self.ring.pieces == 1:  # the whole block: the received buffers are the gradients
            self.grads = grads
            return
        if self.grads is None:
            self.grads = tuple(torch.empty_like(t) for t in self.like)
        for dst, src in zip(self.ring.own_slice(self.grads, piece), grads, strict=True):
            dst.copy_(src)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    sizes: tuple[int, ...],
    scale: float | None = None,
    pieces: int | None = None,
) -> Tensor:
    """Exact ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` over the tokens of
    every rank of ``group`` (``sizes``: how many each holds), differentiable. ``q``, ``k``,
    ``v`` hold this rank's tokens in the same order; the result is this rank's queries'.
    ``pieces``: how many pieces each key / value block travels in (``m``, the same on
    every rank; by default ``_ring_blocks.auto_pieces(sizes)``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if len(sizes) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    pieces = auto_pieces(tuple(sizes)) if pieces is None else int(pieces)
    if pieces < 1:
        raise ValueError(f"ring_attention: pieces={pieces}; give a count >= 1 or None (automatic)")
    return RingAttention.apply(q, k, v, scale, group, tuple(sizes), pieces)
