"""Whole (learned) queries attending to the pixel tokens of a sharded map (issue 23,
``spconv_train/parallel/_attention.py``): a Mask2Former-style decoder layer
(``nn.MultiheadAttention`` cross attention masked by a mask head, self-attention among the
queries, an MLP, the mask einsum back on the map) and ``F.scaled_dot_product_attention``
with replicated and plain queries, masks split like the keys and whole, queries that see
no key of a rank or none at all. fp64 against one device (output, every parameter
gradient), uneven strips at 2 and 3 ranks and 2 x 2 tiles, no activation gather: the only
reductions are query-sized."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import seeded

HEADS, QUERIES = 2, 4
#: the largest query-sized reduction: (N, heads, Q, head dim + 1) and (Q, N, C)
QUERY_SIZED = 2 * HEADS * (QUERIES + 1) * 5


class DecoderLayer(nn.Module):
    """Mask2Former's masked-attention decoder layer, written as users write it."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.query = nn.Embedding(QUERIES, c)
        self.query_pos = nn.Parameter(seeded(3, QUERIES, c, dtype=torch.float64))
        self.mask_head = nn.Conv2d(c, QUERIES, 1)
        self.cross = nn.MultiheadAttention(c, HEADS, batch_first=True)
        self.self_attn = nn.MultiheadAttention(c, HEADS, batch_first=True)
        self.norms = nn.ModuleList(nn.LayerNorm(c) for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.ReLU(), nn.Linear(2 * c, c))
        self.embed = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b = f.shape[0]
        tokens = f.flatten(2).transpose(1, 2)  # (B, L, C)
        # True: not attended (the predicted mask's background), per head
        mask = self.mask_head(f).sigmoid().flatten(2) < 0.5
        mask = mask.unsqueeze(1).repeat(1, HEADS, 1, 1).flatten(0, 1).detach()
        q = self.query.weight.unsqueeze(0).repeat(b, 1, 1)  # plain (B, Q, C)
        pad = torch.zeros(b, tokens.shape[1], dtype=torch.bool)  # plain, whole: padding
        pad[:, -3:] = True
        attended = self.cross(
            q + self.query_pos, tokens, tokens, attn_mask=mask, key_padding_mask=pad
        )[0]
        q = self.norms[0](q + attended)
        q = self.norms[1](q + self.self_attn(q, q, q)[0])
        q = self.norms[2](q + self.mlp(q))
        return torch.einsum("bqc,bchw->bqhw", self.embed(q), f)


class SdpaQueries(nn.Module):
    """``F.scaled_dot_product_attention`` of whole queries to pixel keys: replicated
    queries (pooled features plus a parameter) with a bool mask split like the keys, and
    plain queries with a whole float mask that is a parameter. Query 0 sees no key at all,
    query 1 only the last two columns (no key of the ranks holding the others)."""

    def __init__(self, h: int, w: int, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.kv = nn.Linear(c, 2 * c)
        d = c // HEADS
        self.query = nn.Parameter(seeded(4, 1, HEADS, QUERIES, d, dtype=torch.float64))
        self.bias = nn.Parameter(seeded(5, HEADS, QUERIES, h * w, dtype=torch.float64))
        self.mask_head = nn.Conv2d(c, QUERIES, 1)
        shift = torch.zeros(1, QUERIES, 1, w, dtype=torch.float64)
        shift[0, 0], shift[0, 1, :, : w - 2] = -1e9, -1e9
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        kv = self.kv(t).reshape(b, h * w, 2, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)  # (B, heads, L, d)
        g = F.adaptive_avg_pool2d(f, 1).view(b, HEADS, 1, c // HEADS)
        keep = ((self.mask_head(f) + self.shift).flatten(2) > -1e3).unsqueeze(1)
        o = F.scaled_dot_product_attention(self.query + g, k, v, attn_mask=keep)
        plain = self.query.expand(b, -1, -1, -1)
        o = o + F.scaled_dot_product_attention(plain, k, v, attn_mask=self.bias, scale=0.3)
        return torch.einsum("bqc,bchw->bqhw", o.transpose(1, 2).reshape(b, QUERIES, c), f)


class MaskedOut(nn.Module):
    """``nn.MultiheadAttention`` where query 0 of sample 0 sees no key at all (``kind``:
    ``"weights"`` / ``"no_weights"``: ``need_weights``), or SDPA with ``is_causal``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.mha = kind, nn.MultiheadAttention(4, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.flatten(2).transpose(1, 2)  # (B, L, 4)
        q = t.new_ones(x.shape[0], QUERIES, 4)
        if self.kind == "causal":
            return F.scaled_dot_product_attention(q, t, t, is_causal=True)
        mask = torch.zeros(x.shape[0] * HEADS, QUERIES, t.shape[1], dtype=torch.bool)
        mask[:HEADS, 0] = True
        return self.mha(q, t, t, attn_mask=mask, need_weights=self.kind == "weights")[0]


def _edge_failures(dmesh, placements) -> list[str]:
    """A query that sees no key gives torch's own (NaN with ``need_weights``, else zeros);
    ``is_causal`` is refused naming the op and the module."""
    out = []
    x = seeded(6, 2, 4, 3, 7, dtype=torch.float64)
    for kind in ("weights", "no_weights"):
        torch.manual_seed(0)
        model = MaskedOut(kind).double()
        want = model(x)
        got = parallelize(copy.deepcopy(model), dmesh)(distribute_tensor(x, dmesh, placements))
        if not torch.allclose(got.full_tensor(), want, rtol=1e-12, atol=0, equal_nan=True):
            out.append(f"{kind}: {got.full_tensor()[0, 0]} != {want[0, 0]}")
    model = nn.Sequential()
    model.add_module("blk", MaskedOut("causal"))
    try:
        parallelize(model, dmesh)(distribute_tensor(x, dmesh, placements))
        out.append("is_causal not refused")
    except SpatialShardingError as exc:
        if "module 'blk" not in str(exc) or "is_causal" not in str(exc):
            out.append(f"is_causal refusal: {exc}")
    return out


def _failures(tiles: bool, dp: bool = False) -> list[str]:
    world = dist.get_world_size()
    if tiles:
        dmesh, placements, (h, w) = mesh((2, 2), ("sp_h", "sp_w")), [Shard(2), Shard(3)], (5, 7)
    elif dp:  # the batch split over dp beside W strips (the training mesh)
        dmesh, placements, (h, w) = mesh((2, 2), ("dp", "sp")), [Shard(0), Shard(3)], (4, 7)
    else:
        dmesh, placements, (h, w) = mesh(world), [Shard(3)], (4, 7)
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    gy = seeded(2, 2, QUERIES, h, w, dtype=torch.float64)
    out = []
    for name, build in (("decoder", DecoderLayer), ("sdpa", lambda: SdpaQueries(h, w))):
        torch.manual_seed(0)  # the same weights on every rank
        model = build().double()
        out += check_model_audited(
            model,
            x,
            gy,
            dmesh,
            placements,
            gather_numel=QUERY_SIZED + 1,
            grad_floor=1e-14,  # the mask head gets no gradient: its mask is detached
            label=f"{name}: ",
        )
    if tiles:
        out += [f"dp x sp: {f}" for f in _failures(False, dp=True)]
    return out + (_edge_failures(dmesh, placements) if world == 2 else [])


@pytest.mark.parametrize("world,tiles", [(2, False), (3, False), (4, True)])
def test_learned_queries_attend_to_sharded_keys(dist_pool, world, tiles):
    # W = 7: 4 + 3 columns at 2 ranks, 3 + 3 + 1 at 3; 5 x 7 on 2 x 2 tiles, and on the
    # (dp, sp) = 2 x 2 mesh
    for rank, failures in enumerate(dist_pool.run(world, _failures, tiles)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
