"""A timm ViT with a class token (smp ``DPT`` on ``tu-vit_*`` built by smp itself): the
class token is concatenated to the width-sharded pixel tokens, which has no sharded layout.
Refused with ``SpatialShardingError`` naming the op and the module, not DTensor's own
"got mixed torch.Tensor and DTensor"; the registry refuses it before building, naming the
fix (``class_token: false``, tested in tests/test_smp_models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.reference import seeded

pytest.importorskip("timm")
smp = pytest.importorskip("segmentation_models_pytorch")


def class_token_refusal() -> str:
    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = smp.DPT(
        "tu-vit_tiny_patch16_224", encoder_weights=None, classes=2, encoder_depth=2,
        img_size=(32, 48), embed_dim=16, num_heads=2, decoder_intermediate_channels=(8, 8),
        decoder_fusion_channels=8,
    )  # fmt: skip
    x = distribute_tensor(seeded(1, 1, 3, 32, 48), dmesh, [Shard(3)])
    try:
        parallelize(model, dmesh)(x)
    except SpatialShardingError as exc:
        return str(exc)
    return "not refused"


def test_vit_class_token_refused_with_module_path(dist_pool):
    for msg in dist_pool.run(2, class_token_refusal):
        assert msg.startswith("torch.cat in module 'encoder'"), msg
