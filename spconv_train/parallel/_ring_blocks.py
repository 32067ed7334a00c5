"""The pieces of ring attention: the per-block kernels and the schedule of the travelling pieces.

Each rank's key / value block is cut into ``m`` pieces of about ``L / (P m)`` tokens, and the
pieces travel around the ring instead of whole blocks, so a rank holds a few pieces at a
time, not whole blocks. At every ring step a rank works on one piece; ``P`` pieces circulate
at once, one per rank. A rank injects its own piece ``j`` at step ``j P``; the piece then
moves one rank on per step and after ``P`` steps (one visit per rank) it is retired, and
the rank that owns it injects its next one. Rank ``r`` therefore works at step ``t`` on
piece ``t // P`` of rank ``r - t % P``, and receives from the previous rank what that rank
worked on one step earlier. In the backward each piece's key / value gradient accumulator
follows one step behind the piece and, after its ``P``-th visit, arrives back at the owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._halo import PendingExchange, post_p2p
from ._runtime import current_runtime

#: Pieces per block (``m``) when not given: the pieces a rank holds besides its own tensors
#: at the peak (the one worked on, the one in flight, the received gradient accumulator and
#: the piece's gradients: four key / value pairs) then add up to one block, as large as the
#: unavoidable query-gradient block of the kernel. More pieces save less and cost a kernel
#: call and a message each.
PIECES = 8
#: Smallest piece (tokens) the automatic choice makes: below it the per-piece kernel call
#: and message overheads show in the time.
MIN_PIECE_TOKENS = 64

KV, GRAD = 1, 2  # message tags: key / value pieces, gradient accumulators


def auto_pieces(sizes: tuple[int, ...]) -> int:
    """``m`` for blocks of ``sizes`` tokens: ``PIECES``, fewer where pieces would fall
    under ``MIN_PIECE_TOKENS`` tokens (1 for small blocks). The same on every rank."""
    return max(1, min(PIECES, max(sizes) // MIN_PIECE_TOKENS))


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


Pair = tuple[Tensor, Tensor]  # (key-like, value-like)


class Ring:
    """The schedule of one ring attention call: who sends which piece to whom, when.

    ``sizes``: tokens of every rank's block; ``pieces``: ``m``; ``like``: a tensor of this
    rank with the leading dims, dtype and device of the blocks; ``e`` / ``ev``: the key /
    value head sizes."""

    def __init__(self, group, sizes: tuple[int, ...], pieces: int, like: Tensor, e: int, ev: int):
        self.group, self.like, self.e, self.ev = group, like, e, ev
        self.parts, self.pieces = len(sizes), pieces
        self.steps = self.parts * pieces
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.parts, (self.rank - 1) % self.parts
        # pieces of every owner's block, as token ranges, within one token of each other
        self.bounds = [
            [(n * j // pieces, n * (j + 1) // pieces) for j in range(pieces)] for n in sizes
        ]

    def item(self, step: int, rank: int | None = None) -> tuple[int, int]:
        """``(owner, piece)`` that ``rank`` (this one by default) works on at ``step``."""
        rank = self.rank if rank is None else rank
        return (rank - step % self.parts) % self.parts, step // self.parts

    def tokens(self, item: tuple[int, int]) -> int:
        """Token count of a piece."""
        lo, hi = self.bounds[item[0]][item[1]]
        return hi - lo

    def own(self, pair: Pair, piece: int) -> Pair:
        """This rank's piece ``piece`` of ``pair`` (key, value), dense (gloo sends dense
        tensors; a view when the leading dims are 1)."""
        lo, hi = self.bounds[self.rank][piece]
        return tuple(t.narrow(-2, lo, hi - lo).contiguous() for t in pair)

    def own_slice(self, pair: Pair, piece: int) -> Pair:
        """Views of this rank's piece ``piece`` in ``pair`` (to write a gradient into)."""
        lo, hi = self.bounds[self.rank][piece]
        return tuple(t.narrow(-2, lo, hi - lo) for t in pair)

    def empty(self, item: tuple[int, int]) -> Pair:
        """Uninitialised ``(key-like, value-like)`` tensors of a piece."""
        n, lead = self.tokens(item), self.like.shape[:-2]
        return self.like.new_empty(*lead, n, self.e), self.like.new_empty(*lead, n, self.ev)

    def _post(self, sends: Pair | None, recv: Pair | None, tag: int) -> PendingExchange:
        # empty pieces are not sent: both sides know every piece's size
        sends = [(self.next, t) for t in sends] if sends and sends[0].shape[-2] else []
        recvs = [(self.prev, t) for t in recv] if recv and recv[0].shape[-2] else []
        return post_p2p(self.group, sends, recvs, current_runtime().stats, tag=tag)

    def pass_on(self, step: int, pair: Pair) -> tuple[PendingExchange, Pair | None]:
        """Post the send of the piece worked on at ``step`` to the next rank and the receive
        of the piece for ``step + 1`` from the previous one, unless the piece's round ends
        here (then the next step works on an own piece): ``(pending, next piece)``."""
        if (step + 1) % self.parts == 0:
            return self._post(None, None, KV), None
        nxt = self.empty(self.item(step + 1))
        return self._post(pair, nxt, KV), nxt

    def recv_grads(self, step: int) -> tuple[PendingExchange, Pair]:
        """Post the receive of the gradient accumulator the previous rank sent at
        ``step - 1``: the one of this step's piece or, at an own piece's step (``step % P
        == 0``, and after the last step), this rank's piece ``step // P - 1`` home."""
        buf = self.empty(self.item(step - 1, self.prev))
        return self._post(None, buf, GRAD), buf

    def send_grads(self, grads: Pair) -> PendingExchange:
        """Post the send of a gradient accumulator to the next rank."""
        return self._post(tuple(t.contiguous() for t in grads), None, GRAD)
