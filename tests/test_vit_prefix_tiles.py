"""A ViT's prefix (class / register) tokens in front of pixel tokens split over H x W tiles
and rows (issue 23), and token-wise reductions over the channels of prefixed tokens
(``F.normalize``, ``x / x.norm(...)``, ``mean`` / ``var`` / ``amax`` / ``logsumexp`` /
``median`` / ``cumsum`` / ``F.rms_norm`` over dim -1: ``_token_reduce.py``) on strips and
tiles. fp64 output and every parameter gradient equal one device, with no activation
gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited
from tests.reference import seeded
from tests.test_vit_prefix_tokens import ViTMap, _case, _smp_dpt

pytest.importorskip("timm")

NAMES = ("sp_h", "sp_w")


def _channel_ops(t: torch.Tensor) -> torch.Tensor:
    """Token-wise reductions over the channels that DTensor's own backward sizes wrongly
    behind a prefix."""
    t = F.normalize(t, dim=-1) + t / t.norm(dim=-1, keepdim=True)
    t = t - t.mean(-1, keepdim=True) + t.var(-1, keepdim=True) * t.amax(-1, keepdim=True)
    t = t + t.logsumexp(-1, keepdim=True) + torch.max(t, -1).values.unsqueeze(-1)
    t = F.rms_norm(t, (8,)) + t.cumsum(-1) * t.median(-1, keepdim=True).values
    t = t * t.argmax(-1, keepdim=True)
    return torch.erf(t) * t.softmax(-1)  # element-wise math and a softmax keep the prefix


def _channel_case(label: str, dmesh, placements) -> list[str]:
    from tests.test_vit_class_token import PrefixOp

    torch.manual_seed(0)
    x = seeded(1, 2, 3, 5, 7, dtype=torch.float64)  # uneven: 3 + 2 rows, 4 + 3 columns
    return check_model_audited(
        PrefixOp(_channel_ops).double(), x, lambda s: seeded(2, *s, dtype=torch.float64),
        dmesh, list(placements), traffic=None, label=f"{label} channel ops: ",
    )  # fmt: skip


def _vit(reg: int = 0) -> nn.Module:
    """``ViTMap`` at 48 x 80 (3 x 5 patch tokens: 2 + 1 rows, 3 + 2 columns on 2 x 2
    tiles); with ``reg`` register tokens, ``no_embed_class`` and explicit attention."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = ViTMap()
    kwargs = {"reg_tokens": reg, "no_embed_class": True} if reg else {}
    model.vit = VisionTransformer(
        img_size=(48, 80), patch_size=16, embed_dim=16, depth=2, num_heads=2, num_classes=0,
        drop_path_rate=0.0, **kwargs,
    )  # fmt: skip
    for m in model.modules():
        if reg and hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def prefix_tile_failures(shape: tuple[int, ...]) -> list[str]:
    """Every case on the mesh ``shape``: ``(2, 2)`` tiles, ``(2, 1)`` rows; ``(2,)``: W
    strips (the channel ops) and H split over one mesh dim (the tokens in even chunks)."""
    if len(shape) == 1:
        dmesh = mesh(dist.get_world_size())
        failures = _channel_case("strips", dmesh, [Shard(3)])
        return failures + _case("H chunks cls", _vit(), 48, 80, dmesh, [Shard(2)])
    dmesh, placements = mesh_and_placements(shape, NAMES)
    where = f"mesh {shape}"
    failures = _channel_case(where, dmesh, placements)
    failures += _case(f"{where} cls", _vit(), 48, 80, dmesh, placements)
    if shape == (2, 2):  # rows take the same code: the class token alone there
        failures += _case(f"{where} cls+reg", _vit(2), 48, 80, dmesh, placements)
        torch.manual_seed(0)
        failures += _case(f"{where} dpt", _smp_dpt(), 32, 48, dmesh, placements)
    return failures


@pytest.mark.parametrize("world, shape", [(4, (2, 2)), (2, (2, 1)), (2, (2,))])
def test_prefix_tokens_on_tiles_match_one_device(dist_pool, world, shape):
    if world == 4:
        pytest.importorskip("segmentation_models_pytorch")
    for rank, failures in enumerate(dist_pool.run(world, prefix_tile_failures, shape)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:10])
