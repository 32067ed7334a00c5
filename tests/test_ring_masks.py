"""Attention masks and biases on the ring (``_ring_mask.py``): fp64 against one device,
output and every gradient, no activation gather, at 2 and 3 ranks on uneven W strips and
on 2 x 2 tiles (the ring over the tile group).

* the ring op alone, key / value blocks in 1 and 3 pieces, the flash kernel and the matmul
  path: a boolean mask with a row masked everywhere and rows masked within pieces, a float
  bias that requires grad, causal;
* a model: ``F.scaled_dot_product_attention`` with a boolean mask, a learned bias over all
  token pairs (a parameter), a bias computed from the tokens (a DTensor split like the
  queries) and ``is_causal``, to the keys of a strided conv (their own layout: SDPA's
  top-left causal alignment) with a boolean mask and ``is_causal``, to a pooled token
  (whole keys, no ring) with a learned bias; ``nn.MultiheadAttention`` with a boolean
  ``attn_mask`` and a ``key_padding_mask`` computed from the map (split like the keys: it
  travels with them), and with a learned ``(N * heads, L, L)`` float mask and a whole
  ``key_padding_mask``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from spconv_train.parallel._ring import ring_attention
from spconv_train.parallel._ring_mask import RingMask
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited
from tests.reference import rel_err, seeded

TOL = 1e-12
SIZES = {2: (4, 7), 3: (5, 2, 6)}  # tokens per rank for the op: uneven, one under m = 3


def _keep(n: int, seed: int) -> torch.Tensor:
    """A random boolean mask (True: attended) with row 1 masked everywhere and row 3
    attending to its last key only (masked in every other piece)."""
    keep = torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[1] = False
    keep[3] = False
    keep[3, -1] = True
    return keep


def op_errors() -> dict[str, float]:
    """``ring_attention`` with a mask on a random subset of tokens per rank against
    ``F.scaled_dot_product_attention`` on one device."""
    rank = dist.get_rank()
    sizes = SIZES[dist.get_world_size()]
    total, start = sum(sizes), sum(sizes[: dist.get_rank()])
    order = torch.randperm(total, generator=torch.Generator().manual_seed(3))
    idx = order[start : start + sizes[rank]]
    cols = tuple(order[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(len(sizes)))
    keep = _keep(total, 5)
    errs = {}
    for ev in (5, 3):  # the CPU flash kernel (same head size) and the matmul path
        q, k = seeded(1, 2, 3, total, 5, dtype=torch.float64), seeded(2, 2, 3, total, 5).double()
        v = seeded(3, 2, 3, total, ev, dtype=torch.float64)
        bias = seeded(6, 3, total, total, dtype=torch.float64)
        for kind in ("bool", "bias", "causal"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            mask = {"bool": keep, "bias": leaves[3], "causal": None}[kind]
            ref = F.scaled_dot_product_attention(
                *leaves[:3], attn_mask=mask, is_causal=kind == "causal", scale=0.41
            )
            g = seeded(4, *ref.shape, dtype=torch.float64)
            want = torch.autograd.grad(ref, leaves[:3] + leaves[3:] * (kind == "bias"), g)
            for m in (1, 3):
                mine = [t.detach()[..., idx, :].clone().requires_grad_() for t in leaves[:3]]
                rows = keep if kind == "bool" else None  # boolean rows as SDPA takes them
                if kind == "bias":
                    rows = leaves[3].detach().clone().requires_grad_()
                part = None if rows is None else rows[..., idx, :]
                spec = RingMask(cols, idx if kind == "causal" else None, q.dtype)
                out = ring_attention(
                    *mine, dist.group.WORLD, sizes, 0.41, pieces=m, bias=part, mask=spec
                )
                wrt = mine + [rows] * (kind == "bias")
                got = torch.autograd.grad(out, wrt, g[..., idx, :])
                label = f"{kind} ev={ev} m={m}"
                errs[f"out {label}"] = rel_err(out, ref[..., idx, :])
                for name, a, b in zip("qkv", got, want, strict=False):
                    errs[f"d{name} {label}"] = rel_err(a, b[..., idx, :])
                if kind == "bias":  # this rank's rows of the bias gradient
                    errs[f"dbias {label}"] = rel_err(got[3][..., idx, :], want[3][..., idx, :])
    return errs


class MaskedAttention(nn.Module):
    """conv stem -> tokens -> SDPA with a boolean mask, a learned bias, a bias from the
    tokens (split like the queries) and causal; to strided-conv keys with a boolean mask
    and causal; to a pooled token with a learned (L, 1) bias -> nn.MultiheadAttention with a boolean
    attn_mask and a key_padding_mask computed from the map (a DTensor split like the
    keys), and with a learned float (N * heads, L, L) mask and a whole float
    key_padding_mask ->
    conv head, each with a residual."""

    def __init__(self, n: int, h: int, w: int, c: int = 4, heads: int = 2):
        super().__init__()
        length, self.heads = h * w, heads
        self.stem, self.head = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 2, 1)
        self.qkv, self.sr = nn.Linear(c, 3 * c), nn.Conv2d(c, c, 2, 2)
        self.bias = nn.Parameter(seeded(8, heads, length, length) * 0.5)
        self.mha_bias = nn.Parameter(seeded(9, n * heads, length, length) * 0.5)
        self.mha = nn.MultiheadAttention(c, heads, batch_first=True)
        self.keep = _keep(length, 11)
        reduced = (h // 2) * (w // 2)  # the strided conv's keys: a token layout of their own
        self.keep_sr = torch.rand(length, reduced, generator=torch.Generator().manual_seed(13))
        self.keep_sr = self.keep_sr > 0.3
        self.pool_bias = nn.Parameter(seeded(10, length, 1) * 0.5)
        pad = torch.rand(n, length, generator=torch.Generator().manual_seed(12)) < 0.3
        self.pad = torch.zeros(n, length).masked_fill(pad, float("-inf")).double()

    def forward(self, x):
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        qkv = self.qkv(t).reshape(b, h * w, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)
        o = o + F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        scores = (q @ k.transpose(-2, -1)) * 0.3  # split like the queries
        o = o + F.scaled_dot_product_attention(q, k, v, attn_mask=scores)
        o = o + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        heads = (b, -1, self.heads, c // self.heads)
        kv = self.sr(f).flatten(2).transpose(1, 2).reshape(heads).transpose(1, 2)
        o = o + F.scaled_dot_product_attention(q, kv, kv, attn_mask=self.keep_sr)
        o = o + F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        g = F.adaptive_avg_pool2d(f, 1).flatten(2).transpose(1, 2)  # whole keys: no ring
        g = g.reshape(heads).transpose(1, 2)
        o = o + F.scaled_dot_product_attention(q, g, g, attn_mask=self.pool_bias)
        t = t + o.transpose(1, 2).reshape(b, h * w, c)
        kw = {"need_weights": False}  # (with weights torch gives NaN rows masked everywhere)
        pad = (x[:, 0] > 0.8).flatten(1)  # (N, L) from the map: split like the keys
        t = t + self.mha(t, t, t, attn_mask=~self.keep, key_padding_mask=pad, **kw)[0]
        t = t + self.mha(t, t, t, attn_mask=self.mha_bias, key_padding_mask=self.pad, **kw)[0]
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def model_failures(dmesh, placements, h: int, w: int, label: str) -> list[str]:
    torch.manual_seed(0)
    model = MaskedAttention(2, h, w).double()
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    gy = seeded(2, 2, 2, h, w, dtype=torch.float64)
    return check_model_audited(model, x, gy, dmesh, placements, label=label)


def mask_checks() -> tuple[dict[str, float], list[str]]:
    """One worker call per world size: the op, and the model on W strips (2, 3 ranks:
    W = 7 splits 4 + 3 and 3 + 3 + 1) or on 2 x 2 tiles (4 ranks, 5 x 7: rows 3 + 2,
    columns 4 + 3) and on a (dp, sp) = 2 x 2 mesh."""
    world = dist.get_world_size()
    if world == 4:  # and the batch split over dp beside W strips (the training mesh)
        dmesh, placements = mesh_and_placements((2, 2), ("sp_h", "sp_w"))
        dp = model_failures(mesh((2, 2), ("dp", "sp")), [Shard(0), Shard(3)], 4, 7, "dp x sp ")
        return {}, model_failures(dmesh, placements, 5, 7, "tiles ") + dp
    return op_errors(), model_failures(mesh(world), [Shard(3)], 4, 7, "strips ")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_masks_match_one_device(dist_pool, world):
    for rank, (errs, failures) in enumerate(dist_pool.run(world, mask_checks)):
        bad = {k: e for k, e in errs.items() if not e < TOL}
        assert not bad and not failures, f"rank {rank}: {bad} " + "; ".join(failures[:8])
