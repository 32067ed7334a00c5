"""What a timm ViT's prefix (class / register) tokens over sharded pixels still refuses
(``_token_prefix.py``), with ``SpatialShardingError`` naming the op and the module instead
of a DTensor error: a slice of the token dim that mixes the prefix (on the first rank) with
the pixel tokens, a move of the tokens that DTensor would read wrongly (``sort`` along
them, ``full_tensor``) and a reduction or scan (``mean``, ``cumsum``) over the tokens
behind the prefix; element-wise math that DTensor runs itself keeps the prefix (exact).
What runs is tested in tests/test_vit_prefix_tokens.py and (tiles, rows, reductions over
the channels) tests/test_vit_prefix_tiles.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.reference import seeded

pytest.importorskip("timm")


class MixedSlice(nn.Module):
    """The class token and the first pixel tokens in one slice."""

    def __init__(self) -> None:
        super().__init__()
        from tests.test_vit_prefix_tokens import ViTMap

        self.vit = ViTMap().vit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit._pos_embed(self.vit.patch_embed(x))[:, :3]


class PrefixOp(nn.Module):
    """A class token in front of pixel tokens, ``op`` on all of them, the map back."""

    def __init__(self, op) -> None:
        super().__init__()
        self.proj, self.cls, self.op = nn.Conv2d(3, 8, 1), nn.Parameter(torch.randn(1, 1, 8)), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        t = torch.cat([self.cls.expand(n, -1, -1), self.proj(x).flatten(2).transpose(1, 2)], 1)
        return self.op(t)[:, 1:].transpose(1, 2).reshape(n, -1, h, w)


#: element-wise math that DTensor runs itself (its placements drop the prefix unless kept)
MATH = {
    "exp": lambda t: t.exp(),
    "pow": lambda t: t.pow(2) + t.abs().sqrt(),
    "clamp": lambda t: torch.erf(t).clamp(-0.5, 0.5),
}


def prefix_math() -> dict[str, float]:
    """Largest difference to one device of the output and every gradient, per op."""
    dmesh, out = mesh(2), {}
    for name, op in MATH.items():
        torch.manual_seed(0)
        ref = PrefixOp(op).double()
        par = parallelize(copy.deepcopy(ref), dmesh)
        x = seeded(1, 2, 3, 4, 7, dtype=torch.float64)
        y_ref, y = ref(x), par(distribute_tensor(x, dmesh, [Shard(3)]))
        g = seeded(2, *y_ref.shape, dtype=torch.float64)
        y_ref.backward(g)
        y.backward(distribute_tensor(g, dmesh, [Shard(3)]))
        diffs = [(y.full_tensor() - y_ref).abs().max()]
        for p, q in zip(par.parameters(), ref.parameters(), strict=True):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            diffs.append((grad - q.grad).abs().max())
        out[name] = max(d.item() for d in diffs)
    return out


def _refusal(model: nn.Module, dmesh, placements) -> str:
    x = distribute_tensor(seeded(1, 1, 3, 32, 80, dtype=torch.float64), dmesh, placements)
    try:
        parallelize(model.double(), dmesh)(x)
    except SpatialShardingError as exc:
        return str(exc)
    return "not refused"


def prefix_refusals() -> dict[str, str]:
    torch.manual_seed(0)
    out = {"slice": _refusal(MixedSlice(), mesh(2), [Shard(3)])}
    out["sort"] = _refusal(PrefixOp(lambda t: t.sort(1).values), mesh(2), [Shard(3)])
    out["full_tensor"] = _refusal(PrefixOp(lambda t: t.full_tensor()), mesh(2), [Shard(3)])
    over_tokens = {"mean": lambda t: t - t.mean(1, keepdim=True), "cumsum": lambda t: t.cumsum(1)}
    for name, op in over_tokens.items():
        out[name] = _refusal(PrefixOp(op), mesh(2), [Shard(3)])
    return out


def test_vit_prefix_refusals_name_op_and_module(dist_pool):
    for msgs in dist_pool.run(2, prefix_refusals):
        assert msgs["slice"].startswith("indexing (x[...]) in module '<model>'"), msgs["slice"]
        assert "mixes its 1 prefix tokens" in msgs["slice"], msgs["slice"]
        # DTensor would read the prefix as its own chunking: refused, not wrong values
        assert msgs["sort"].startswith("an implicit redistribution for aten.sort"), msgs
        assert "1 prefix (class / register) tokens" in msgs["sort"], msgs["sort"]
        assert msgs["full_tensor"].startswith("DTensor.full_tensor() of a tensor"), msgs
        assert "x[:, 1:] gives the pixel tokens" in msgs["full_tensor"], msgs["full_tensor"]
        # a reduction or scan over the tokens behind the prefix (one rank holds it)
        for name in ("mean", "cumsum"):
            assert msgs[name].startswith(f"Tensor.{name} over dims (1,) of tokens"), msgs[name]
            assert "behind prefix (class / register) tokens" in msgs[name], msgs[name]


def test_element_wise_math_keeps_the_prefix(dist_pool):
    for diffs in dist_pool.run(2, prefix_math):
        assert all(d < 1e-12 for d in diffs.values()), diffs
