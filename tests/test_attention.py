"""Exact attention over sharded pixel tokens (issue 23): the ring attention op alone, a
user-written transformer block (``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``,
spatial-reduction attention, attention to pooled keys) equal to one device in fp64 at 2 and
3 ranks with token counts that do not split evenly and no activation gather, and clear
refusals of what is not supported."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from spconv_train.parallel._geometry import all_shard_bounds
from spconv_train.parallel._ring import ring_attention
from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import rel_err, seeded

TOL = 1e-12


def sdpa_reference(n: int, ev: int, scale: float) -> tuple:
    """Seeded fp64 q, k (head size 5) and v (head size ``ev``) of ``n`` tokens requiring
    grad, ``F.scaled_dot_product_attention``'s output on one device, a seeded output
    gradient and the q / k / v gradients: ``((q, k, v), out, grad, (dq, dk, dv))``."""
    q, k = seeded(1, 2, 3, n, 5, dtype=torch.float64), seeded(2, 2, 3, n, 5).double()
    v = seeded(3, 2, 3, n, ev, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_()
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
    g = seeded(4, *ref.shape, dtype=torch.float64)
    return (q, k, v), ref, g, torch.autograd.grad(ref, (q, k, v), g)


def ring_errors(errs: dict, tag: str, reference: tuple, idx, sizes, **ring) -> None:
    """The ring op on this rank's tokens ``idx`` of ``reference`` (``sdpa_reference``),
    ``sizes`` tokens per rank, ``ring`` its keywords: the relative errors of its output and
    q / k / v gradients into ``errs``, keyed by ``tag``."""
    qkv, ref, g, grads = reference
    mine = [t.detach()[..., idx, :].clone().requires_grad_() for t in qkv]
    out = ring_attention(*mine, dist.group.WORLD, sizes, **ring)
    got = torch.autograd.grad(out, mine, g[..., idx, :])
    errs[f"out {tag}"] = rel_err(out, ref[..., idx, :])
    for name, a, b in zip("qkv", got, grads, strict=True):
        errs[f"d{name} {tag}"] = rel_err(a, b[..., idx, :])


def ring_op_errors() -> dict[str, float]:
    """The ring op on a random subset of tokens per rank (any order) against
    ``F.scaled_dot_product_attention`` on one device: output and q / k / v gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    errs = {}
    for ev in (5, 3):  # the CPU flash kernel (same head size) and the matmul path
        bounds = all_shard_bounds(13, world)
        idx = torch.randperm(13, generator=torch.Generator().manual_seed(5))[slice(*bounds[rank])]
        sizes = tuple(b - a for a, b in bounds)
        ring_errors(errs, f"ev={ev}", sdpa_reference(13, ev, 0.37), idx, sizes, scale=0.37)
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_op_matches_sdpa(dist_pool, world):
    for errs in dist_pool.run(world, ring_op_errors):
        assert max(errs.values()) < TOL, errs


class SelfAttention(nn.Module):
    """timm-style attention: one qkv projection, ``F.scaled_dot_product_attention``. With
    ``reduction`` > 1, SegFormer's spatial-reduction attention: keys and values from a
    strided conv of the map (another token layout than the queries')."""

    def __init__(self, c: int, heads: int, reduction: int = 1):
        super().__init__()
        self.heads, self.r = heads, reduction
        self.q, self.kv, self.proj = nn.Linear(c, c), nn.Linear(c, 2 * c), nn.Linear(c, c)
        if reduction > 1:
            self.sr, self.norm = nn.Conv2d(c, c, reduction, reduction), nn.LayerNorm(c)

    def forward(self, x, h, w):
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3)
        if self.r > 1:
            m = self.sr(x.permute(0, 2, 1).reshape(b, c, h, w))
            x = self.norm(m.reshape(b, c, -1).permute(0, 2, 1))
        kv = self.kv(x).reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attend(q, *kv.unbind(0))
        return self.proj(o.transpose(1, 2).reshape(b, n, c))

    def attend(self, q, k, v):
        """The attention product of (batch, heads, tokens, dim) queries, keys, values."""
        return F.scaled_dot_product_attention(q, k, v, scale=0.4)


class TokenBlock(nn.Module):
    """conv stem -> tokens (+ absolute position embedding) -> LayerNorm ->
    nn.MultiheadAttention -> SDPA block -> spatial-reduction attention -> attention to a
    globally pooled token -> MLP, each with a residual -> NCHW -> conv head."""

    def __init__(self, h: int, w: int, c: int = 8, heads: int = 2, mask: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.pos = nn.Parameter(seeded(7, 1, h * w, c) * 0.1)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(c), nn.LayerNorm(c), nn.LayerNorm(c)
        self.mha = nn.MultiheadAttention(c, heads, batch_first=True)
        self.attn = SelfAttention(c, heads)
        self.sra = SelfAttention(c, heads, reduction=2)
        self.pooled = nn.MultiheadAttention(c, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(c, 2 * c), nn.GELU(), nn.Dropout(0.0), nn.Linear(2 * c, c)
        )
        self.head = nn.Conv2d(c, 2, 3, padding=1)
        self.mask = mask

    def forward(self, x):
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2) + self.pos
        n = self.norm1(t)
        mask = torch.zeros(h * w, h * w, dtype=torch.bool) if self.mask else None
        t = t + self.mha(n, n, n, attn_mask=mask)[0]
        t = t + self.attn(self.norm2(t), h, w)
        t = t + self.sra(self.norm3(t), h, w)
        g = F.adaptive_avg_pool2d(f, 1).flatten(2).transpose(1, 2)  # (N, 1, C), whole
        t = t + self.pooled(t, g, g, need_weights=False)[0]
        t = t + self.mlp(t)
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def block_failures(h: int, w: int) -> list[str]:
    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = TokenBlock(h, w).double()
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    gy = seeded(2, 2, 2, h, w, dtype=torch.float64)
    return check_model_audited(model, x, gy, dmesh, [Shard(3)])


@pytest.mark.parametrize("world", [2, 3])
def test_token_transformer_block_matches_single_device(dist_pool, world):
    # W = 7 splits 4 + 3 (2 ranks) and 3 + 3 + 1 (3 ranks): uneven token counts
    for rank, failures in enumerate(dist_pool.run(world, block_failures, 4, 7)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


class Refused(nn.Module):
    """Token models with one unsupported piece each (``kind``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.mha = nn.MultiheadAttention(4, 2, batch_first=True, add_zero_attn=True)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2)
        b, n, c = t.shape
        if self.kind == "sdpa_mask":  # torch refuses a mask with is_causal too
            q = t.reshape(b, n, 2, 2).transpose(1, 2)
            mask = torch.ones(n, n) > 0
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
        if self.kind == "zero_attn":
            return self.mha(t, t, t, key_padding_mask=torch.zeros(b, n, dtype=torch.bool))
        if self.kind == "mix_tokens":
            return self.proj(t).reshape(b, -1)
        return torch.einsum("blc,cd->bld", t, self.proj.weight)


REFUSED = ("sdpa_mask", "zero_attn", "mix_tokens", "einsum")


def refusal_messages(make=None, kinds=REFUSED) -> dict[str, str]:
    """The ``SpatialShardingError`` message (or "not refused") of each of ``kinds`` run as
    the module ``blk`` (``make(kind)``, default ``Refused``) of a parallelized model."""
    dmesh = mesh(dist.get_world_size())
    x = distribute_tensor(seeded(1, 2, 4, 3, 5), dmesh, [Shard(3)])
    out = {}
    for kind in kinds:
        model = nn.Sequential()
        model.add_module("blk", (make or Refused)(kind))
        try:
            parallelize(model, dmesh)(x)
            out[kind] = "not refused"
        except SpatialShardingError as exc:
            out[kind] = str(exc)
    return out


def test_unsupported_attention_refused_with_module_path(dist_pool):
    for msgs in dist_pool.run(2, refusal_messages):
        expect = {
            "sdpa_mask": ("F.scaled_dot_product_attention", "attention mask with is_causal"),
            "zero_attn": ("nn.MultiheadAttention", "add_zero_attn"),
            "mix_tokens": ("reshape", "mix the tokens"),
            "einsum": ("einsum", "not supported"),
        }
        for kind, words in expect.items():
            msg = msgs[kind]
            assert "module 'blk" in msg and all(w in msg for w in words), (kind, msg)
