"""The ring (``Ring``: blocks travelling point to point) and ring attention on it; masks in
``_ring_mask.py``. docs/attention.md, "Exact global attention: the ring"."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ._halo import PendingExchange, post_p2p
from ._ring_mask import RingMask, Span, finite
from ._runtime import current_runtime

#: Pieces per block (``m``) when not given, and the smallest automatic piece: memory against
#: per-piece calls and messages (docs/attention.md, the ring; docs/benchmarks.md, "Ring attention")
PIECES, MIN_PIECE_TOKENS = 8, 64

KV, GRAD = 1, 2  # message tags: travelling pieces, gradient accumulators
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

Blocks = tuple[Tensor, ...]  # one piece (or block) of every operand that travels


def auto_pieces(sizes: tuple[int, ...]) -> int:
    """``m`` for blocks of ``sizes`` tokens: ``PIECES``, fewer below ``MIN_PIECE_TOKENS``."""
    return max(1, min(PIECES, max(sizes) // MIN_PIECE_TOKENS))


class Ring:
    """One ring call's schedule. ``sizes``: tokens (dim -2) of every rank's blocks;
    ``pieces``: ``m``; ``blocks``: this rank's (all but dim -2 alike on every rank)."""

    def __init__(self, group, sizes: tuple[int, ...], pieces: int, blocks: Blocks):
        self.group, self.pieces, self.parts = group, pieces, len(sizes)
        self.specs = tuple((t.shape[:-2], t.shape[-1]) for t in blocks)
        self.like, self.steps = blocks[0], self.parts * pieces
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.parts, (self.rank - 1) % self.parts
        # pieces of every owner's block, as token ranges, within one token of each other
        self.bounds = [
            [(n * j // pieces, n * (j + 1) // pieces) for j in range(pieces)] for n in sizes
        ]

    def span(self, step: int, rank: int | None = None) -> Span:
        """The piece ``rank`` (this one by default) works on at ``step``."""
        owner = ((self.rank if rank is None else rank) - step % self.parts) % self.parts
        return (owner, *self.bounds[owner][step // self.parts])

    def own(self, blocks: Blocks, piece: int) -> Blocks:
        """Views of this rank's piece ``piece`` of ``blocks``."""
        lo, hi = self.bounds[self.rank][piece]
        return tuple(t.narrow(-2, lo, hi - lo) for t in blocks)

    def empty(self, span: Span) -> Blocks:
        """Uninitialised tensors of a piece, one per operand."""
        return tuple(self.like.new_empty(*lead, span[2] - span[1], e) for lead, e in self.specs)

    def _post(
        self, sends: Blocks | None, span: Span | None, tag: int
    ) -> tuple[PendingExchange, Blocks | None]:
        """Send ``sends`` to the next rank, receive a piece ``span`` from the previous one:
        ``(pending, receive buffers)``; empty pieces are not sent (both know every size)."""
        recv = self.empty(span) if span else None
        sends = [(self.next, t) for t in sends] if sends and sends[0].shape[-2] else []
        recvs = [(self.prev, t) for t in recv] if recv and recv[0].shape[-2] else []
        return post_p2p(self.group, sends, recvs, current_runtime().stats, tag=tag), recv

    def run(self, blocks: Blocks, fn: Callable[[Span, Blocks], Blocks | None], grads=False):
        """``fn(span, piece)`` on every piece of every rank's ``blocks`` in ring order, the
        next transfer overlapped. With ``grads``: ``fn`` gives this rank's part of the piece's
        gradients, summed by accumulators one step behind; returns those of ``blocks``."""
        home = None  # allocated at the first piece home (m = 1: the received buffers)

        def store(piece: int, grads: Blocks) -> None:
            nonlocal home
            if self.pieces == 1:  # after the ring: the peak does not hold the pieces too
                home = grads
                return
            home = tuple(torch.empty_like(t) for t in blocks) if home is None else home
            for dst, src in zip(self.own(home, piece), grads, strict=True):
                dst.copy_(src)

        cur = sent = None  # the piece worked on; the accumulator sent last step
        for step in range(self.steps):
            own = step % self.parts == 0  # an own piece (and a finished accumulator arrives)
            if own:  # (dense: gloo sends dense tensors)
                cur = tuple(t.contiguous() for t in self.own(blocks, step // self.parts))
            # the accumulator sent at step - 1: this piece's, or an own one's (home)
            acc = self._post(None, self.span(step - 1, self.prev), GRAD) if grads and step else None
            # the next piece, unless the round ends here (the next one is an own one)
            end = (step + 1) % self.parts == 0
            pending, nxt = self._post(*((None, None) if end else (cur, self.span(step + 1))), KV)
            if sent is not None:
                # the next rank posted its receive at the start of this step too: the wait
                # is short, and frees the accumulator before this compute
                sent.wait()
                sent = None  # (it holds a buffer)
            part = fn(self.span(step), cur)
            cur = None
            if acc is not None:
                acc[0].wait()
                if own:  # an own piece's gradients, after their last visit
                    store(step // self.parts - 1, acc[1])
                else:  # add this rank's part into the received accumulator
                    part = tuple(s.add_(g) for s, g in zip(acc[1], part, strict=True))
            acc = None
            if grads:
                sent = self._post(tuple(t.contiguous() for t in part), None, GRAD)[0]
            del part
            pending.wait()
            cur = nxt
        if not grads:
            return None
        last, part = self._post(None, self.span(self.steps - 1, self.prev), GRAD)  # the last
        last.wait()
        store(self.pieces - 1, part)
        sent.wait()
        return home


def _flash(q: Tensor, v: Tensor, mask: Tensor | None) -> tuple[bool, Tensor | None]:
    """Whether the CPU flash kernel takes the piece (4-dim queries alone), and ``mask`` as
    it takes it: 4 dims (it takes 2 or 4: a mask of fewer is widened)."""
    fits = q.ndim == 4 and (mask is None or mask.ndim <= 4)
    ok = q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and fits
    if ok and mask is not None:
        mask = mask.view((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return ok, mask


class RingAttention(torch.autograd.Function):
    """Per piece the CPU flash kernel (its backward given the *global* lse), else matmuls."""

    @staticmethod
    def forward(ctx, q, k, v, bias, kbias, scale, group, sizes, pieces: int, mask: RingMask):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        blocks = (k, v) if kbias is None else (k, v, kbias.contiguous())
        ring = Ring(group, sizes, pieces, blocks)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)

        def work(span: Span, kv: Blocks) -> None:
            nonlocal lse
            if not (q.shape[-2] and kv[0].shape[-2]):
                return
            block = mask.block(bias, span, kv[2:]) if mask else None
            # the piece's output and log-sum-exp (-inf, output 0: a query it does not reach)
            flash, kmask = _flash(q, v, block)
            if flash:
                o_b, lse_b = _FLASH(q, kv[0], kv[1], 0.0, False, attn_mask=kmask, scale=scale)
                if block is not None:  # the kernel gives lse 0 to rows it masks whole
                    lse_b = lse_b.masked_fill((block == -math.inf).all(-1), -math.inf)
            else:
                s = (q @ kv[0].transpose(-2, -1)) * scale
                s = s if block is None else s + block
                lse_b = torch.logsumexp(s, dim=-1)
                o_b = torch.exp(s - finite(lse_b).unsqueeze(-1)) @ kv[1]
            new = torch.logaddexp(lse, lse_b)
            base = finite(new)  # rows no key reached yet stay 0 (not NaN)
            out.mul_(torch.exp(lse - base).unsqueeze(-1))
            out.add_(o_b.mul_(torch.exp(lse_b - base).unsqueeze(-1)))
            lse = new

        ring.run(blocks, work)
        ctx.save_for_backward(q, *blocks, out, finite(lse), bias)
        ctx.ring, ctx.scale, ctx.mask = ring, scale, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, *blocks, out, lse, bias = ctx.saved_tensors
        ring, scale, mask = ctx.ring, ctx.scale, ctx.mask
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dbias = torch.zeros_like(bias) if ctx.needs_input_grad[3] else None
        need_ds = dbias is not None or ctx.needs_input_grad[4]  # the score gradient, formed

        def grads_of(span: Span, kv: Blocks) -> Blocks:
            if not (q.shape[-2] and kv[0].shape[-2]):
                return tuple(t.zero_() for t in ring.empty(span))
            k, v = kv[:2]
            block = mask.block(bias, span, kv[2:]) if mask else None
            flash, kmask = _flash(q, v, block)
            ds = None
            if flash and not need_ds:
                dq_b, dk_b, dv_b = _FLASH_BACKWARD(
                    dout, q, k, v, out, lse, 0.0, False, attn_mask=kmask, scale=scale
                )
            else:
                s = (q @ k.transpose(-2, -1)) * scale
                p = torch.exp((s if block is None else s + block) - lse.unsqueeze(-1))
                dv_b = p.transpose(-2, -1) @ dout
                ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
                dq_b, dk_b = (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale
            dq.add_(dq_b)
            if dbias is not None:
                mask.add_grad(dbias, span, ds)
            # the travelling key mask's gradient (zeros when it needs none) follows it home
            kb = kv[2:]
            if kb and ds is not None:
                kb = (ds.sum_to_size(*kb[0].shape[:-2], 1, ds.shape[-1]).transpose(-2, -1),)
            return dk_b, dv_b, *(torch.zeros_like(t) if ds is None else t for t in kb)

        dk, dv, *dkb = ring.run(tuple(blocks), grads_of, grads=True)
        dkb = dkb[0] if dkb and ctx.needs_input_grad[4] else None
        return dq, dk, dv, dbias, dkb, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    sizes: tuple[int, ...],
    scale: float | None = None,
    pieces: int | None = None,
    bias: Tensor | None = None,
    mask: RingMask | None = None,
    kbias: Tensor | None = None,
) -> Tensor:
    """Exact SDPA of this rank's queries over the keys of every rank of ``group`` (``sizes``
    per rank), ``m`` = ``pieces``; ``bias``: this rank's rows of a mask, ``kbias``: its keys'
    ``(..., L_r, 1)`` (it travels); ``mask`` places them (``RingMask``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if len(sizes) == 1:  # every key here (``group`` may be None)
        kb = () if kbias is None else (kbias,)
        block = mask.block(bias, (0, 0, sizes[0]), kb) if mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block, scale=scale)
    pieces = auto_pieces(tuple(sizes)) if pieces is None else int(pieces)
    if pieces < 1:
        raise ValueError(f"ring_attention: pieces={pieces}; give a count >= 1 or None (automatic)")
    return RingAttention.apply(q, k, v, bias, kbias, scale, group, tuple(sizes), pieces, mask)
