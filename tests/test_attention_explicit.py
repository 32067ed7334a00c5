"""Attention written out over sharded pixel tokens (issue 23): the two ring matmuls alone on
keys in any order; ``q @ k.transpose(-2, -1)``
-> softmax -> ``@ v`` through ``@``, ``torch.einsum`` and ``torch.bmm``, with keys from the
same tokens (the ring), from a strided conv of the map (spatial-reduction attention: their
own token layout) and from a global pooling (whole on every rank), equal to one device in
fp64 at 2 and 3 ranks on uneven strips, with ring traffic and no activation gather; MONAI's
UNETR in 2-D (einsum attention in its ViT) likewise; other products of token tensors
refused naming the op and the module (DTensor's own rules and the no-gather guard)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from spconv_train.parallel._attention_explicit import APPLY, SCORES, ring_matmul
from spconv_train.parallel._geometry import all_shard_bounds
from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import rel_err, seeded
from tests.test_attention import SelfAttention, refusal_messages

TOL = 1e-12


def ring_matmul_errors() -> dict[str, float]:
    """Both ring matmuls, each rank with 2 rows of ``a`` and a random subset of 13 keys
    (any order), against the plain products: output and both gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bounds = all_shard_bounds(13, world)
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(5))
    cols = tuple(perm[slice(*b)] for b in bounds)
    sizes = tuple(b - a for a, b in bounds)
    rows = slice(2 * rank, 2 * rank + 2)
    errs = {}
    for kind, a, t in (
        (SCORES, seeded(1, 2, 3, 2 * world, 5), seeded(2, 2, 3, 13, 5)),  # queries, keys
        (APPLY, seeded(3, 2, 3, 2 * world, 13), seeded(4, 2, 3, 13, 6)),  # weights, values
    ):
        a, t = a.double().requires_grad_(), t.double().requires_grad_()
        ref = a @ t.transpose(-2, -1) if kind == SCORES else a @ t
        g = seeded(6, *ref.shape, dtype=torch.float64)
        want = torch.autograd.grad(ref, (a, t), g)
        mine = [a.detach()[..., rows, :], t.detach()[..., cols[rank], :]]
        mine = [m.clone().requires_grad_() for m in mine]
        out = ring_matmul(kind, *mine, dist.group.WORLD, sizes, cols, 13)
        got = torch.autograd.grad(out, mine, g[..., rows, :])
        errs[f"{kind} out"] = rel_err(out, ref[..., rows, :])
        errs[f"{kind} da"] = rel_err(got[0], want[0][..., rows, :])
        errs[f"{kind} dt"] = rel_err(got[1], want[1][..., cols[rank], :])
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matmuls_match_plain_products(dist_pool, world):
    for errs in dist_pool.run(world, ring_matmul_errors):
        assert max(errs.values()) < TOL, errs


class ExplicitAttention(SelfAttention):
    """MiT-style attention written out: ``form`` "matmul" (``q @ k.transpose(-2, -1)``,
    ``attn @ v``) or "einsum" (MONAI's ``"bhxd,bhyd->bhxy"``, ``"bhxy,bhyd->bhxd"``);
    ``reduction`` > 1: keys / values from a strided conv of the map."""

    def __init__(self, c: int, heads: int, form: str, reduction: int = 1):
        super().__init__(c, heads, reduction)
        self.form = form

    def attend(self, q, k, v):
        if self.form == "einsum":
            attn = torch.einsum("bhxd,bhyd->bhxy", q, k) * 0.4
            return torch.einsum("bhxy,bhyd->bhxd", attn.softmax(dim=-1), v)
        return ((q @ k.transpose(-2, -1)) * 0.4).softmax(dim=-1) @ v


class ExplicitBlock(nn.Module):
    """conv stem -> tokens -> three explicit attentions (self, spatial-reduction, to a
    pooled token by ``torch.bmm``), each with a residual -> NCHW -> conv head."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.attn = ExplicitAttention(c, 2, "matmul")
        self.sra = ExplicitAttention(c, 2, "einsum", reduction=2)
        self.head = nn.Conv2d(c, 2, 3, padding=1)

    def forward(self, x):
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        t = t + self.attn(self.norm1(t), h, w)
        t = t + self.sra(self.norm2(t), h, w)
        g = F.adaptive_avg_pool2d(f, 1).flatten(2).transpose(1, 2)  # (N, 1, C), whole
        t = t + torch.bmm(torch.bmm(t, g.transpose(1, 2)).softmax(-1), g)
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def block_failures(h: int, w: int, kind: str = "block") -> list[str]:
    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = ExplicitBlock().double() if kind == "block" else unetr(h, w, kind).double()
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    gy = seeded(2, 2, 2, h, w, dtype=torch.float64)
    # mathematically zero gradients (a bias before a norm) are rounding noise: compare
    # relative to the largest gradient of the model
    gather = 2 * 8 * h * w // dist.get_world_size() // 4
    return check_model_audited(
        model, x, gy, dmesh, [Shard(3)], gather_numel=gather, grad_floor=1e-4, buffers=True
    )


@pytest.mark.parametrize("world", [2, 3])
def test_explicit_attention_matches_single_device(dist_pool, world):
    # W = 7 splits 4 + 3 (2 ranks) and 3 + 3 + 1 (3 ranks); the strided-conv keys
    # (W = 3) 2 + 1 and 1 + 1 + 1: uneven token counts for queries and keys
    for rank, failures in enumerate(dist_pool.run(world, block_failures, 4, 7)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def unetr(h: int, w: int, norm: str) -> nn.Module:
    """MONAI's UNETR in 2-D, tiny: a ViT on 16 x 16 patches (``SABlock``: einsum attention,
    position embeddings), transposed-conv decoder."""
    from monai.networks.nets import UNETR

    return UNETR(
        in_channels=3,
        out_channels=2,
        img_size=(h, w),
        feature_size=4,
        hidden_size=32,
        mlp_dim=64,
        num_heads=2,
        spatial_dims=2,
        norm_name=norm,
    )


@pytest.mark.parametrize("world, norm", [(2, "batch"), (3, "instance")])
def test_monai_unetr_2d_matches_single_device(dist_pool, world, norm):
    pytest.importorskip("einops")  # MONAI's SABlock needs it
    pytest.importorskip("monai")
    # one row of 112 / 16 = 7 patches: strips 4 + 3 and 3 + 3 + 1; the tokens of a one-row
    # map are a plain Shard (no _StridedShard), which the einsums must take as well
    for rank, failures in enumerate(dist_pool.run(world, block_failures, 16, 112, norm)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


class Refused(nn.Module):
    """A product of token tensors that is not one of the attention forms (``kind``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2)  # (N, L, C)
        if self.kind == "plain_weight":
            return torch.matmul(t, self.w)
        return torch.einsum("blc,bmc,bld->bmd", t, t, t)


def test_other_token_products_refused_with_module_path(dist_pool):
    # DTensor's own rules: an error it raises, named (torch.matmul), or the no-gather
    # guard's refusal of the all-gather it would need (aten.bmm)
    expect = {"plain_weight": "torch.matmul", "einsum3": "aten.bmm"}
    for msgs in dist_pool.run(2, refusal_messages, Refused, tuple(expect)):
        for kind, op in expect.items():
            msg = msgs[kind]
            assert "module 'blk'" in msg and op in msg, (kind, msg)
