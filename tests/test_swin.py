"""Swin window attention over a sharded map (issue 23 item 3): a hand-written minimal Swin
model (window partition / reverse in channels-last and NCHW, shifted windows with their
mask, the relative position bias, patch merging, a single window covering the whole map)
equal to one device in fp64 at 2 and 3 ranks, with window counts that do not split along
the strips' own boundaries, and no activation gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import seeded


def partition(x, wh: int, ww: int, nchw: bool = False):
    """``(B, H, W, C)`` (or ``(B, C, H, W)``) -> ``(B * windows, wh * ww, C)``."""
    if nchw:
        b, c, h, w = x.shape
        x = x.view(b, c, h // wh, wh, w // ww, ww).permute(0, 2, 4, 3, 5, 1)
    else:
        b, h, w, c = x.shape
        x = x.view(b, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, c)


def reverse(win, wh: int, ww: int, h: int, w: int, nchw: bool = False):
    """The inverse of ``partition``."""
    c = win.shape[-1]
    x = win.view(-1, h // wh, w // ww, wh, ww, c)
    if nchw:
        return x.permute(0, 5, 1, 3, 2, 4).reshape(-1, c, h, w)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


def shift_mask(h: int, w: int, wh: int, ww: int, sh: int, sw: int) -> torch.Tensor:
    """Swin's ``(windows, N, N)`` mask of the shifted windows (-100 across regions)."""
    img = torch.zeros(1, h, w, 1)
    cnt = 0
    for hs in (slice(0, -wh), slice(-wh, -sh), slice(-sh, None)):
        for ws in (slice(0, -ww), slice(-ww, -sw), slice(-sw, None)):
            img[:, hs, ws, :] = cnt
            cnt += 1
    m = partition(img, wh, ww).squeeze(-1)
    return (m.unsqueeze(1) - m.unsqueeze(2)).ne(0).double() * -100.0


class WindowBlock(nn.Module):
    """Window attention with a relative position bias (a parameter table indexed by a
    fixed buffer), shifted windows (roll + mask) and an MLP, each with a residual.
    ``fused``: ``F.scaled_dot_product_attention`` with the bias / mask as ``attn_mask``;
    else the explicit ``q @ k.transpose(-2, -1)`` -> softmax -> ``@ v``."""

    def __init__(self, c, heads, res, win, shift=0, fused=False, nchw=False, bias=True):
        super().__init__()
        (h, w), (wh, ww) = res, win
        self.heads, self.win, self.shift, self.fused, self.nchw = heads, win, shift, fused, nchw
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.table = (
            nn.Parameter(seeded(5, (2 * wh - 1) * (2 * ww - 1), heads) * 0.5) if bias else None
        )
        yy, xx = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
        co = torch.stack([yy.flatten(), xx.flatten()])
        rel = (co[:, :, None] - co[:, None, :]).permute(1, 2, 0)
        self.register_buffer("index", (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1)
        mask = shift_mask(h, w, wh, ww, shift, shift) if shift else None
        self.register_buffer("mask", mask)

    def attention(self, win):
        bw, n, c = win.shape
        qkv = self.qkv(win).reshape(bw, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = 0.0
        if self.table is not None:
            bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        if self.fused:
            mask = bias
            if self.mask is not None:  # a plain (B * windows, 1, N, N) mask
                mask = mask + self.mask.repeat(bw // self.mask.shape[0], 1, 1).unsqueeze(1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        else:
            a = (q * 0.3) @ k.transpose(-2, -1) + bias
            if self.mask is not None:
                nw = self.mask.shape[0]
                a = a.view(-1, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
                a = a.view(-1, self.heads, n, n)
            o = a.softmax(-1) @ v
        return self.proj(o.transpose(1, 2).reshape(bw, n, c))

    def forward(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        (wh, ww), s = self.win, self.shift
        y = self.norm1(x)
        if s:
            y = torch.roll(y, shifts=(-s, -s), dims=(1, 2))
        if self.nchw:
            y = y.permute(0, 3, 1, 2)
        y = reverse(self.attention(partition(y, wh, ww, self.nchw)), wh, ww, h, w, self.nchw)
        if self.nchw:
            y = y.permute(0, 2, 3, 1)
        if s:
            y = torch.roll(y, shifts=(s, s), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2 x 2 neighbours concatenated (space-to-depth), LayerNorm, Linear."""

    def __init__(self, c):
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(4 * c), nn.Linear(4 * c, 2 * c, bias=False)

    def forward(self, x):
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class TinySwin(nn.Module):
    """conv stem -> channels-last -> W-MSA (SDPA, bias) -> SW-MSA (matmul, bias + mask) ->
    patch merging -> SW-MSA in NCHW windows (SDPA, mask) -> merging -> one window over
    the whole map -> NCHW -> conv head. Input ``(N, 3, 8, 20)``: 5 windows of 4 along W,
    split 3 + 2 over 2 ranks (strips 10 + 10) and 2 + 2 + 1 over 3 (strips 7 + 7 + 6)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.b1 = WindowBlock(c, 2, (8, 20), (4, 4), fused=True)
        self.b2 = WindowBlock(c, 2, (8, 20), (4, 4), shift=2)
        self.m1 = PatchMerging(c)
        self.b3 = WindowBlock(2 * c, 2, (4, 10), (2, 2), shift=1, fused=True, nchw=True, bias=False)
        self.m2 = PatchMerging(2 * c)
        self.b4 = WindowBlock(4 * c, 2, (2, 5), (2, 5))
        self.head = nn.Conv2d(4 * c, 2, 1)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)
        x = self.m1(self.b2(self.b1(x)))
        x = self.b4(self.m2(self.b3(x)))
        return self.head(x.permute(0, 3, 1, 2))


def swin_failures(dp: int = 1) -> list[str]:
    """One device against ``parallelize``: output, every parameter gradient, no-gather
    audit. ``dp`` > 1: a ``(dp, sp)`` mesh, the batch split too (4 images)."""
    world = dist.get_world_size()
    dmesh = mesh((dp, world // dp), ("dp", "sp")) if dp > 1 else mesh(world)
    placements = [Shard(0), Shard(3)] if dp > 1 else [Shard(3)]
    torch.manual_seed(0)
    model = TinySwin().double()
    x = seeded(1, 2 * dp, 3, 8, 20, dtype=torch.float64)
    gy = seeded(2, 2 * dp, 2, 2, 5, dtype=torch.float64)
    # the relative position bias (heads x N x N, whatever the image size) is summed too
    return check_model_audited(
        model,
        x,
        gy,
        dmesh,
        placements,
        param_shapes={(1, 2, 16, 16), (1, 2, 10, 10)},
        traffic="re-chunk" if dp == 1 else None,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_tiny_swin_matches_single_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, swin_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def test_tiny_swin_batch_over_dp_matches_single_device(dist_pool):
    # a (2, 1) mesh: two layouts on the batch of windows (dp's images, sp's windows)
    for rank, failures in enumerate(dist_pool.run(2, swin_failures, 2)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
