"""Review of the second cut of the attention modules (issue 22): the cases its changes touch
that no other test reaches. fp64 against one device, every gradient.

* the ring op with a travelling key mask (``kbias``: a ``key_padding_mask`` split like the
  keys), with and without grad, alone, next to a float bias that requires grad (over all
  keys, or ``(..., L, 1)``: one value per row), and next to a boolean mask with
  ``is_causal`` (three terms in one block), in 1 and 3 pieces, the flash kernel and the
  matmul path, with a rank that holds no token;
* models: ``nn.MultiheadAttention`` on the ring with a learned float ``attn_mask`` and a
  float ``key_padding_mask`` computed from the map (it travels, its gradient comes home),
  and with a causal boolean ``attn_mask`` and the ``is_causal`` hint; whole queries (the
  cross route) with that float ``key_padding_mask`` split like the keys and a learned
  per-head float ``attn_mask``; SDPA of whole queries with a float mask computed from the
  map (split like the keys, broadcast over heads): on uneven strips, 2 x 2 tiles and the
  (dp, sp) mesh;
* MHA sequence-first and with ``kdim`` / ``vdim`` on both routes; the ``is_causal`` hint
  next to a non-causal ``attn_mask`` taken as torch takes it;
* einsum attention with spaces in the equations and tokens before heads (operands and
  result permuted around the ring matmuls), at 2 and 3 ranks;
* every refusal of both check tables (SDPA, MHA) on both routes (ring, whole queries),
  naming the op, the module, the reason and the route.
"""

from __future__ import annotations

import math

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
SIZES = {2: (4, 7), 3: (5, 0, 6)}  # tokens per rank: uneven; at 3 ranks rank 1 holds none


def _travelling_errors() -> dict[str, float]:
    """``ring_attention`` with a travelling key mask ``kbias`` ``(N, 1, L_r, 1)`` against
    SDPA with the whole additive mask on one device: output, q / k / v and every mask
    gradient (this rank's rows / keys)."""
    rank, sizes = dist.get_rank(), SIZES[dist.get_world_size()]
    n = sum(sizes)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    cols = tuple(order[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(len(sizes)))
    idx = cols[rank]
    keep = torch.rand(n, n, generator=torch.Generator().manual_seed(5)) > 0.4
    keep[1], keep[3] = False, False  # row 1 masked everywhere, row 3 sees one key
    keep[3, -1] = True
    causal = torch.zeros(n, n, dtype=torch.float64).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf
    )
    errs = {}
    for ev in (5, 3):  # the CPU flash kernel (same head size) and the matmul path
        q, k = seeded(1, 2, 3, n, 5, dtype=torch.float64), seeded(2, 2, 3, n, 5).double()
        v = seeded(3, 2, 3, n, ev, dtype=torch.float64)
        kb = seeded(7, 2, 1, n, 1, dtype=torch.float64)
        biases = {"bias": seeded(6, 3, n, n), "bias1": seeded(8, 3, n, 1)}  # (.., 1): per row
        for kind in ("alone", "alone_nograd", "bias", "bias1", "bool_causal"):
            bias, with_bias = biases.get(kind, biases["bias"]).double(), kind in biases
            kb_grad = kind != "alone_nograd"
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            kbl = kb.clone().requires_grad_(kb_grad)
            bl = bias.clone().requires_grad_()
            whole = kbl.transpose(-2, -1)
            if with_bias:
                whole = whole + bl
            if kind == "bool_causal":
                whole = whole + torch.zeros(n, n, dtype=torch.float64).masked_fill(~keep, -math.inf)
                whole = whole + causal
            ref = F.scaled_dot_product_attention(*leaves, attn_mask=whole, scale=0.41)
            g = seeded(4, *ref.shape, dtype=torch.float64)
            wrt = leaves + [kbl] * kb_grad + [bl] * with_bias
            want = torch.autograd.grad(ref, wrt, g)
            for m in (1, 3):
                mine = [t.detach()[..., idx, :].clone().requires_grad_() for t in leaves]
                kbm = kb.detach()[..., idx, :].clone().requires_grad_(kb_grad)
                brows = bias.detach().clone().requires_grad_()
                rows = brows if with_bias else (keep if kind == "bool_causal" else None)
                part = None if rows is None else rows[..., idx, :]
                spec = RingMask(cols, idx if kind == "bool_causal" else None, q.dtype)
                out = ring_attention(
                    *mine, dist.group.WORLD, sizes, 0.41, pieces=m, bias=part, mask=spec, kbias=kbm
                )
                mwrt = mine + [kbm] * kb_grad + [brows] * with_bias
                got = torch.autograd.grad(out, mwrt, g[..., idx, :])
                label = f"{kind} ev={ev} m={m}"
                errs[f"out {label}"] = rel_err(out, ref[..., idx, :])
                for name, a, b in zip("qkv", got, want, strict=False):
                    errs[f"d{name} {label}"] = rel_err(a, b[..., idx, :])
                if kb_grad:  # this rank's keys' entries of the travelling mask's gradient
                    errs[f"dkbias {label}"] = rel_err(got[3], want[3][..., idx, :])
                if with_bias:  # this rank's rows of the bias gradient (0 for one per row:
                    floor = float(kind == "bias1")  # a shift of the softmax; absolute)
                    gb, wb = got[4][..., idx, :], want[4][..., idx, :]
                    errs[f"dbias {label}"] = rel_err(gb, wb, floor)
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_travelling_key_mask_gradient_matches_one_device(dist_pool, world):
    for rank, errs in enumerate(dist_pool.run(world, _travelling_errors)):
        bad = {k: e for k, e in errs.items() if not e < TOL}
        assert not bad, (rank, bad)


HEADS, QUERIES, C = 2, 2, 8
#: the largest query-sized reduction of the cross routes: (N, heads, Q, head dim + 1)
QUERY_SIZED = 2 * HEADS * QUERIES * (C // HEADS + 1)


def _model_failures(world: int, build, dp: bool = False, **check) -> list[str]:
    """``build(h, w)`` (2 output channels) parallelized against one device
    (``check_model_audited``): W strips at 2, 3 ranks (W = 7: 4 + 3, 3 + 3 + 1), 2 x 2 tiles
    at 4 (5 x 7: rows 3 + 2, columns 4 + 3) and with ``dp`` the (dp, sp) mesh."""
    cases = [(mesh(world), [Shard(3)], (4, 7), "strips ")]
    if world == 4:
        cases = [(*mesh_and_placements((2, 2), ("sp_h", "sp_w")), (5, 7), "tiles ")]
        cases += [(mesh((2, 2), ("dp", "sp")), [Shard(0), Shard(3)], (4, 7), "dp x sp ")] * dp
    out = []
    for dmesh, placements, (h, w), label in cases:
        torch.manual_seed(0)
        model = build(h, w).double()
        x, gy = seeded(1, 2, 3, h, w).double(), seeded(2, 2, 2, h, w).double()
        out += check_model_audited(model, x, gy, dmesh, placements, label=label, **check)
    return out


def _assert_matches(dist_pool, world: int, build, **check) -> None:
    for rank, failures in enumerate(dist_pool.run(world, _model_failures, world, build, **check)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


class MaskGrads(nn.Module):
    """Float masks whose gradients cross the ranks: MHA on the ring with a learned float
    ``attn_mask`` and a float ``key_padding_mask`` computed from the map (it travels with
    the keys), MHA with a causal boolean mask and the ``is_causal`` hint (one device uses
    ``is_causal`` alone); whole learned queries to the tokens by MHA (the same map-computed
    float ``key_padding_mask``, a learned per-head ``(N * heads, Q, L)`` float mask) and by
    SDPA (a float mask computed from the map, split like the keys, broadcast over heads);
    the queries back onto the map by einsum, plus a conv head."""

    def __init__(self, h: int, w: int, n: int = 2) -> None:
        super().__init__()
        length = h * w
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, QUERIES, 1)
        # no biases: a constant over every key of a row has no gradient (softmax)
        self.kp, self.mask_head = (
            nn.Conv2d(C, 1, 1, bias=False),
            nn.Conv2d(C, QUERIES, 1, bias=False),
        )
        self.mha = nn.MultiheadAttention(C, HEADS, batch_first=True)
        self.cross = nn.MultiheadAttention(C, HEADS, batch_first=True)
        self.bias = nn.Parameter(seeded(8, length, length, dtype=torch.float64) * 0.5)
        self.cross_bias = nn.Parameter(seeded(9, n * HEADS, QUERIES, length).double() * 0.5)
        self.query = nn.Parameter(seeded(10, QUERIES, C, dtype=torch.float64))
        self.sdpa_query = nn.Parameter(seeded(11, 1, HEADS, QUERIES, C // HEADS).double())
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        kp = self.kp(f).flatten(1)  # (N, L) float from the map: split like the keys
        kw = {"need_weights": False}
        t = t + self.mha(t, t, t, attn_mask=self.bias, key_padding_mask=kp, **kw)[0]
        t = t + self.mha(t, t, t, attn_mask=self.causal, is_causal=True, **kw)[0]
        q = self.query.unsqueeze(0).expand(b, -1, -1)  # plain, whole
        z = self.cross(q, t, t, attn_mask=self.cross_bias, key_padding_mask=kp, **kw)[0]
        kv = t.reshape(b, h * w, HEADS, c // HEADS).transpose(1, 2)
        m = self.mask_head(f).flatten(2).unsqueeze(1)  # (N, 1, Q, L) float, split like kv
        o = F.scaled_dot_product_attention(self.sdpa_query.expand(b, -1, -1, -1), kv, kv, m)
        z = z + o.transpose(1, 2).reshape(b, QUERIES, c)
        tmap = t.transpose(1, 2).reshape(b, c, h, w)
        return self.head(tmap) + torch.einsum("bqc,bchw->bqhw", z, f)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_float_mask_gradients_on_both_routes_match_one_device(dist_pool, world):
    _assert_matches(dist_pool, world, MaskGrads, dp=True, gather_numel=QUERY_SIZED + 1)


RING = " on a sharded token sequence"
CROSS = " with whole queries and keys split over the spatial ranks"
#: kind ("op:route:case") -> words its refusal names besides the op and the module
REFUSALS = {
    "sdpa:ring:mask_causal": (RING, "an attention mask with is_causal=True"),
    "sdpa:ring:dropout": (RING, "attention dropout (dropout_p=0.1)"),
    "sdpa:ring:gqa": (RING, "enable_gqa=True"),
    "sdpa:ring:mask_unlike": ("an attention mask", "next to queries", "split like the queries"),
    "sdpa:cross:causal": (CROSS, "is_causal=True (2, 2, 15, 2)"),
    "sdpa:cross:dropout": (CROSS, "attention dropout (dropout_p=0.1)"),
    "sdpa:cross:gqa": (CROSS, "enable_gqa=True"),
    "sdpa:cross:values": (CROSS, "values split"),
    "sdpa:cross:batch": (CROSS, "queries (1, 2, 3, 2) for keys"),
    "mha:ring:bias_kv": (RING, "bias_k / bias_v (add_bias_kv=True)"),
    "mha:ring:zero_attn": (RING, "add_zero_attn=True"),
    "mha:ring:static": (RING, "static_k / static_v"),
    "mha:ring:causal": (RING, "is_causal=True without an attn_mask"),
    "mha:ring:dropout": (RING, "attention dropout (dropout=0.1) in training"),
    "mha:ring:kpm3d": ("a key_padding_mask (2, 1, 15)", "unlike the keys", "split like the keys"),
    "mha:cross:bias_kv": (CROSS, "bias_k / bias_v (add_bias_kv=True)"),
    "mha:cross:zero_attn": (CROSS, "add_zero_attn=True"),
    "mha:cross:static": (CROSS, "static_k / static_v"),
    "mha:cross:causal": (CROSS, "is_causal=True is not supported"),
    "mha:cross:dropout": (CROSS, "attention dropout (dropout=0.1) in training"),
    "mha:cross:values": (CROSS, "values split unlike the keys"),
    "mha:whole:bias_kv": (CROSS, "bias_k / bias_v (add_bias_kv=True)"),
    "mha:whole:plain_query": (RING, "plain-tensor queries next to sharded keys / values"),
}


class Refused(nn.Module):
    """One attention call with one unsupported argument (``kind``: ``REFUSALS``) on the
    ring (queries split), whole queries to split keys (cross) or all whole (whole)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.op, self.route, self.case = kind.split(":")
        self.mha = nn.MultiheadAttention(
            4,
            2,
            dropout=0.1 if self.case == "dropout" else 0.0,
            batch_first=True,
            add_bias_kv=self.case == "bias_kv",
            add_zero_attn=self.case == "zero_attn",
        )

    def forward(self, x: torch.Tensor):
        t = x.flatten(2).transpose(1, 2)  # (N, L, 4) tokens
        b, n, _ = t.shape
        if self.op == "sdpa":
            return self._sdpa(t.reshape(b, n, 2, 2).transpose(1, 2))
        if self.route == "whole":
            t = F.adaptive_avg_pool2d(x, 1).flatten(2).transpose(1, 2)  # (N, 1, 4), whole
        q = t.new_ones(b, 3, 4) if self.route == "cross" else t
        q = q.to_local() if self.case == "plain_query" else q  # plain queries, whole keys
        v = t.detach().full_tensor() if self.case == "values" else t
        if self.case == "static":
            m = self.mha
            static = t.new_zeros(b * 2, n, 2).to_local()
            return F.multi_head_attention_forward(
                *(y.transpose(0, 1) for y in (q, t, v)), 4, 2, m.in_proj_weight,
                m.in_proj_bias, None, None, False, 0.0, m.out_proj.weight, m.out_proj.bias,
                training=False, need_weights=False, static_k=static, static_v=static,
            )  # fmt: skip
        if self.case == "kpm3d":  # (N, 1, L): split on dim 2
            kpm = x[:, :1].flatten(2) > 0
            return self.mha(q, t, v, key_padding_mask=kpm, need_weights=False)
        causal = self.case == "causal"
        mask = torch.zeros(q.shape[1], n, dtype=torch.bool) if causal and q is not t else None
        return self.mha(q, t, v, attn_mask=mask, is_causal=causal, need_weights=False)

    def _sdpa(self, k: torch.Tensor):
        b, h, n, d = k.shape
        q = k
        if self.route == "cross":
            q = k.new_ones(1 if self.case == "batch" else b, h, 3, d).to_local()
        v = k.detach().full_tensor() if self.case == "values" else k
        kw = {
            "mask_causal": {"attn_mask": torch.ones(n, n, dtype=torch.bool), "is_causal": True},
            "dropout": {"dropout_p": 0.1},
            "gqa": {"enable_gqa": True},
            "causal": {"is_causal": True},
        }.get(self.case, {})
        if self.case == "mask_unlike":  # scores split along their keys, not their rows
            kw["attn_mask"] = (q @ k.transpose(-2, -1)).transpose(-2, -1)
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _refusals() -> dict[str, str]:
    from tests.test_attention import refusal_messages

    return refusal_messages(Refused, tuple(REFUSALS))


def test_every_attention_refusal_names_op_module_reason_and_route(dist_pool):
    for msgs in dist_pool.run(2, _refusals):
        bad = {}
        for kind, words in REFUSALS.items():
            op = "F.scaled_dot_product_attention" if kind[:4] == "sdpa" else "nn.MultiheadAttention"
            msg = msgs[kind]
            if not ("module 'blk" in msg and op in msg and all(w in msg for w in words)):
                bad[kind] = msg
        assert not bad, "\n".join(f"{k}: {m}" for k, m in bad.items())


class EinsumLayouts(nn.Module):
    """Attention written out as einsums with spaces and tokens before heads (``"b x h d, b
    y h d -> b h x y"``, ``"b h x y, b y h d -> b x h d"``): operands and result permuted
    around the ring matmuls."""

    def __init__(self, *_size: int) -> None:  # (h, w): any map
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 2, 1)
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).reshape(b, h * w, 3, HEADS, c // HEADS).unbind(2)  # (N, L, H, d)
        attn = torch.einsum("b x h d, b y h d -> b h x y", q, k) * 0.4
        o = torch.einsum("b h x y, b y h d -> b x h d", attn.softmax(-1), v)
        t = t + o.reshape(b, h * w, c)
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


@pytest.mark.parametrize("world", [2, 3])
def test_einsum_with_spaces_and_permuted_terms_matches_one_device(dist_pool, world):
    _assert_matches(dist_pool, world, EinsumLayouts)


class CausalHint(nn.Module):
    """``nn.MultiheadAttention`` on the ring with ``is_causal=True`` next to a boolean
    ``attn_mask`` that is *not* causal: torch takes the causal order alone without a
    ``key_padding_mask`` and weights (to the same tokens and to spatial-reduction keys:
    top-left causal on ``L x S``), the mask alone with ``need_weights``, mask and padding
    with a ``key_padding_mask``."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        length, reduced = h * w, (h // 2) * (w // 2)
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 2, 1)
        self.sr, self.mha = nn.Conv2d(C, C, 2, 2), nn.MultiheadAttention(C, HEADS, batch_first=True)
        masks = [
            torch.rand(length, n, generator=torch.Generator().manual_seed(n)) > 0.6
            for n in (length, reduced)
        ]
        for m in masks:
            m[:, 0] = False  # every query sees key 0 (no row masked everywhere: NaN with weights)
        self.register_buffer("mask", masks[0])
        self.register_buffer("mask_sr", masks[1])
        pad = torch.rand(2, length, generator=torch.Generator().manual_seed(3)) < 0.3
        pad[:, 0] = False
        self.register_buffer("pad", pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        hint = {"attn_mask": self.mask, "is_causal": True}
        t = t + self.mha(t, t, t, need_weights=False, **hint)[0]
        t = t + self.mha(t, t, t, need_weights=True, **hint)[0]
        t = t + self.mha(t, t, t, key_padding_mask=self.pad, need_weights=False, **hint)[0]
        kv = self.sr(t.transpose(1, 2).reshape(b, c, h, w)).flatten(2).transpose(1, 2)
        t = t + self.mha(t, kv, kv, attn_mask=self.mask_sr, is_causal=True, need_weights=False)[0]
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mha_is_causal_hint_taken_as_torch_takes_it(dist_pool, world):
    _assert_matches(dist_pool, world, CausalHint, buffers=True)


class ProjectionForms(nn.Module):
    """``nn.MultiheadAttention`` forms no other test runs: sequence-first (``batch_first=
    False``) and ``kdim`` / ``vdim`` (separate projection weights), on the ring (keys of 6
    channels from a strided conv: their own token layout) and for whole queries."""

    def __init__(self, *_size: int) -> None:  # (h, w): any map
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 2, 1)
        self.sr = nn.Conv2d(C, 6, 2, 2)
        self.ring = nn.MultiheadAttention(C, HEADS, kdim=6, vdim=6)  # sequence-first
        self.cross = nn.MultiheadAttention(C, HEADS, kdim=6, vdim=6, batch_first=True)
        self.query = nn.Parameter(seeded(12, QUERIES, C, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).permute(2, 0, 1)  # (L, N, C)
        kv = self.sr(f).flatten(2).permute(2, 0, 1)  # (S, N, 6)
        t = t + self.ring(t, kv, kv, need_weights=False)[0]
        q = self.query.unsqueeze(0).expand(b, -1, -1)
        z = self.cross(q, kv.transpose(0, 1), kv.transpose(0, 1), need_weights=False)[0]
        tmap = t.permute(1, 2, 0).reshape(b, c, h, w)
        return self.head(tmap) + torch.einsum("bqc,bchw->bqhw", z, f)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mha_sequence_first_and_kdim_vdim_match_one_device(dist_pool, world):
    _assert_matches(
        dist_pool, world, ProjectionForms, gather_numel=QUERY_SIZED + 1, grad_floor=1e-4
    )
