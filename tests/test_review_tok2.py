"""Review of the token layer's second cut: ops over the split token dim inside a
parallelized forward (scans, sorts, ``max`` / ``argmax`` / ``logsumexp``, ``torch.aminmax``)
are exact or refused by name, never an activation gathered; behind prefix tokens the
indexing forms the cut re-routed (explicit stops, ellipsis, negative indices, a whole slice
of the batch) and the arithmetic of a scalar first or in place. fp64 output, input and every
parameter gradient against one device, uneven token counts, no-gather audit
(``tests/op_check.py``), W strips, H strips and tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode, SpatialShardingError
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded


def _no_failures(results: list) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:20])


class TokenOp(nn.Module):
    """A map's pixel tokens (``prefix`` learned tokens in front), ``op`` on them, the
    result back on the map: the pixel tokens as a map, or a per-sample value times it."""

    def __init__(self, op, prefix: int = 0, c: int = 4) -> None:
        super().__init__()
        self.op, self.p = op, prefix
        self.proj = nn.Conv2d(3, c, 1)
        self.cls = nn.Parameter(torch.randn(1, prefix, c)) if prefix else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        m = self.proj(x)
        t = m.flatten(2).transpose(1, 2)
        if self.p:
            t = torch.cat([self.cls.expand(n, -1, -1), t], 1)
        r = self.op(t)
        if r.ndim == 3 and r.shape[1] == t.shape[1]:
            return r[:, self.p :].transpose(1, 2).reshape(n, -1, h, w)
        return r.sum(tuple(range(1, r.ndim))).view(n, 1, 1, 1) * m


def _meshes(world: int) -> list:
    """``(label, mesh, placements)``: W strips (tokens ``_StridedShard``), H strips (tokens
    ``Shard``) and tiles (``sp_h`` x ``sp_w``, one of size 1)."""
    tiles = mesh((1, world), ("sp_h", "sp_w"))
    return [
        ("W strips", mesh(world), [Shard(3)]),
        ("H strips", mesh(world), [Shard(2)]),
        ("tiles", tiles, [Shard(2), Shard(3)]),
    ]


#: ops over the split token dim (dim 1) of prefix-free tokens: exact, or refused by name
#: (``SpatialShardingError`` naming the op); never a silent gather or a wrong value
OVER_TOKENS = [
    ("cumsum", lambda t: t.cumsum(1), "cumsum"),
    ("torch.cumsum dim=", lambda t: torch.cumsum(t, dim=1), "cumsum"),
    ("cumprod", lambda t: t.cumprod(1), "cumprod"),
    ("max values", lambda t: t.max(1).values, "max"),
    ("argmax", lambda t: t.argmax(1).double() + t.sum(1), "argmax"),
    ("logsumexp", lambda t: t.logsumexp(1), "logsumexp"),
    ("torch.sort", lambda t: torch.sort(t, dim=1).values, "sort"),
    ("topk", lambda t: t.topk(2, dim=1).values, "topk"),
    ("aminmax", lambda t: torch.aminmax(t, dim=1).max, "aminmax"),
    ("aminmax keepdim", lambda t: t.aminmax(dim=-2, keepdim=True).min * t, "aminmax"),
    # cat along the tokens by torch's alias axis= (was cat along the batch: (2 N, L, C))
    ("cat axis=", lambda t: torch.cat([t, t * 2], axis=1).sum(1), "aten.cat"),
    ("concatenate axis=", lambda t: torch.concatenate([t, t * 2], axis=-2).sum(1), "aten.cat"),
    ("concat channels axis=", lambda t: torch.concat([t, t * 2], axis=-1), "aten.cat"),
    # DTensor's prod failed in the backward, unnamed ("aten.cat got mixed"), over any dim
    ("prod", lambda t: t.prod(1), "prod"),
    ("torch.prod keepdim dtype", lambda t: torch.prod(t, -2, True, dtype=t.dtype), "prod"),
    ("prod channels", lambda t: t * t.prod(-1, keepdim=True), "prod"),
    ("prod batch", lambda t: t * torch.prod(t, dim=0), "prod"),
]


def over_tokens_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(41, 2, 3, 5, 2 * world + 1, dtype=torch.float64)  # uneven
    for name, op, aten in OVER_TOKENS:
        for label, dmesh, placements in _meshes(world):
            torch.manual_seed(0)
            try:
                check_module(
                    TokenOp(op).double(), x, dmesh, placements, f"{name} {label}", failures
                )
            except SpatialShardingError as e:
                if aten not in str(e):
                    failures.append(f"{name} {label}: refused without naming {aten}: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_ops_over_split_tokens_exact_or_refused(dist_pool, world):
    """``torch.aminmax`` over the tokens of H strips once all-gathered them in the backward."""
    _no_failures(dist_pool.run(world, over_tokens_failures))


def aminmax_map_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(42, 2, 3, 6 * world + 1, 2 * world + 1, dtype=torch.float64)  # reduced: small
    ops = [
        ("map H", lambda m: torch.aminmax(m, dim=2).max.unsqueeze(2) * m),
        ("map W", lambda m: m * m.aminmax(dim=-1, keepdim=True).min),
        ("map all", lambda m: m * torch.aminmax(m).max),
        ("map prod channels", lambda m: m * m.prod(1, keepdim=True)),
    ]
    for name, op in ops:
        for label, dmesh, placements in _meshes(world):
            check_fn(op, x, dmesh, placements, f"aminmax {name} {label}", failures)
    return failures


def test_aminmax_and_prod_of_maps(dist_pool):
    _no_failures(dist_pool.run(2, aminmax_map_failures))


def _with_prefix(op, prefix: int = 2):
    """``op`` on a map's pixel tokens behind ``prefix`` constant tokens (``t``, ``L`` pixel
    tokens): its pixel tokens ``(N, L, C)`` back as the map."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        front = torch.linspace(-1, 1, prefix * c, dtype=x.dtype, device=x.device)
        t = torch.cat([front.view(1, prefix, c).expand(n, -1, -1), x.flatten(2).transpose(1, 2)], 1)
        return op(t, h * w).transpose(1, 2).reshape(n, c, h, w)

    return fn


def _pos(t: torch.Tensor) -> torch.Tensor:
    """A plain constant ``(1, tokens, C)`` (a position embedding without gradient)."""
    return torch.linspace(-2, 2, t.shape[1] * t.shape[2], dtype=t.dtype).view(1, *t.shape[1:])


#: behind 2 prefix tokens ``(label, op(t, L))`` giving the pixel tokens: the forms of the
#: pixel-token slice and of an index inside the prefix the cut re-routed (``_items``)
PREFIX_FORMS = [
    ("explicit stop", lambda t, n: t[:, 2 : t.shape[1]]),
    ("explicit stop step 1", lambda t, n: t[:, 2 : t.shape[1] : 1]),
    ("negative start", lambda t, n: t[:, -n:]),
    ("ellipsis", lambda t, n: t[..., 2:, :]),
    ("whole batch slice", lambda t, n: t[0 : t.shape[0], 2:]),
    ("then whole slices", lambda t, n: t[:, 2:][:, 0:][:, ::1][:, -n:]),
    ("negative int into prefix", lambda t, n: t[:, 2:] * t[:, -t.shape[1]].unsqueeze(1)),
    ("ellipsis int", lambda t, n: t[:, 2:] + t[..., 1, :].unsqueeze(1)),
    ("select negative", lambda t, n: t[:, 2:] * t.select(-2, 1 - t.shape[1])[:, None]),
    ("prefix by negative stop", lambda t, n: t[:, 2:] - t[:, :-n].sum(1, keepdim=True)),
    ("scalar first", lambda t, n: (2.0 - t)[:, 2:] + (3.0 * t)[:, 2:] / (1.5 + t * t)[:, 2:]),
    ("plain other, alpha", lambda t, n: torch.sub(t, _pos(t), alpha=0.5)[:, 2:]),
    ("in place mul_", lambda t, n: (t * 1).mul_(t)[:, 2:]),
    ("channel mean keepdim", lambda t, n: (t - t.mean(-1, keepdim=True))[:, 2:]),
    ("prefix token broadcast", lambda t, n: (t * t[:, :1])[:, 2:]),
    # DTensor's stack dropped the prefix (a _StridedShard the ranks' tokens do not have)
    ("stack", lambda t, n: torch.stack([t, t * 2], 1).sum(1)[:, 2:]),
    ("stack last dim=", lambda t, n: torch.stack((t, t.sin()), dim=-1).prod(-1)[:, 2:]),
]


def prefix_form_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(43, 2, 4, 2 * world + 2, 3 * world + 1, dtype=torch.float64)  # prefix: small
    for name, op in PREFIX_FORMS:
        for label, dmesh, placements in _meshes(world):
            try:
                check_fn(_with_prefix(op), x, dmesh, placements, f"{name} {label}", failures)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_forms_match_single_device(dist_pool, world):
    _no_failures(dist_pool.run(world, prefix_form_failures))


def _map_back(t: torch.Tensor, n: int, c: int, h: int, w: int) -> torch.Tensor:
    return t.reshape(n, h * w, c).transpose(1, 2).reshape(n, c, h, w)


#: reshapes of pixel tokens ``(N, L, C)`` in the forms the one reshape handler parses
#: (keywords, a dtype view, unflatten, the batch and the tokens flattened together)
RESHAPES = [
    ("view tokens to map rows", lambda t, s: t.view(s[0], s[2], s[3], s[1]).flatten(1, 2)),
    ("unflatten keyword", lambda t, s: torch.unflatten(t, dim=1, sizes=(s[2], s[3])).flatten(1, 2)),
    ("reshape shape=", lambda t, s: t.reshape(shape=(s[0], s[2], -1, s[1])).flatten(1, 2)),
    (
        "flatten start_dim=",
        lambda t, s: torch.flatten(t.unflatten(1, (s[2], s[3])), start_dim=1, end_dim=2),
    ),
    (
        "dtype view",
        lambda t, s: t * t.detach().view(torch.float64) - t.detach().view(dtype=torch.float64),
    ),
    ("batch and tokens", lambda t, s: t.flatten(0, 1).view(s[0], -1, s[1])),
]


def reshape_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(44, 2, 4, 5, 2 * world + 1, dtype=torch.float64)
    for name, op in RESHAPES:

        def fn(m, op=op):
            n, c, h, w = m.shape
            return _map_back(op(m.flatten(2).transpose(1, 2), m.shape), n, c, h, w)

        for label, dmesh, placements in _meshes(world):
            try:
                check_fn(fn, x, dmesh, placements, f"{name} {label}", failures)
            except SpatialShardingError as e:
                failures.append(f"{name} {label}: refused: {str(e)[:300]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_token_reshape_forms(dist_pool, world):
    _no_failures(dist_pool.run(world, reshape_failures))


#: ops DTensor's own rules ran on tokens behind a prefix giving a ``_StridedShard`` without
#: it (a layout the ranks' tokens do not have: silently wrong after), now refused by name
#: (``_errors._lost_prefix``)
LOST_PREFIX = [
    ("detach", lambda t: t.detach()),
    ("torch.where", lambda t: torch.where(t > 0, t, t * 2)),
    ("** 2", lambda t: t**2),
    ("lerp", lambda t: torch.lerp(t, t * 2, 0.5)),
    ("maximum", lambda t: torch.maximum(t, t * 2)),
    ("swapaxes", lambda t: t.swapaxes(1, 2)),
    ("repeat channels", lambda t: t.repeat(1, 1, 2)),
    ("narrow channels", lambda t: t.narrow(-1, 0, 2)),
    ("dstack", lambda t: torch.dstack([t, t])),
]


def lost_prefix_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(45, 2, 3, 5, 2 * world + 1, dtype=torch.float64)
    front = torch.ones(1, 2, 3, dtype=torch.float64)
    for label, dmesh, placements in _meshes(world):
        xs = distribute_tensor(x, dmesh, placements)
        for name, op in LOST_PREFIX:
            try:
                with SpatialMode():
                    t = torch.cat([front.expand(2, -1, -1), xs.flatten(2).transpose(1, 2)], 1)
                    out = op(t)
                failures.append(f"{name} {label}: not refused ({out.placements})")
            except SpatialShardingError as e:
                if "drops the prefix" not in str(e):
                    failures.append(f"{name} {label}: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_lost_by_dtensor_refused(dist_pool, world):
    _no_failures(dist_pool.run(world, lost_prefix_failures))
