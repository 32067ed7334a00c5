"""Sums of small CPU tensors over a process group by one exchange of messages (docs/design.md,
"Small sums by exchange on CPU"; timings: docs/benchmarks.md, "Case 1"): one round instead
of gloo's two, the same bits on every rank (the norms' statistics rely on it). Tags: halos
0, gradient buckets (posted from hooks, in an order that can differ between ranks)
``BUCKET_TAG``, norm statistics and global pools ``STATS_TAG``. CUDA tensors and those
sending over ``EXCHANGE_SUM_BYTES`` per rank take ``all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._step_meters import counted_as_reduce

#: A CPU tensor is summed by exchange when it sends at most this many bytes per rank (its
#: size times the other ranks); larger ones take gloo's ring all-reduce.
EXCHANGE_SUM_BYTES = 2**20
BUCKET_TAG = 0x5C0A
STATS_TAG = 0x5C0B
#: ``id(group) -> (group, size)`` (holding the group: its id cannot be reused)
_SIZES: dict[int, tuple] = {}


def group_size(group) -> int:
    """``dist.get_world_size(group)`` (a dozen Python calls), cached per group but ``None``."""
    if group is None:
        return dist.get_world_size()
    hit = _SIZES.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _SIZES[id(group)] = (group, dist.get_world_size(group))
    return hit[1]


class ExchangeSum:
    """Sum ``buffer`` over ``group`` by sending it to every other rank; ``wait()`` leaves
    the sum in ``buffer``, added in rank order, so every rank holds the same bits."""

    def __init__(self, buffer: Tensor, group, tag: int = BUCKET_TAG) -> None:
        ranks, me = group_size(group), dist.get_rank(group)
        self.buffer = buffer
        # a contiguous copy: the send buffer must not change while in flight, and gloo
        # sends dense buffers only
        mine = buffer.clone(memory_format=torch.contiguous_format)
        self.parts = [mine if q == me else buffer.new_empty(buffer.shape) for q in range(ranks)]
        ops = [  # every receive, then every send
            dist.P2POp(op, t if op is dist.irecv else mine, group=group, group_peer=q, tag=tag)
            for op in (dist.irecv, dist.isend)
            for q, t in enumerate(self.parts)
            if q != me
        ]
        with counted_as_reduce(buffer):
            self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.buffer.copy_(self.parts[0])
        for part in self.parts[1:]:
            self.buffer.add_(part)


def sum_async(buffer: Tensor, group, tag: int = BUCKET_TAG):
    """Start summing ``buffer`` in place over ``group`` (small, on CPU: by exchange); the
    result has ``wait()``."""
    sends = buffer.numel() * buffer.element_size() * (group_size(group) - 1)
    if not buffer.is_cuda and sends <= EXCHANGE_SUM_BYTES:
        return ExchangeSum(buffer, group, tag)
    return dist.all_reduce(buffer, group=group, async_op=True)


def sum_now(t: Tensor, *groups) -> Tensor:
    """Sum ``t`` in place over each of ``groups`` in turn now and return it: a norm layer's
    statistics, a global pool's partial sums (posted in the same order on every rank)."""
    for group in groups:
        if group_size(group) > 1:
            sum_async(t, group, STATS_TAG).wait()
    return t


class _SumReplicated(torch.autograd.Function):
    """Sum per-rank partial results over a group into a replicated tensor; the backward is
    the identity (the replicated gradient reaches every rank whole, each partial entered
    the sum once)."""

    @staticmethod
    def forward(ctx, t: Tensor, group) -> Tensor:
        return sum_now(t.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sum_replicated(t: Tensor, groups) -> Tensor:
    """``t`` summed over each of ``groups`` in turn, differentiably (``_SumReplicated``)."""
    for group in groups:
        if group_size(group) > 1:
            t = _SumReplicated.apply(t, group)
    return t
