"""Ring attention: exact softmax attention over a sequence split across a process group.

Every rank holds the queries, keys and values of *its own* tokens (any subset of the
sequence, in any order: softmax over all keys does not depend on their order, only q, k
and v must agree). The key / value blocks travel around the ring of the group, one hop per
step, point to point (``post_p2p``); each rank attends its queries to every block in turn
and merges the partial results with an online log-sum-exp softmax. Memory per rank is
O(L / P): its own block, the one in flight and one score block of ``L/P x L/P``.

The backward runs the same ring: the key / value blocks travel again and, behind each, an
accumulator of its key / value gradients, to which every rank adds its part; after ``P``
hops the accumulator is back home. Each block's transfer is posted before the compute of
the current block, so it overlaps with it; the accumulator of a block is posted right after
its compute and is needed one step later, so it overlaps with the next block's compute.

Per block, the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward, which take the *global* output and log-sum-exp, the ring form of flash
attention) runs where it applies; elsewhere (another device, a value head size different
from the query's) the same block is done with plain matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ._halo import post_p2p
from ._runtime import current_runtime


def _flash_ok(q: Tensor, v: Tensor) -> bool:
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` to one key / value block: ``(out, lse)``, ``lse`` the log-sum-exp
    of the scaled scores per query (shape ``q.shape[:-1]``)."""
    if _flash_ok(q, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, scale=scale
        )
        return out, lse
    s = (q @ k.transpose(-2, -1)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *global* ``out`` and ``lse`` of the queries."""
    if _flash_ok(q, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, scale=scale
        )
    p = torch.exp((q @ k.transpose(-2, -1)) * scale - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


KV, GRAD = 1, 2  # message tags


class _Ring:
    """Who sends to whom, and the shapes of every rank's blocks."""

    def __init__(self, group, sizes: tuple[int, ...], lead: tuple[int, ...], e: int, ev: int):
        self.group, self.sizes, self.lead, self.e, self.ev = group, sizes, lead, e, ev
        self.parts = len(sizes)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.parts, (self.rank - 1) % self.parts

    def owner(self, step: int) -> int:
        """The rank whose block this rank works on at ``step``."""
        return (self.rank - step) % self.parts

    def empty(self, owner: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Uninitialised ``(key-like, value-like)`` tensors of ``owner``'s block."""
        n = self.sizes[owner]
        return like.new_empty(*self.lead, n, self.e), like.new_empty(*self.lead, n, self.ev)

    def post(self, sends: tuple[Tensor, ...], recv_owner: int | None, like: Tensor, tag: int):
        """Post the sends of ``sends`` to the next rank and, for ``recv_owner``, the receive
        of a ``(key-like, value-like)`` pair from the previous one. Messages between two
        ranks match in posting order per ``tag``: ``KV`` for blocks, ``GRAD`` for gradient
        accumulators. Returns ``(pending, received pair or None)``."""
        recv = self.empty(recv_owner, like) if recv_owner is not None else None
        stats = current_runtime().stats
        pending = post_p2p(
            self.group,
            [(self.next, t) for t in sends],
            [(self.prev, t) for t in recv] if recv else [],
            stats,
            tag=tag,
        )
        return pending, recv


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale) v`` over the keys of every rank of ``group``.

    ``q``, ``k``, ``v``: this rank's tokens, ``(..., L_r, E)`` (``v``: ``(..., L_r, Ev)``),
    the same leading dims on every rank; ``sizes``: ``L_r`` of every rank of the group.
    Memory: besides its own tensors a rank holds the block in flight (and, in the backward,
    two gradient accumulators); the online-softmax updates run in place."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, group, sizes: tuple[int, ...]):
        ring = _Ring(group, sizes, tuple(q.shape[:-2]), q.shape[-1], v.shape[-1])
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        kb, vb = k, v
        for step in range(ring.parts):
            pending = nxt = None
            if step < ring.parts - 1:  # the next block travels while this one is computed
                pending, nxt = ring.post((kb, vb), ring.owner(step + 1), q, KV)
            if q.shape[-2] and kb.shape[-2]:
                o_b, lse_b = block_forward(q, kb, vb, scale)
                new = torch.logaddexp(lse, lse_b)
                out.mul_(torch.exp(lse - new).unsqueeze(-1))
                out.add_(o_b.mul_(torch.exp(lse_b - new).unsqueeze(-1)))
                lse = new
                del o_b, lse_b
            if pending is not None:
                pending.wait()
                kb, vb = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kb, vb = k, v
        sent = None  # the accumulators this rank sent last step
        for step in range(ring.parts):
            owner = ring.owner(step)
            acc = kv = None
            if step > 0:  # this block's accumulators, sent by the previous rank last step
                acc = ring.post((), owner, q, GRAD)
            if step < ring.parts - 1:
                kv = ring.post((kb, vb), ring.owner(step + 1), q, KV)
            if sent is not None:
                # the next rank posted its receive at the start of this step too: the wait
                # is short, and frees the accumulators before this compute
                sent.wait()
                sent = None
            if q.shape[-2] and kb.shape[-2]:
                dq_b, dk_b, dv_b = block_backward(dout, q, kb, vb, out, lse, scale)
                dq += dq_b
                del dq_b
            else:
                dk_b, dv_b = (t.zero_() for t in ring.empty(owner, q))
            del kb, vb
            if acc is not None:  # add this rank's part into the received accumulators
                acc[0].wait()
                grads = acc[1]
                grads[0].add_(dk_b)
                grads[1].add_(dv_b)
            else:  # gloo sends dense tensors
                grads = (dk_b.contiguous(), dv_b.contiguous())
            del dk_b, dv_b, acc
            sent = ring.post(grads, None, q, GRAD)[0]
            del grads
            if kv is not None:
                kv[0].wait()
                kb, vb = kv[1]
                kv = None
        # this rank's own accumulators, after their last hop (the previous rank's last step)
        pending, (dk, dv) = ring.post((), ring.rank, q, GRAD)
        pending.wait()
        sent.wait()
        return dq, dk, dv, None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group, sizes: tuple[int, ...], scale: float | None = None
) -> Tensor:
    """Exact ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` over the tokens of
    every rank of ``group`` (``sizes``: how many each holds), differentiable. ``q``, ``k``,
    ``v`` hold this rank's tokens in the same order; the result is this rank's queries'."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if len(sizes) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return RingAttention.apply(q, k, v, scale, group, tuple(sizes))
