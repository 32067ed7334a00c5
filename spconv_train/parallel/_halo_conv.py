"""Zero-padded convolution along a sharded last dim without a padded copy, the exchange
overlapped with the interior; "same" convolutions convolve the whole strip and add the halo's
share per kernel tap (docs/halo.md, docs/design.md). Saved: the strip, thin halos, the weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._compile import not_traced
from ._halo import post_p2p
from ._layout import CHANNELS_LAST, empty_as
from ._runtime import current_runtime
from ._window import WindowPlan


@dataclass(frozen=True)
class SplitPlan:
    """One rank's output columns (local indices): interior ``[i0, i1)`` from strip columns
    ``strip_cols`` with width padding ``pad``; per edge ``(first output, count, global input lo,
    hi)``; ``halos``: received ``(owner, start, stop)``. ``whole_strip`` ("same": stride 1, output
    strips = input strips): the padded strip plus per run ``corrections`` ``(halo index, tap,
    first output, first halo column, length)``."""

    interior: tuple[int, int]
    strip_cols: tuple[int, int]
    edges: tuple[tuple[int, int, int, int], ...]
    halos: tuple[tuple[int, int, int], ...]
    pad: int = 0
    corrections: tuple[tuple[int, int, int, int, int], ...] = ()
    whole_strip: bool = False


@functools.lru_cache(maxsize=4096)
def plan_split(
    wp: WindowPlan, rank: int, kernel: int, stride: int, dilation: int, pad_lo: int
) -> SplitPlan | None:
    """The split for ``rank``, or ``None`` when some rank has no interior output column:
    every rank then takes the window path (the same choice on every rank: the two paths
    order their backward messages differently, a mix would deadlock)."""
    splits, reach = [], dilation * (kernel - 1)
    for r, ((a, b), (o0, o1)) in enumerate(zip(wp.exchange.owned, wp.out_bounds, strict=True)):
        # Output j reads input columns [j*s - pad_lo, j*s - pad_lo + reach].
        i0 = max(o0, -(-(a + pad_lo) // stride))
        i1 = min(o1, (b + pad_lo - reach - 1) // stride + 1)
        if i1 <= i0:
            return None
        edges = tuple(
            (p - o0, q - p, p * stride - pad_lo, (q - 1) * stride - pad_lo + reach + 1)
            for p, q in ((o0, i0), (i1, o1))
            if q > p
        )
        c0, c1 = i0 * stride - pad_lo - a, (i1 - 1) * stride - pad_lo + reach + 1 - a
        halos = tuple((q, s, e) for q, s, e in wp.exchange.pieces(r) if q != r)
        splits.append(SplitPlan((i0 - o0, i1 - o0), (c0, c1), edges, halos))
    if stride != 1 or 2 * pad_lo != reach or wp.out_bounds != wp.exchange.owned:  # not "same"
        return splits[rank]
    (a, b), runs, halos = wp.exchange.owned[rank], [], splits[rank].halos
    for first, count, _, _ in splits[rank].edges:  # the outputs whose tap t reads a halo
        for i, (_, hs, he) in enumerate(halos):
            for t in range(kernel):
                base = a + first - pad_lo + t * dilation  # global column output ``first`` reads
                j0, j1 = max(0, hs - base), min(count, he - base)
                if j1 > j0:
                    runs.append((i, t, first + j0, base + j0 - hs, j1 - j0))
    return SplitPlan((0, b - a), (0, b - a), (), halos, pad_lo, tuple(runs), True)


def _thin_window(lo: int, hi: int, sources: list[tuple[int, Tensor]], like: Tensor) -> Tensor:
    """Global input columns ``[lo, hi)`` from ``(first column, columns)`` sources, else zeros."""
    out = empty_as(like, (*like.shape[:-1], hi - lo)).zero_()  # in like's layout
    for start, cols in sources:
        s, e = max(lo, start), min(hi, start + cols.shape[-1])
        if s < e:
            out.narrow(-1, s - lo, e - s).copy_(cols.narrow(-1, s - start, e - s))
    return out


def _add_thin_grad(lo: int, grad: Tensor, start: int, target: Tensor) -> None:
    """Add the part of ``grad`` (global columns from ``lo``) on ``target`` (from ``start``)."""
    s, e = max(lo, start), min(lo + grad.shape[-1], start + target.shape[-1])
    if s < e:
        target.narrow(-1, s - start, e - s).add_(grad.narrow(-1, s - lo, e - s))


#: the local convolution per spatial rank
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _cols(t: Tensor, c0: int, c1: int) -> Tensor:
    """Columns ``[c0, c1)`` of ``t`` (``t`` itself when they are all of them)."""
    return t if c0 == 0 and c1 == t.shape[-1] else t.narrow(-1, c0, c1 - c0)


def _columns_to_batch(x: Tensor) -> Tensor:
    """``(N, C, *S, L)`` -> ``(N*L, C, *S)``: one convolution of one rank less with a tap's
    weight then gives that tap's share of the whole run (docs/design.md, "Halo corrections")."""
    n, w = x.shape[0], x.shape[-1]
    return x.squeeze(-1) if w == 1 else x.movedim(-1, 1).reshape(n * w, *x.shape[1:-1])


def _batch_to_columns(y: Tensor, n: int) -> Tensor:  # (N*L, C, *S) -> (N, C, *S, L)
    return y.view(n, -1, *y.shape[1:]).movedim(1, -1)


def _buffers(like: Tensor, pieces) -> list[tuple[int, int, Tensor]]:
    """``(peer, first column, receive buffer)`` per ``(peer, start, stop)`` piece."""
    return [(q, s, like.new_empty((*like.shape[:-1], e - s))) for q, s, e in pieces]


class _HaloConv(torch.autograd.Function):
    """The convolution of ``halo_conv``; ``geo`` = (stride, pad_other, dilation, groups)."""

    @staticmethod
    def forward(ctx, local, weight, bias, wp, split, rank, group, geo):
        stride, pad_other, dilation, groups = geo
        conv, conv_less = _CONV[local.ndim - 2], _CONV[local.ndim - 3]
        stats, ex, a = current_runtime().stats, wp.exchange, wp.exchange.owned[rank][0]
        halos = _buffers(local, split.halos)
        sends = [(q, local.narrow(-1, s - a, e - s).contiguous()) for q, s, e in ex.sends(rank)]
        pending = post_p2p(group, sends, [(q, buf) for q, _, buf in halos], stats)
        geom = (stride, (*pad_other, split.pad), dilation, groups)
        out = conv(_cols(local, *split.strip_cols), weight, bias, *geom)
        pending.wait()
        for i, t, o, h, length in split.corrections:  # "same": the edges read zeros, not halos
            cols = _columns_to_batch(halos[i][2].narrow(-1, h, length))
            y = conv_less(cols, weight[..., t], None, stride[:-1], pad_other, dilation[:-1], groups)
            out.narrow(-1, o, length).add_(_batch_to_columns(y, out.shape[0]))
        sources, left, right = [(a, local), *((s, h) for _, s, h in halos)], [], []
        for first, _, lo, hi in split.edges:
            edge = conv(_thin_window(lo, hi, sources, local), weight, bias, *geom)
            (left if first < split.interior[0] else right).append(edge)
        out = torch.cat([*left, out, *right], dim=-1) if left or right else out
        ctx.save_for_backward(local, weight, *(h for _, _, h in halos))
        ctx.meta = (wp, split, rank, group, geo, stats, bias is not None)
        return out

    @staticmethod
    @once_differentiable  # the halo sends are not differentiable: refuse double backward
    def backward(ctx, grad_out):
        local, weight, *bufs = ctx.saved_tensors
        wp, split, rank, group, geo, stats, has_bias = ctx.meta
        stride, pad_other, dilation, groups = geo
        a, geom_pad = wp.exchange.owned[rank][0], (*pad_other, split.pad)
        halos = [(q, s, h) for (q, s, _), h in zip(split.halos, bufs, strict=True)]
        need_in, need_w, need_b = *ctx.needs_input_grad[:2], has_bias and ctx.needs_input_grad[2]

        def conv_bwd(g, x, w=weight, pad=(*pad_other, 0), mask=(need_in, need_w, need_b)):
            k = w.ndim - 2  # a halo run's tap convolves the other dims only
            args = (list(stride[:k]), list(pad), list(dilation[:k]), False, [0] * k, groups)
            sizes = [weight.shape[0]] if mask[2] else None
            # dense in the format the convolution computes in (channels-last when x or w is):
            # g.contiguous() would copy a channels-last gradient to NCHW, the kernel back again
            cl = any(t.dim() in (4, 5) and t.shape[1] > 1 and t.stride(1) == 1 for t in (x, w))
            fmt = CHANNELS_LAST[g.dim()] if cl else torch.contiguous_format
            g = g.contiguous(memory_format=fmt)
            return torch.ops.aten.convolution_backward(g, x, w, sizes, *args, mask)

        def add(x, y):
            return y if x is None else (x if y is None else x + y)

        gw, gb, runs, edge_grads = None, None, [], []
        # Edges first: their input gradients hold the halo gradients to send back.
        for i, t, o, h, length in split.corrections:  # the halos' share of the gradients
            _, hs, halo = halos[i]
            g = _columns_to_batch(grad_out.narrow(-1, o, length))
            cols = _columns_to_batch(halo.narrow(-1, h, length))
            gx, gwt, _ = conv_bwd(g, cols, weight[..., t], pad_other, [need_in, need_w, False])
            if need_in:
                runs.append((hs + h, _batch_to_columns(gx, halo.shape[0])))
            if need_w:
                gw = weight.new_zeros(weight.shape) if gw is None else gw
                gw[..., t] += gwt
        for first, count, lo, hi in split.edges:
            window = _thin_window(lo, hi, [(a, local), *((s, h) for _, s, h in halos)], local)
            gi, gwe, gbe = conv_bwd(grad_out.narrow(-1, first, count), window)
            edge_grads.append((lo, gi))
            gw, gb = add(gw, gwe), add(gb, gbe)
        if need_in:  # the halos' gradients back to their owners, ours from theirs
            sends = []
            for q, start, buf in halos:
                g = buf.new_zeros(buf.shape)
                for lo, gi in (*runs, *edge_grads):
                    _add_thin_grad(lo, gi, start, g)
                sends.append((q, g))
            recvs = _buffers(local, wp.exchange.sends(rank))
            pending = post_p2p(group, sends, [(q, buf) for q, _, buf in recvs], stats)
        # The interior (the big one) while the halo gradients travel.
        (i0, i1), (c0, c1) = split.interior, split.strip_cols
        gi, gwi, gbi = conv_bwd(_cols(grad_out, i0, i1), _cols(local, c0, c1), pad=geom_pad)
        gw, gb, grad_local = add(gw, gwi), add(gb, gbi), gi
        if need_in:
            if c0 != 0 or c1 != local.shape[-1]:
                grad_local = torch.zeros_like(local)  # in local's layout
                grad_local.narrow(-1, c0, c1 - c0).copy_(gi)
            for lo, g in edge_grads:
                _add_thin_grad(lo, g, a, grad_local)
            pending.wait()
            for _, s, buf in recvs:
                _add_thin_grad(s, buf, a, grad_local)
        return grad_local, gw, gb, None, None, None, None, None


@not_traced  # an exchange inside an autograd function (see _compile.py)
def halo_conv(local, weight, bias, wp, split, rank, group, stride, pad_other, dilation, groups):
    """This rank's output of the convolution; ``pad_other``: the other dims' padding."""
    if local.ndim == 3:  # a 1-D signal: an image of height 1 (the halo runs need a height)
        args = (wp, split, rank, group, (1, *stride), (0,), (1, *dilation), groups)
        return halo_conv(local.unsqueeze(2), weight.unsqueeze(2), bias, *args).squeeze(2)
    geo = (tuple(stride), tuple(pad_other), tuple(dilation), groups)
    device = local.device.type
    if not torch.is_autocast_enabled(device):
        return _HaloConv.apply(local, weight, bias, wp, split, rank, group, geo)
    # Autocast's casts for F.conv2d, done here: the backward runs without autocast.
    low = torch.get_autocast_dtype(device)
    args = (local.to(low), weight.to(low), None if bias is None else bias.to(low))
    with torch.autocast(device, enabled=False):
        return _HaloConv.apply(*args, wp, split, rank, group, geo)
