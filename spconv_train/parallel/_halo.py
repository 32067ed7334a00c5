"""Halo exchange along the last dim (``gather_columns``: one ``batch_isend_irecv``, backward
the adjoint; docs/halo.md), and ``sum_grad_over``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from ._compile import not_traced
from ._geometry import ExchangePlan
from ._layout import empty_as
from ._runtime import SpatialStats, current_runtime


class PendingExchange:
    """Messages posted by ``post_p2p``, not waited on yet."""

    def __init__(self, works: list, stats: SpatialStats, cuda: bool, posted_s: float):
        self.works, self.stats, self.cuda = works, stats, cuda
        stats.halo_seconds += posted_s

    def wait(self) -> None:
        """Block until every message is done; the time blocked goes to the stats (docs/halo.md)."""
        if not self.works:
            return
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2 if self.cuda else 0)]
        t0 = events[0].record() if self.cuda else time.perf_counter()
        for work in self.works:
            work.wait()
        if self.cuda:
            events[1].record()
            self.stats._pending.append(tuple(events))
        else:
            self.stats.halo_seconds += time.perf_counter() - t0
        self.works = []


def post_p2p(
    group: dist.ProcessGroup,
    sends: list[tuple[int, Tensor]],
    recvs: list[tuple[int, Tensor]],
    stats: SpatialStats,
    tag: int = 0,
) -> PendingExchange:
    """Post every send and receive together; ``wait()`` on the result before reading a
    receive or writing a send buffer. Peers are ranks *within* ``group``; messages pair up
    by posting order per ``tag``. Bytes, messages and time go to ``stats``."""
    ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=p, tag=tag) for p, t in recvs]
    ops += [dist.P2POp(dist.isend, t, group=group, group_peer=p, tag=tag) for p, t in sends]
    if not ops:
        return PendingExchange([], stats, False, 0.0)
    start, cuda = time.perf_counter(), (recvs or sends)[0][1].is_cuda
    works = dist.batch_isend_irecv(ops)
    stats.halo_bytes += sum(t.numel() * t.element_size() for _, t in sends)
    stats.halo_messages += len(sends)
    return PendingExchange(works, stats, cuda, 0.0 if cuda else time.perf_counter() - start)


class _GatherColumns(torch.autograd.Function):
    """Forward: one buffer, edge padding written in place. Backward: the adjoint."""

    @staticmethod
    def forward(ctx, local, plan, rank, group, pad_lo=0, pad_hi=0, value=0.0):
        # The backward runs after the model's forward returned: keep the runtime's stats.
        ctx.plan, ctx.rank, ctx.group, ctx.stats = plan, rank, group, current_runtime().stats
        ctx.local_shape, a, pieces = local.shape, plan.owned[rank][0], plan.pieces(rank)
        total = sum(e - s for _, s, e in pieces)
        out = empty_as(local, (*local.shape[:-1], pad_lo + total + pad_hi))
        for at, n in ((0, pad_lo), (pad_lo + total, pad_hi)):
            if n:
                out.narrow(-1, at, n).fill_(value)
        recvs, arrivals, offset = [], [], pad_lo  # arrivals: (window slice, receive buffer)
        ctx.placed = []  # (offset in the window, owner, start, stop) per piece
        for owner, s, e in pieces:
            dst = out.narrow(-1, offset, e - s)
            ctx.placed.append((offset, owner, s, e))
            offset += e - s
            if owner == rank:
                dst.copy_(local.narrow(-1, s - a, e - s))
            else:  # gloo needs contiguous buffers: receive, then place
                buf = local.new_empty((*local.shape[:-1], e - s))
                recvs.append((owner, buf))
                arrivals.append((dst, buf))
        sends = [(q, local.narrow(-1, s - a, e - s).contiguous()) for q, s, e in plan.sends(rank)]
        # Nothing to move when the other dims are empty (an empty window's halos along the
        # next dim; every peer sees it too): no zero-size message (NCCL's is not relied on).
        if 0 not in ctx.local_shape[:-1]:
            post_p2p(group, sends, recvs, ctx.stats).wait()
        for dst, buf in arrivals:
            dst.copy_(buf)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, (a, b), given = ctx.rank, ctx.plan.owned[ctx.rank], ctx.plan.sends(ctx.rank)
        own = [(off, s, e) for off, q, s, e in ctx.placed if q == rank]
        if len(own) == 1 and own[0][1:] == (a, b):
            # The usual case: the window holds the whole strip once; no zero-fill needed.
            grad_local = grad.narrow(-1, own[0][0], b - a)
            grad_local = grad_local.clone() if given else grad_local
        else:
            grad_local = empty_as(grad, ctx.local_shape).zero_()
            for off, s, e in own:
                grad_local.narrow(-1, s - a, e - s).add_(grad.narrow(-1, off, e - s))
        # Gradients of the columns this rank received go back to their owners, of those it
        # gave arrive here, to be added to its own.
        sends = [
            (q, grad.narrow(-1, o, e - s).contiguous()) for o, q, s, e in ctx.placed if q != rank
        ]
        recvs = [(q, grad.new_empty((*grad.shape[:-1], e - s)), s, e) for q, s, e in given]
        if 0 not in ctx.local_shape[:-1]:  # (as in the forward)
            post_p2p(ctx.group, sends, [(q, buf) for q, buf, _, _ in recvs], ctx.stats).wait()
        for _, buf, s, e in recvs:
            grad_local.narrow(-1, s - a, e - s).add_(buf)
        return grad_local, None, None, None, None, None, None


@not_traced  # an exchange inside an autograd function (see _compile.py)
def gather_columns(
    local: Tensor,
    plan: ExchangePlan,
    rank: int,
    group,
    pad_lo: int = 0,
    pad_hi: int = 0,
    value: float = 0.0,
) -> Tensor:
    """The columns ``plan.needed[rank]`` (in order) from the local strip ``local`` (columns
    ``plan.owned[rank]``) and its neighbours', between ``pad_lo``/``pad_hi`` columns of
    ``value``. Differentiable: halo gradients go back to the columns' owners."""
    if len(plan.owned) == 1 and not (pad_lo or pad_hi):  # no communication, no copy
        # (the whole strip as is: a full-width narrow's backward allocates its gradient NCHW)
        parts = [
            local if (s, e) == (0, local.shape[-1]) else local.narrow(-1, s, e - s)
            for s, e in plan.needed[0]
        ] or [local.narrow(-1, 0, 0)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return _GatherColumns.apply(local, plan, rank, group, pad_lo, pad_hi, value)


class _SumGradOverGroups(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over process groups."""

    @staticmethod
    def forward(ctx, param: Tensor, groups: tuple) -> Tensor:
        ctx.groups = groups
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad, None


def sum_grad_over(param: Tensor | None, groups: tuple) -> Tensor | None:
    """``param`` unchanged in forward; its gradient (a partial sum over the local part)
    summed over ``groups`` in backward: by the runtime's ``GradReducer`` for a leaf
    (bucketed, overlapped), by an all-reducing autograd node otherwise."""
    if param is None or not groups or not (param.requires_grad and torch.is_grad_enabled()):
        return param
    if param.is_leaf:
        return current_runtime().grad_reducer.partial_use(param, groups)
    return _SumGradOverGroups.apply(param, groups)
