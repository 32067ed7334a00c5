"""What a timm ViT's prefix (class / register) tokens over sharded pixels still refuses
(``_token_prefix.py``), with ``SpatialShardingError`` naming the op and the module instead
of a DTensor error: prefix tokens in front of tokens split over H x W tiles, and a slice
of the token dim that mixes the prefix (on the first rank) with the pixel tokens. What
runs is tested in tests/test_vit_prefix_tokens.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
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


def _refusal(model: nn.Module, dmesh, placements) -> str:
    x = distribute_tensor(seeded(1, 1, 3, 32, 80, dtype=torch.float64), dmesh, placements)
    try:
        parallelize(model.double(), dmesh)(x)
    except SpatialShardingError as exc:
        return str(exc)
    return "not refused"


def prefix_refusals() -> dict[str, str]:
    from tests.test_vit_prefix_tokens import ViTMap

    torch.manual_seed(0)
    out = {"slice": _refusal(MixedSlice(), mesh(2), [Shard(3)])}
    for shape in ((2, 1), (1, 2)):
        out[str(shape)] = _refusal(ViTMap(), *mesh_and_placements(shape, ("sp_h", "sp_w")))
    return out


def test_vit_prefix_refusals_name_op_and_module(dist_pool):
    for msgs in dist_pool.run(2, prefix_refusals):
        assert msgs["slice"].startswith("indexing (x[...]) in module '<model>'"), msgs["slice"]
        assert "mixes its 1 prefix tokens" in msgs["slice"], msgs["slice"]
        for shape in ("(2, 1)", "(1, 2)"):
            assert msgs[shape].startswith("torch.cat in module '<model>'"), (shape, msgs[shape])
            assert "H x W tiles" in msgs[shape], (shape, msgs[shape])
