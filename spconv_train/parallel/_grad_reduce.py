"""Bucketed, asynchronous reduction of parameter gradients over the sharding groups
(docs/design.md, "The built-in reducer is bucketed and asynchronous"). A use that
``sum_grad_over`` marks goes through ``_PartialUse``, whose backward adds the use's partial
gradient to the parameter's partial sum; the parameter's hook copies that sum into its
bucket, with a flag (no rank got a gradient: ``.grad`` stays None). Unmarked uses' gradient
is complete on every rank and reaches ``.grad`` unsummed. Small CPU buckets are summed by
one exchange (``_small_sum``; docs/benchmarks.md, "Case 1").
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._small_sum import group_size, sum_async


@dataclass
class _Bucket:
    """Parameters whose gradients are reduced together in one flat buffer."""

    groups: tuple
    params: list[Tensor]
    offsets: list[int]
    buffer: Tensor  # the gradients, then one "had a gradient" flag per parameter
    flags_at: int
    ready: int = 0
    work: object = None
    got: set = field(default_factory=set)


def _layout(entries: list[tuple[Tensor, tuple]], bucket_bytes: int) -> list[_Bucket]:
    """Buckets for ``entries`` (parameter, groups) in the given order; a bucket holds one
    dtype/device/groups combination and closes once it reaches ``bucket_bytes``."""
    closed: list[tuple[tuple, list[Tensor]]] = []
    open_: dict[tuple, tuple[list[Tensor], int]] = {}
    for param, groups in entries:
        key = (groups, param.dtype, param.device)
        params, size = open_.get(key, ([], 0))
        params.append(param)
        open_[key] = (params, size + param.numel() * param.element_size())
        if open_[key][1] >= bucket_bytes:
            closed.append((groups, open_.pop(key)[0]))
    buckets = []
    for groups, params in closed + [(key[0], params) for key, (params, _) in open_.items()]:
        *offsets, at = itertools.accumulate((p.numel() for p in params), initial=0)
        buckets.append(_Bucket(groups, params, offsets, params[0].new_empty(at + len(params)), at))
    return buckets


class _PartialUse(torch.autograd.Function):
    """Identity of a marked parameter; the backward hands the use's gradient to the reducer."""

    @staticmethod
    def forward(ctx, param: Tensor, reducer: GradReducer, key: int) -> Tensor:
        ctx.reducer, ctx.key = reducer, key
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.reducer._partial_grad(ctx.key, grad), None, None


class GradReducer:
    """Sums marked parameters' gradients over their groups per backward (one per runtime;
    ``bucket_bytes``: DDP's default)."""

    def __init__(self, bucket_bytes: int = 25 * 2**20) -> None:
        self.bucket_bytes = bucket_bytes
        #: id -> (parameter, groups), in the order the forward first used them
        self._pending: dict[int, tuple[Tensor, tuple]] = {}
        #: id -> (weak reference to the parameter, hook handle): an id is only a name while
        #: its object lives, so a new parameter at a freed one's address gets its own hook
        self._hooked: dict[int, tuple[weakref.ref, object]] = {}
        self._layouts: dict[tuple, list[_Bucket]] = {}
        self._buckets: list[_Bucket] | None = None  # the running backward's, else None
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        #: id -> the sum of this backward's partial gradients of the parameter's marked uses
        self._partial: dict[int, Tensor] = {}
        self._next = 0
        self.deferred_world: int | None = None  # ``defer_to``'s world; None: summed here

    def defer_to(self, world: int) -> None:
        """Leave the reduction to a wrapper averaging every gradient over ``world`` ranks
        (DDP, FSDP2): a marked partial gradient is scaled by its groups' sizes instead, so
        the average is one device's gradient; complete ones average to themselves."""
        if world < 1:
            raise ValueError(f"defer_to: world must be >= 1, got {world}")
        self.deferred_world = world

    def partial_use(self, param: Tensor, groups: tuple) -> Tensor:
        """``param`` for one use whose gradient is a partial sum over ``groups``, summed at
        the end of the next backward (the other uses' gradient is not)."""
        self.mark(param, groups)
        if id(param) not in self._pending:
            return param
        return _PartialUse.apply(param, self, id(param))

    def _partial_grad(self, key: int, grad: Tensor) -> Tensor:
        """A marked use's gradient: scaled for a wrapper (``defer_to``), else kept for the
        parameter's hook; what the use passes on to the parameter."""
        if self.deferred_world is not None:
            groups = self._pending[key][1]
            return grad * math.prod(group_size(g) for g in groups)
        known = self._partial.get(key)
        self._partial[key] = grad if known is None else known + grad  # never in place: shared
        return torch.zeros_like(grad)

    def mark(self, param: Tensor, groups: tuple) -> None:
        """Sum ``param``'s ``partial_use`` gradients of the next backward over ``groups``."""
        groups = tuple(g for g in groups if group_size(g) > 1)
        if not groups or self._buckets is not None:
            # One-rank groups need nothing; a mark inside a backward comes from activation
            # checkpointing recomputing the forward, whose parameters are already marked.
            return
        key = id(param)
        known = self._pending.get(key)
        if known is not None:
            if known[1] != groups:
                raise ValueError(
                    "sum_grad_over: one parameter meets activations sharded over different "
                    "process groups in one step; its gradient cannot be summed exactly"
                )
            return
        self._pending[key] = (param, groups)
        hooked = self._hooked.get(key)
        if hooked is None or hooked[0]() is not param:
            if len(self._hooked) > 4 * len(self._pending) + 64:  # forget the dead ones
                self._hooked = {k: v for k, v in self._hooked.items() if v[0]() is not None}
            handle = param.register_hook(lambda g, key=key: self._on_grad(key, g))
            self._hooked[key] = (weakref.ref(param), handle)

    def _start(self) -> None:
        entries = list(reversed(self._pending.values()))
        sig = tuple((id(p), g) for p, g in entries)
        buckets = self._layouts.get(sig)
        if buckets is None:
            if len(self._layouts) > 8:  # a model whose graph changes every step
                self._layouts.clear()
            buckets = self._layouts[sig] = _layout(entries, self.bucket_bytes)
        for b in buckets:
            b.ready, b.work, b.got = 0, None, set()
        self._buckets, self._next = buckets, 0
        self._slot = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _on_grad(self, key: int, grad: Tensor) -> None:
        """The parameter's hook: every use's gradient is in; the marked ones' partial sum
        goes to its bucket. ``grad`` (the other uses', complete) reaches ``.grad`` as is."""
        if key not in self._pending:
            return  # used outside a sharded op this time: nothing to sum
        if self.deferred_world is not None:  # scaled per use; clear the marks at the end
            if self._buckets is None:
                self._buckets = []
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            return
        if self._buckets is None:
            self._start()
        partial = self._partial.pop(key, None)
        bucket, i = self._slot[key]
        if partial is not None:
            bucket.buffer.narrow(0, bucket.offsets[i], partial.numel()).copy_(partial.reshape(-1))
            bucket.got.add(i)
        bucket.ready += 1
        self._launch(full_only=True)

    def _launch(self, full_only: bool) -> None:
        """Start the all-reduce of buckets in bucket order (the same order on every rank)."""
        buckets = self._buckets
        while self._next < len(buckets):
            b = buckets[self._next]
            if full_only and b.ready < len(b.params):
                return
            for i, p in enumerate(b.params):
                if i not in b.got:  # no gradient this backward: it contributes zeros
                    b.buffer.narrow(0, b.offsets[i], p.numel()).zero_()
                b.buffer[b.flags_at + i] = 1.0 if i in b.got else 0.0
            b.work = sum_async(b.buffer, b.groups[0])
            self._next += 1

    def _finish(self) -> None:
        """End of the backward: reduce what is left, wait, add the sums to ``.grad``."""
        buckets = self._buckets
        try:
            self._launch(full_only=False)
            for b in buckets:
                b.work.wait()
                for group in b.groups[1:]:  # further groups (a (dp, sp) mesh), in turn
                    sum_async(b.buffer, group).wait()
                # A parameter no rank got a gradient for keeps ``.grad`` None, as on one
                # device: zeros would still let an optimizer decay it and move its moments.
                had = b.buffer[b.flags_at :].tolist()
                for p, at, flag in zip(b.params, b.offsets, had, strict=True):
                    if flag:
                        total = b.buffer.narrow(0, at, p.numel()).view_as(p)
                        p.grad = total.clone() if p.grad is None else p.grad.add_(total)
        finally:
            self._buckets, self._slot, self._partial = None, {}, {}
            self._pending.clear()
            for b in buckets:
                b.work, b.got = None, set()
