"""A timm ViT with its class token (and register tokens) over width-sharded pixel tokens
(issue 23): the prefix tokens are held by the first rank of the spatial group
(``_token_prefix.py``), attended once by the ring, sliced off again for the map and
broadcast for the readout. fp64 output and every parameter gradient (``cls_token``,
``reg_token``, ``pos_embed``, the blocks) equal one device at 2 and 3 ranks with uneven
token counts, with no activation gather; smp DPT on ``tu-vit`` with its class token (the
"cat" readout) at 2 ranks; and what stays refused in tests/test_vit_class_token.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_model_audited
from tests.reference import seeded

timm = pytest.importorskip("timm")


class ViTMap(nn.Module):
    """The last block's pixel tokens as a map plus the class token (the prefix slice and
    its broadcast), every prefix token attended to on the way."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.vit = VisionTransformer(
            img_size=(32, 80), patch_size=16, embed_dim=16, depth=2, num_heads=2,
            num_classes=0, drop_path_rate=0.0, **kwargs,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (feat, prefix), *_ = self.vit.forward_intermediates(
            x, indices=1, norm=True, return_prefix_tokens=True, intermediates_only=True
        )
        return feat + prefix[:, 0].view(*prefix.shape[::2], 1, 1) * prefix[:, -1:].mean()


class MHAPrefix(nn.Module):
    """User-written: 2 learned prefix tokens and a position embedding over them and the
    pixel tokens, ``nn.MultiheadAttention`` (batch first), the map plus the first token."""

    def __init__(self, h: int, w: int, c: int = 8) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, c, 1)
        self.prefix = nn.Parameter(torch.randn(1, 2, c))
        self.pos = nn.Parameter(torch.randn(1, 2 + h * w, c))
        self.mha = nn.MultiheadAttention(c, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        t = self.proj(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.prefix.expand(n, -1, -1), t], 1) + self.pos
        t = t + self.mha(t, t, t, need_weights=False)[0]
        out = t[:, 2:].transpose(1, 2).reshape(n, -1, h, w)
        return out * t[:, 0].view(n, -1, 1, 1)


def _smp_dpt() -> nn.Module:
    from spconv_train.models.registry import create_model

    model = create_model(
        "smp.DPT", num_classes=2, encoder_name="tu-vit_tiny_patch16_224", img_size=(32, 48),
        embed_dim=16, num_heads=2, encoder_depth=2, decoder_intermediate_channels=(8, 8),
        decoder_fusion_channels=8,
    )  # fmt: skip
    for m in model.modules():  # the head's dropout: per-strip masks cannot equal one device's
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _case(label: str, model: nn.Module, h: int, w: int, dmesh, placements=None):
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    # grad_floor: the ViT blocks DPT never reads have no gradient on either side
    return check_model_audited(
        model.double(), x, lambda s: seeded(2, *s, dtype=torch.float64), dmesh,
        list(placements or [Shard(3)]),
        label=f"{label}: ", grad_floor=1e-30,
    )  # fmt: skip


def prefix_failures(dpt: bool) -> list[str]:
    """One device against ``parallelize``: a ViT with a class token (fused attention, 5
    tokens wide: 3 + 2 / 2 + 2 + 1 per rank), with a class and 2 register tokens and
    explicit attention (``no_embed_class``), and smp DPT on a dp x sp mesh when ``dpt``, else
    ``nn.MultiheadAttention`` over 2 learned prefix tokens (14 columns: 5 + 5 + 4)."""
    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)
    failures = _case("cls", ViTMap(), 32, 80, dmesh)
    torch.manual_seed(0)
    reg = ViTMap(reg_tokens=2, no_embed_class=True)
    for m in reg.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    failures += _case("cls+reg", reg, 32, 80, dmesh)
    if not dpt:
        torch.manual_seed(0)
        failures += _case("mha", MHAPrefix(6, 14), 6, 14, dmesh)
    if dpt:
        torch.manual_seed(0)
        # on the training mesh (dp x sp, the batch split over dp as `spconv-train run` does)
        dp_sp = mesh((1, dist.get_world_size()))
        failures += _case("dpt", _smp_dpt(), 32, 48, dp_sp, (Shard(0), Shard(3)))
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_vit_prefix_tokens_match_single_device(dist_pool, world):
    if world == 2:
        pytest.importorskip("segmentation_models_pytorch")
    for rank, failures in enumerate(dist_pool.run(world, prefix_failures, world == 2)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
