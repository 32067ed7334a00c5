"""The arithmetic of sharded normalisation under ``_norm.py``: per-rank moments merged
exactly in one collective, ``_Normalize`` and its analytic backward, batch statistics on
torch's fused kernels (``_fused``); docs/design.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._layout import CHANNELS_LAST, memory_format
from ._small_sum import group_size, sum_now


@dataclass(frozen=True)
class _Cells:
    """A layer's statistics: "batch" (per channel; flat ``(C,)``, as torch's kernels take
    them), "group" or "instance" (per sample: ``(N, groups or C)``); ``count`` global
    elements each, their parts held by the ranks of ``groups``."""

    kind: str
    channels: int
    num_groups: int
    count: int
    groups: tuple

    def collect(self, t: Tensor) -> Tensor:
        """Per-(sample, channel) local sums ``(N, C)`` -> per-statistic local sums."""
        if self.kind == "batch":
            return t.sum(0, keepdim=True)  # (1, C)
        if self.kind == "group":
            return t.reshape(t.shape[0], self.num_groups, -1).sum(2)  # (N, G)
        return t  # (N, C)

    def spread(self, cells: Tensor) -> Tensor:
        """Per-statistic values -> ``(1 or N, C)``, each channel with its statistic."""
        if self.kind == "group":
            return cells.repeat_interleave(self.channels // self.num_groups, dim=1)
        return cells[None] if cells.dim() == 1 else cells


def _hw(t: Tensor) -> Tensor:
    """``(1 or N, C)`` -> ``(1 or N, C, 1, 1)``: one view op (indexing with ``None`` runs two)."""
    return t.reshape(*t.shape, 1, 1)


@functools.cache
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics' precision for ``dtype``: fp32 or better (cached: an aten op per call)."""
    return torch.promote_types(dtype, torch.float32)


#: Input dtypes whose statistics and normalisation torch's kernels take in fp32 (its
#: mixed-dtype batch norm: fp32 statistics and affine, output in the input's dtype).
_LOW = (torch.bfloat16, torch.float16)


@functools.cache
def _kernel_stats(device: str, dtype: torch.dtype, channels_last: bool) -> bool:
    """Whether a part's moments come from ``torch.batch_norm_update_stats`` (one fused pass)
    instead of two, per device type, dtype and layout: not fp64 (its digits), nor contiguous
    fp32 on CPU (slower: docs/benchmarks.md, "Batch norm on the fused kernels")."""
    if dtype not in _LOW + (torch.float32,):
        return False
    if device == "cpu" and dtype == torch.float32 and not channels_last:
        return False
    x = torch.arange(16, dtype=dtype, device=device).view(2, 2, 2, 2)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    try:
        mean, var = torch.batch_norm_update_stats(x, *_placeholders(x, 2), 0.0)
    except (RuntimeError, NotImplementedError):
        return False
    # fp32 results, the biased variance (channel 0 holds 0-3 and 8-11, channel 1 4-7, 12-15)
    want = torch.tensor([[5.5, 9.5], [17.25, 17.25]], device=device)
    return mean.dtype == var.dtype == torch.float32 and torch.equal(torch.stack([mean, var]), want)


def _placeholders(x: Tensor, channels: int) -> tuple[Tensor, Tensor]:
    """fp32 running statistics (momentum 0): a low-precision input's moments in fp32."""
    zeros = torch.zeros(2, channels, dtype=torch.float32, device=x.device)
    return zeros[0], zeros[1]


def _local_moments(x: Tensor, cells: _Cells) -> tuple[int, Tensor, Tensor]:
    """(elements per statistic, mean, M2) of this rank's part in fp32 or better: by
    ``batch_norm_update_stats`` where ``_kernel_stats`` allows (group and instance norm on
    the ``(1, N * groups, -, W)`` view of a contiguous part), else two passes (the mean,
    then squared deviations: no cancellation for large means)."""
    acc = _acc_dtype(x.dtype)
    stats = cells.num_groups  # (batch norm: the channels)
    view = x if cells.kind == "batch" and x.numel() else None  # empty: the passes give zeros
    if cells.kind != "batch" and x.numel() and x.is_contiguous():
        view = x.reshape(1, x.shape[0] * stats, -1, x.shape[3])
    if view is not None:
        layout = memory_format(view) is not torch.contiguous_format
        if _kernel_stats(x.device.type, x.dtype, layout):
            n = view.numel() // max(view.shape[1], 1)
            mean, var = torch.batch_norm_update_stats(view, *_placeholders(x, view.shape[1]), 0.0)
            if cells.kind == "batch":
                return n, mean, var * n
            return n, mean.view(x.shape[0], stats), var.view(x.shape[0], stats) * n
    if cells.kind == "batch":  # over (N, H, W) at once: fewer ops than (H, W), then N
        n = x.numel() // max(stats, 1)
        # (1, C, 1, 1); ``mean`` is the sum divided by ``n`` in one op (empty: zeros)
        mean = (x.mean if n else x.sum)((0, 2, 3), dtype=acc, keepdim=True)
        m2 = (x.to(acc) - mean).square_().sum((0, 2, 3))
        return n, mean.view(stats), m2
    s = cells.collect(x.sum((2, 3), dtype=acc))
    n = x.numel() // max(s.numel(), 1)  # elements of each statistic held by this rank
    mean = s / max(n, 1)
    m2 = cells.collect((x.to(acc) - _hw(cells.spread(mean))).square_().sum((2, 3)))
    return n, mean, m2


@torch.no_grad()
def _moments(x: Tensor, cells: _Cells) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance of every statistic from the local 4-D part ``x``:
    the parts' moments merged exactly (Chan et al.: ``M2 = sum M2_i + sum n_i (mean_i -
    mean)^2``) from one collective per group, the same values in the same order on every
    rank (bit-identical statistics)."""
    n, mean, m2 = _local_moments(x, cells)
    count: Tensor | int = n
    for group in cells.groups:
        if group_size(group) > 1:
            if isinstance(count, int):
                count = torch.full_like(mean, n)
            count, mean, m2 = _merge_moments(count, mean, m2, group)
    return mean, m2 / cells.count


def _merge_moments(count: Tensor, mean: Tensor, m2: Tensor, group) -> tuple[Tensor, ...]:
    """(count, mean, M2) over the ranks of ``group``: each rank's moments in its own slot of
    a zeroed buffer, summed (an all-gather's values as the reduction the communication audit
    expects from a norm layer)."""
    parts = torch.stack([count, mean, m2])
    ranks = group_size(group)
    slots = parts.new_zeros(ranks * parts.numel())  # flat: statistics, not a spatial map
    slots.view(ranks, -1)[dist.get_rank(group)] = parts.reshape(-1)
    sum_now(slots, group)
    c, mu, m = slots.view(ranks, *parts.shape).unbind(1)  # each (ranks, *statistics)
    total = c.sum(0)
    merged = (c * mu).sum(0) / total.clamp_min(1)
    return total, merged, m.sum(0) + (c * (mu - merged).square()).sum(0)


def _fused(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean, cells: _Cells) -> bool:
    """Whether batch statistics go through torch's fused batch-norm kernels (inference form,
    fed the global statistics): an input in the statistics' dtype, or a bf16/fp16 one
    where the device's mixed-dtype kernels take it (``_mixed_ok``)."""
    affine = all(t is None or t.is_floating_point() for t in (weight, bias))
    if cells.kind != "batch" or not affine:
        return False
    if x.dtype == mean.dtype:
        return True
    # CUDA's bf16 sums are fp32-exact on its channels-last kernels only (docs/benchmarks.md)
    layout_ok = x.device.type == "cpu" or _cl_format(x) is not None
    return layout_ok and _mixed_ok(x.device.type, x.dtype, mean.dtype)


def _cl_format(x: Tensor) -> torch.memory_format | None:
    """``x``'s channels-last memory format if it is laid out so, else None."""
    fmt = CHANNELS_LAST.get(x.dim())
    return fmt if fmt is not None and x.is_contiguous(memory_format=fmt) else None


@functools.cache
def _mixed_ok(device: str, dtype: torch.dtype, stats: torch.dtype) -> bool:
    """Whether the device's batch-norm kernels (inference form and the affine-gradient
    backward) take a ``dtype`` input with ``stats``-dtype statistics and affine; decided
    once per device type and dtypes, with a tiny probe."""
    if dtype not in _LOW or stats != torch.float32:
        return False
    x = torch.ones(2, 2, 2, 2, dtype=dtype, device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    p = torch.ones(2, dtype=stats, device=device)
    try:
        y = torch.batch_norm(x, p, p, p, p, False, 0.0, 1e-5, False)
        grads = _affine_sums(y, x, p, (p, p), p, 1e-5)
        dx = _dx(y, x, p, (p, p), p, grads, 8, 1e-5)
    except (RuntimeError, NotImplementedError):
        return False
    return y.dtype == dx.dtype == dtype and grads[0].dtype == stats


def _as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


class _Normalize(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias``; the backward goes through the statistics, its
    sums reduced like them; only ``x`` is saved. Batch statistics: ``_fused_backward``."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, cells: _Cells, reduce_affine=False):
        invstd = torch.rsqrt(var + eps)
        ctx.fused = _fused(x, weight, bias, mean, cells)
        if ctx.fused:  # batch statistics: flat (``_Cells``)
            w, b = _as(weight, mean.dtype), _as(bias, mean.dtype)
            y = torch.batch_norm(x, w, b, mean, var, False, 0.0, eps, False)
        else:
            scale = cells.spread(invstd)
            if weight is not None:
                scale = scale * weight
            y = torch.sub(x, _hw(cells.spread(mean))).mul_(_hw(scale))
            if bias is not None:
                y.add_(_hw(bias[None]))
        ctx.save_for_backward(x, weight, mean, var, invstd)
        ctx.cells, ctx.reduce_affine, ctx.eps = cells, reduce_affine, eps
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, var, invstd = ctx.saved_tensors
        cells: _Cells = ctx.cells
        want_dx = ctx.needs_input_grad[0]
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        if ctx.fused:  # ``w`` always defined: ones without affine (``gw`` does not use it)
            w = _as(weight, mean.dtype) if weight is not None else torch.ones_like(mean)
            wants = (want_dx, want_dw, want_db)
            return _fused_backward(ctx, dy.to(x.dtype), x, weight, w, mean, var, invstd, wants)
        w = weight if weight is not None else torch.ones_like(cells.spread(invstd)[0])
        s = cells.spread(invstd)  # (1 or N, C)
        xmu = x.to(s.dtype) - _hw(cells.spread(mean))
        g = dy.to(s.dtype)
        s1 = g.sum((2, 3))  # local sum of dy per (sample, channel)
        s2 = (g * xmu).sum((2, 3))  # local sum of dy * (x - mean)
        dx = None
        # One all-reduce: the sums for dx and, with ``reduce_affine``, the affine gradients
        # (otherwise ``sum_grad_over`` completes them).
        parts = [cells.collect(s1 * w), cells.collect(s2 * w)] if want_dx else []
        local_dw = (s2 * s).sum(0) if want_dw else None
        local_db = s1.sum(0) if want_db else None
        shared = [t for t in (local_dw, local_db) if t is not None and ctx.reduce_affine]
        flat = [t.reshape(-1) for t in parts + shared]
        if flat:
            red = sum_now(torch.cat(flat), *cells.groups)
            pieces = list(red.split([t.numel() for t in flat]))
            if want_dx:
                a = cells.spread(pieces.pop(0).view_as(parts[0]) / cells.count)
                b = cells.spread(pieces.pop(0).view_as(parts[1]) / cells.count)
                # dx = invstd * (w*dy - mean(w*dy) - xhat * mean(w*dy * xhat))
                dx = xmu.mul_(_hw(-s.pow(3) * b)).addcmul_(g, _hw(s * w)).sub_(_hw(s * a))
                dx = dx.to(x.dtype)
            if ctx.reduce_affine:
                local_dw = pieces.pop(0) if want_dw else None
                local_db = pieces.pop(0) if want_db else None
        dw = local_dw.to(weight.dtype) if want_dw else None
        db = local_db.to(ctx.bias_dtype) if want_db else None
        return dx, dw, db, None, None, None, None, None


def _fused_backward(ctx, dy, x, weight, w, mean, var, invstd, wants):
    """``_Normalize.backward`` of batch statistics on torch's fused kernels: with ``gw =
    sum(dy * xhat)``, ``gb = sum(dy)`` (global; batch norm's affine gradients, one
    all-reduce) and ``a = invstd * w``, ``dx = a * dy - xhat * (a * gw / count) - a * gb /
    count``: three passes over the local part instead of about ten."""
    cells: _Cells = ctx.cells
    want_dx, want_dw, want_db = wants
    stats = (mean, var)  # flat, as ``invstd`` (``_Cells``)
    if x.dtype != mean.dtype and x.device.type != "cpu":
        dy = dy.contiguous(memory_format=_cl_format(x))  # the exact kernels (``_fused``)
    gw, gb = _affine_sums(dy, x, w, stats, invstd, ctx.eps)
    if want_dx or ctx.reduce_affine:
        sums = (gw, gb)  # on one rank of every group the parts are the sums
        if any(group_size(g) > 1 for g in cells.groups):
            # ``torch.cat`` copies: ``gw``/``gb`` stay this rank's parts
            sums = sum_now(torch.cat([gw, gb]), *cells.groups).split(gw.numel())
        if ctx.reduce_affine:
            gw, gb = sums
    dx = None
    if want_dx:
        dx = _dx(dy, x, w, stats, invstd, sums, cells.count, ctx.eps)
    dw = gw.to(weight.dtype) if want_dw else None
    db = gb.to(ctx.bias_dtype) if want_db else None
    return dx, dw, db, None, None, None, None, None


def _dx(dy, x, w, stats, invstd, sums, count: int, eps) -> Tensor:
    """``a * dy - xhat * (a * gw / count) - a * gb / count`` with ``a = invstd * w`` and
    ``sums = (gw, gb)`` global, rounded once to ``x``'s dtype: the terms can cancel
    (docs/design.md, "Normalisation statistics in one collective")."""
    if x.dtype != stats[0].dtype and x.device.type != "cpu":
        # SyncBatchNorm's kernel: fp32 inside, one rounding; the sums as means (its count
        # tensor is int32, too small for the pixels of a whole slide)
        one = torch.ones(1, dtype=torch.int32, device=x.device)
        return torch.batch_norm_backward_elemt(
            dy, x, stats[0], invstd, w, sums[1] / count, sums[0] / (invstd * count), one
        )
    # in the statistics' dtype, rounded once (bf16 / fp16 on CPU: a low-precision
    # ``addcmul_`` with an fp32 scale takes CPU's unvectorised mixed-dtype loop, torch 2.14)
    a = invstd * w
    shift = (a * sums[0] / -count, a * sums[1] / -count)
    dx = torch.batch_norm(x.to(a.dtype), *shift, *stats, False, 0.0, eps, False)
    dx = dx.addcmul_(dy.to(a.dtype), a.view((1, -1) + (1,) * (x.dim() - 2)))
    return dx.to(x.dtype)


def _affine_sums(dy, x, w, stats, invstd, eps) -> tuple[Tensor, Tensor]:
    """Local ``sum(dy * xhat)`` and ``sum(dy)`` per channel (the affine gradients' mask).
    CUDA's kernel asserts that ``save_mean`` / ``save_invstd`` are defined (torch 2.11, H200:
    "save_mean should always be defined"; CPU takes ``None``)."""
    _, gw, gb = torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, stats[0], invstd, True, eps, [False, True, True]
    )
    return gw, gb
