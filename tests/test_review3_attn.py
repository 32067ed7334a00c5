"""Review of the third cut of the attention modules (issue 22): cases its changes touch that
no other test reaches. fp64 against one device, every gradient, no activation gather.

* keys / values pooled over the split tokens (slot weights times the tokens: DTensor's
  own matmul / einsum, a ``Partial`` sum) on the ring by SDPA and MHA, with a float
  ``key_padding_mask`` pooled so too and one whole (a DTensor: its gradient a partial
  sum per rank);
* a rank holding no token (2 over 3 ranks): SDPA causal and masked, MHA with the causal
  hint and a float mask, whole queries to keys of which a rank holds none (MHA, SDPA);
* SDPA on the ring of queries of 3 and 5 dims (no heads; two batch dims);
* causal attention to whole keys (``_keys``' local route: the causal rows against the keys
  ``0..S-1``, SDPA's top-left alignment) by SDPA ``is_causal`` and the MHA hint, next to
  the ring's, on uneven W strips and tile meshes of one split dim (nested layouts);
* plain masks (``masked_fill`` / ``torch.where``) of every broadcast form next to split
  tokens: full size, broadcast over dims, ``(1,)``, 0 dims, next to a 0-size dim, a
  plain ``other`` operand;
* ``Tensor.unfold`` with a step (patches, overlapping windows) on a split dim, twice on one
  shape (the cached spec) and without grad;
* ``torch.einsum`` attention with upper-case indices;
* the key-route refusals of ``_keys`` (plain keys, values split unlike the keys, keys
  split along another dim or over another mesh dim) and of queries split off their
  sequence, for SDPA and MHA: their texts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn, check_model_audited
from tests.reference import seeded

C, HEADS, KEYS = 4, 2, 3
L = 5  # tokens: 3 + 2 at 2 ranks, 2 + 2 + 1 at 3


class CausalRoutes(nn.Module):
    """Tokens of a 1x1-conv map through causal attention on both routes of ``_keys``: the
    ring (keys split like the queries) and whole keys (a pooled token plus ``KEYS`` learned
    offsets), by SDPA ``is_causal`` and by the MHA ``is_causal`` hint (a non-causal mask
    next to it, which torch drops), then back onto the map."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        length = h * w
        self.stem, self.head = nn.Conv2d(C, C, 1), nn.Conv2d(C, 2, 1)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.mha = nn.MultiheadAttention(C, HEADS, batch_first=True)
        self.offsets = nn.Parameter(seeded(5, 1, KEYS, C, dtype=torch.float64))
        self.register_buffer("open", torch.zeros(length, length, dtype=torch.bool))
        self.register_buffer("open_keys", torch.zeros(length, KEYS, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        g = F.adaptive_avg_pool2d(f, 1).flatten(2).transpose(1, 2) + self.offsets  # whole
        heads = (b, -1, HEADS, c // HEADS)
        q, k, v = (y.reshape(heads).transpose(1, 2) for y in self.qkv(t).chunk(3, -1))
        gh = g.reshape(heads).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.45)
        o = o + F.scaled_dot_product_attention(q, gh, gh * 0.5, is_causal=True)
        t = t + self.proj(o.transpose(1, 2).reshape(b, h * w, c))
        kw = {"is_causal": True, "need_weights": False}
        t = t + self.mha(t, t, t, attn_mask=self.open, **kw)[0]
        t = t + self.mha(t, g, g, attn_mask=self.open_keys, **kw)[0]
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def _causal_failures(world: int) -> list[str]:
    """``CausalRoutes`` on W strips (7: uneven) and tile meshes of one split dim."""
    cases = [(mesh(world), [Shard(3)], (3, 7), "strips ")]
    cases.append((*mesh_and_placements((1, world), ("sp_h", "sp_w")), (4, 8), "tiles 1 x w "))
    cases.append((*mesh_and_placements((world, 1), ("sp_h", "sp_w")), (8, 4), "tiles h x 1 "))
    out = []
    for dmesh, placements, (h, w), label in cases:
        torch.manual_seed(0)
        model = CausalRoutes(h, w).double()
        x, gy = seeded(1, 2, C, h, w).double(), seeded(2, 2, 2, h, w).double()
        # the whole keys' gradient (N, KEYS, C): partial sums, one all-reduce
        keys = 2 * KEYS * C + 1
        out += check_model_audited(model, x, gy, dmesh, placements, gather_numel=keys, label=label)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_causal_attention_to_whole_and_split_keys_matches_one_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, _causal_failures, world)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


class SlotKeys(nn.Module):
    """Tokens attending on the ring to ``KEYS`` slots pooled from them: softmax weights over
    the split tokens times the tokens (``matmul``, ``einsum``: DTensor's own, a pending sum
    over the ranks, ``Partial``), by SDPA and MHA (a float ``key_padding_mask`` pooled so
    too, and one pooled whole: its gradient a partial sum per rank)."""

    def __init__(self, *_size: int) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(C, C, 1), nn.Conv2d(C, 2, 1)
        self.slots = nn.Conv2d(C, KEYS, 1, bias=False)  # (a bias has no gradient: softmax)
        self.mha = nn.MultiheadAttention(C, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        a = self.slots(f).flatten(2).softmax(-1)  # (N, KEYS, L)
        g = a @ t  # (N, KEYS, C)
        ge = torch.einsum("bsl,blc->bsc", a, t * 0.5).reshape(b, KEYS, HEADS, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            t.reshape(b, -1, HEADS, c // HEADS).transpose(1, 2), ge, ge
        )
        t = t + o.transpose(1, 2).reshape(b, h * w, c)
        kp = (a @ t[..., :1]).squeeze(-1)  # (N, KEYS) float key_padding_mask, a sum too
        t = t + self.mha(t, g, g, key_padding_mask=kp, need_weights=False)[0]
        kp = F.adaptive_avg_pool2d(f, 1).flatten(1)[:, :KEYS]  # whole, no sum pending
        t = t + self.mha(t, g, g, key_padding_mask=kp, need_weights=False)[0]
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def _slot_failures(world: int) -> list[str]:
    """``SlotKeys`` on W strips (7: uneven). The slots' sums and their gradients are
    key-sized all-reduces."""
    torch.manual_seed(0)
    model, keys = SlotKeys().double(), 2 * KEYS * C + 1
    x, gy = seeded(1, 2, C, 3, 7).double(), seeded(2, 2, 2, 3, 7).double()
    return check_model_audited(
        model, x, gy, mesh(world), [Shard(3)], gather_numel=keys, traffic=None
    )


@pytest.mark.parametrize("world", [2, 3])
def test_keys_pooled_over_the_split_tokens_match_one_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, _slot_failures, world)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


def _empty_rank_failures() -> list[str]:
    """The handlers with a rank holding no token (2 over 3 ranks): SDPA causal, with a plain
    float mask and a broadcast boolean one; MHA (sequence-first) with the causal hint and a
    float mask; whole plain queries to those keys by MHA and SDPA (the cross route). Output
    and input gradient (the weights are plain)."""
    dmesh, failures, n = mesh(3), [], 2
    x = seeded(8, 2, HEADS, n, 4, dtype=torch.float64)
    bias = seeded(9, n, n, dtype=torch.float64)
    keep = torch.tensor([[True, False], [True, True]]).view(1, 1, n, n)
    sdpa = F.scaled_dot_product_attention

    def attention(t):
        o = sdpa(t, t * 0.7, t * 1.3, is_causal=True, scale=0.4)
        return o + sdpa(t, t, t * 0.5, attn_mask=bias) + sdpa(t * 2, t, t, attn_mask=keep)

    check_fn(attention, x, dmesh, [Shard(2)], "sdpa empty rank", failures)
    w_in, w_out = seeded(10, 3 * C, C).double(), seeded(11, C, C).double()
    b_in, b_out = seeded(12, 3 * C).double(), seeded(13, C).double()

    def mha(t, q=None, **kw):  # (L, N, E); q: whole queries (the cross route)
        out = F.multi_head_attention_forward(
            t if q is None else q, t, t, C, HEADS, w_in, b_in, None, None, False, 0.0, w_out,
            b_out, training=False, need_weights=False, **kw,
        )  # fmt: skip
        return out[0]

    y = seeded(14, n, 2, C, dtype=torch.float64)
    hint = {"attn_mask": torch.zeros(n, n, dtype=torch.bool), "is_causal": True}
    check_fn(lambda t: mha(t, **hint), y, dmesh, [Shard(0)], "mha hint empty rank", failures)
    check_fn(lambda t: mha(t, attn_mask=bias), y, dmesh, [Shard(0)], "mha bias empty", failures)
    # whole plain queries (3) to keys of which a rank holds none (the cross route); its
    # one query-sized sum (N, heads, 3, head dim + 1) is no activation
    q, qh = seeded(15, 3, 2, C).double(), seeded(16, 2, HEADS, 3, 4).double()
    sums = {"param_shapes": {(2, HEADS, 3, C // HEADS + 1), (2, HEADS, 3, 5)}}
    check_fn(lambda t: mha(t, q), y, dmesh, [Shard(0)], "mha cross empty", failures, **sums)
    fn = lambda t: sdpa(qh, t, t * 0.5)  # noqa: E731
    check_fn(fn, x, dmesh, [Shard(2)], "sdpa cross empty", failures, **sums)
    return failures


def test_a_rank_holding_no_token_matches_one_device(dist_pool):
    for rank, failures in enumerate(dist_pool.run(3, _empty_rank_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


def _query_dims_failures() -> list[str]:
    """SDPA on the ring of queries without heads ``(N, L, E)`` and with two batch dims
    ``(N, G, heads, L, E)`` (the CPU flash kernel takes 4 dims alone: the matmul path),
    plain, causal and with a float mask; L = 5 uneven."""
    dmesh, failures = mesh(dist.get_world_size()), []
    sdpa, bias = F.scaled_dot_product_attention, seeded(17, L, L, dtype=torch.float64)
    fns = {
        "plain": lambda t: sdpa(t, t * 0.7, t),
        "causal": lambda t: sdpa(t, t * 0.7, t, is_causal=True, scale=0.4),
        "mask": lambda t: sdpa(t, t * 0.7, t, attn_mask=bias),
    }
    for x in (seeded(18, 2, L, 4).double(), seeded(19, 2, 3, 2, L, 4).double()):
        for label, fn in fns.items():
            check_fn(fn, x, dmesh, [Shard(x.ndim - 2)], f"{x.ndim}-dim {label}", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_sdpa_of_three_and_five_dim_queries_on_the_ring_matches_one_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, _query_dims_failures)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


#: plain masks next to tokens (2, 3, L, 4) split along L: full size, broadcast forms
MASKS = {
    "full": (2, 3, L, 4),
    "trailing": (L, 4),
    "rows": (L, 1),
    "lead": (3, 1, 1),
    "one": (1,),
    "ones": (1, 1, 1, 1),
}


def _plain_mask_failures() -> list[str]:
    """``masked_fill`` (method and function) and ``torch.where`` (plain mask, plain
    ``other``) of each plain mask of ``MASKS`` next to tokens split along L; a 0-dim mask;
    masks next to tokens with a 0-size dim."""
    dmesh, failures = mesh(dist.get_world_size()), []
    x = seeded(3, 2, 3, L, 4, dtype=torch.float64)
    for name, shape in MASKS.items():
        keep = seeded(4, *shape, dtype=torch.float64) > 0
        other = seeded(6, *shape, dtype=torch.float64)
        fns = {
            "masked_fill": lambda t, keep=keep: (t * 1.5).masked_fill(keep, -2.0),
            "torch.masked_fill": lambda t, keep=keep: torch.masked_fill(t * 1.5, ~keep, 0.5),
            "where": lambda t, keep=keep, o=other: torch.where(keep, t * 1.5, o),
        }
        for op, fn in fns.items():
            check_fn(fn, x, dmesh, [Shard(2)], f"{op} {name}", failures)
    scalar = torch.tensor(True)  # 0 dims: DTensor's own rule
    check_fn(lambda t: (t * 1.5).masked_fill(scalar, 2.0), x, dmesh, [Shard(2)], "0-dim", failures)
    empty = x[:, :0].contiguous()  # a 0-size dim next to the split one
    for shape in ((0, 1, 1), (1, L, 1), (L, 4), (1, 0, L, 4)):
        keep = torch.zeros(shape, dtype=torch.bool)
        fn = lambda t, keep=keep: (t * 2).masked_fill(keep, 1.0)  # noqa: E731
        check_fn(fn, empty, dmesh, [Shard(2)], f"0-size {shape}", failures)
    return failures


def test_plain_masks_of_every_broadcast_form_match_one_device(dist_pool):
    for world in (2, 3):
        for rank, failures in enumerate(dist_pool.run(world, _plain_mask_failures)):
            assert not failures, f"world {world} rank {rank}: " + "; ".join(failures[:8])


def _unfold_failures() -> list[str]:
    """``Tensor.unfold`` along a split W (7: uneven): patches (size = step), overlapping
    windows with a step, two calls on one shape (the second wraps with the cached spec),
    one of a tensor that needs no grad."""
    dmesh, failures = mesh(dist.get_world_size()), []
    x = seeded(7, 2, 3, 4, 7, dtype=torch.float64)
    fns = {
        "patches 2/2": lambda t: t.unfold(3, 2, 2) * 1.5,
        "windows 3/2": lambda t: t.unfold(3, 3, 2).exp(),
        "twice": lambda t: t.unfold(3, 3, 1) * (t * 2).unfold(3, 3, 1),
        "no grad": lambda t: t.unfold(3, 2, 1) * t.detach().unfold(3, 2, 1),
    }
    for label, fn in fns.items():
        check_fn(fn, x, dmesh, [Shard(3)], f"unfold {label}", failures)
    return failures


def test_tensor_unfold_with_steps_matches_one_device(dist_pool):
    for world in (2, 3):
        for rank, failures in enumerate(dist_pool.run(world, _unfold_failures)):
            assert not failures, f"world {world} rank {rank}: " + "; ".join(failures[:8])


class UpperEinsum(nn.Module):
    """Attention written out as einsums with upper-case indices."""

    def __init__(self, *_size: int) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(C, C, 1), nn.Conv2d(C, 2, 1)
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        b, c, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)
        heads = (b, -1, HEADS, c // HEADS)
        q, k, v = (y.reshape(heads).transpose(1, 2) for y in self.qkv(t).chunk(3, -1))
        a = torch.einsum("BHXD,BHYD->BHXY", q, k).softmax(-1)
        o = torch.einsum("BHXY,BHYD->BHXD", a, v)
        t = t + o.transpose(1, 2).reshape(b, h * w, c)
        return self.head(t.transpose(1, 2).reshape(b, c, h, w))


def _einsum_failures(world: int) -> list[str]:
    torch.manual_seed(0)
    model = UpperEinsum().double()
    x, gy = seeded(1, 2, C, 3, 7).double(), seeded(2, 2, 2, 3, 7).double()
    return check_model_audited(model, x, gy, mesh(world), [Shard(3)], label="einsum ")


@pytest.mark.parametrize("world", [2, 3])
def test_upper_case_einsum_attention_matches_one_device(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, _einsum_failures, world)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:8])


RING = " on a sharded token sequence: "
S0, S1, S2, S3, R = Shard(0), Shard(1), Shard(2), Shard(3), Replicate()
KV = "keys / values split as "
#: case -> (SDPA or MHA, queries', keys', values' placements, the refusal's words)
KEY_ROUTES = {
    "plain keys": ("sdpa", (S2, None, None), "plain-tensor keys / values next to sharded"),
    "values whole": ("sdpa", (S2, S2, R), KV + "(Shard(dim=2),), (Replicate(),) unlike the"),
    "keys on E": ("sdpa", (S2, S3, S3), KV + "(Shard(dim=3),), (Shard(dim=3),) unlike the"),
    "keys on heads": ("sdpa", (S2, S1, S1), KV + "(Shard(dim=1),), (Shard(dim=1),) unlike"),
    "queries on heads": ("sdpa", (S1, S2, S2), "queries split as (Shard(dim=1),) next to keys"),
    "mha plain keys": ("mha", (S0, None, None), "plain-tensor keys / values next to sharded"),
    "mha values whole": ("mha", (S0, S0, R), KV + "(Shard(dim=0),), (Replicate(),) unlike the"),
    "mha keys on E": ("mha", (S0, S2, S2), KV + "(Shard(dim=2),), (Shard(dim=2),) unlike the"),
    "mha queries on N": ("mha", (S1, S0, S0), "queries split as (Shard(dim=1),) next to keys"),
}
#: keys split over sp_w, the queries over sp_h (a (2, 1) tile mesh)
OTHER_MESH_DIM = KV + "(Replicate(), Shard(dim=2)), (Replicate(), Shard(dim=2)) unlike the"


def _key_route_messages() -> dict[str, str]:
    """The message (or "not refused") of each ``KEY_ROUTES`` case, and of keys split over
    another mesh dim than the queries (a ``(2, 1)`` tile mesh)."""
    flat, tiles = mesh(2), mesh((2, 1), ("sp_h", "sp_w"))
    x, y = seeded(20, 2, 2, L, 4).double(), seeded(21, L, 2, C).double()
    w_in, w_out = seeded(22, 3 * C, C).double(), seeded(23, C, C).double()

    def mha(q, k, v):
        args = (C, HEADS, w_in, None, None, None, False, 0.0, w_out, None)
        return F.multi_head_attention_forward(q, k, v, *args, need_weights=False)

    calls = {}
    for case, (op, pls, _) in KEY_ROUTES.items():
        t = x if op == "sdpa" else y
        qkv = [t if p is None else distribute_tensor(t, flat, [p]) for p in pls]
        calls[case] = (F.scaled_dot_product_attention if op == "sdpa" else mha, qkv)
    q = distribute_tensor(x, tiles, [Shard(2), Replicate()])
    k = distribute_tensor(x, tiles, [Replicate(), Shard(2)])
    calls["keys over sp_w"] = (F.scaled_dot_product_attention, (q, k, k))
    out = {}
    for case, (fn, args) in calls.items():
        try:
            with SpatialMode():
                fn(*args)
            out[case] = "not refused"
        except SpatialShardingError as exc:
            out[case] = str(exc)
    return out


def test_key_route_refusals_name_the_reason(dist_pool):
    for msgs in dist_pool.run(2, _key_route_messages):
        want = {case: (op, words) for case, (op, _, words) in KEY_ROUTES.items()}
        want["keys over sp_w"] = ("sdpa", OTHER_MESH_DIM)
        bad = {}
        for case, (op, words) in want.items():
            name = "F.scaled_dot_product_attention" if op == "sdpa" else "nn.MultiheadAttention"
            route = " with whole queries" if "queries on" in case else RING
            msg = msgs[case]
            if not (msg.startswith(name) and route in msg and words in msg):
                bad[case] = msg
        assert not bad, "\n".join(f"{k}: {m}" for k, m in bad.items())
