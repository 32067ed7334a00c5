"""Library Swin models over a sharded map (issue 23 item 3): a small timm
``SwinTransformer`` (shifted windows, relative position bias, padding to whole windows,
patch merging of odd sizes) and smp ``Unet`` on a timm Swin encoder (``tu-`` name, built by
the model registry as a config builds it; the window of the last stage covers the whole
map) equal to one device in fp64 at 2 and 3 ranks with no activation gather (on H x W
tiles and rows: ``tests/test_swin_tiles.py``). Also smp ``DPT`` on a timm ViT without class
token (global attention on the ring), built by the registry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import parallelize
from spconv_train.parallel._step_meters import CommAudit
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.reference import rel_err, seeded

pytest.importorskip("timm")
TOL = 1e-12


def _timm_swin(h: int, w: int):
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        img_size=(h, w), patch_size=2, embed_dim=8, depths=(2, 2), num_heads=(1, 2),
        window_size=4, num_classes=0, global_pool="", drop_path_rate=0.0,
    )  # fmt: skip


def _smp_swin_unet(h: int, w: int):
    from spconv_train.models.registry import create_model

    # the registry builds it as `model: {name: smp.Unet, kwargs: ...}` in a config does
    return create_model(
        "smp.Unet", num_classes=2, encoder_name="tu-swin_tiny_patch4_window7_224",
        decoder_channels=(16, 16, 8, 8, 8), embed_dim=8, depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1), window_size=4, img_size=(h, w), drop_path_rate=0.0,
    )  # fmt: skip


def _timm_swin_fused(h: int, w: int):
    model = _timm_swin(h, w)
    for m in model.modules():  # timm's experimental F.scaled_dot_product_attention path
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    return model


def _smp_vit_dpt(h: int, w: int):
    from spconv_train.models.registry import create_model

    # a timm ViT (global attention: the ring) without class token in smp's DPT
    model = create_model(
        "smp.DPT", num_classes=2, encoder_name="tu-vit_tiny_patch16_224", class_token=False,
        img_size=(h, w), embed_dim=16, num_heads=2, encoder_depth=2,
        decoder_intermediate_channels=(8, 8), decoder_fusion_channels=8,
    )  # fmt: skip
    for m in model.modules():  # the head's dropout: per-strip masks cannot equal one device's
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


BUILDERS = {
    "timm": _timm_swin, "timm_fused": _timm_swin_fused, "smp": _smp_swin_unet,
    "smp_vit": _smp_vit_dpt,
}  # fmt: skip


def model_failures(kind: str, h: int, w: int, grid: tuple[int, int] | None = None) -> list[str]:
    """One device against ``parallelize`` at this world size (on W strips, or on the
    ``grid`` of H x W tiles): output, every parameter gradient, the no-gather audit (the
    relative position bias gradients are summed)."""
    dmesh, placements = (
        mesh_and_placements(grid, ("sp_h", "sp_w"))
        if grid
        else (mesh(dist.get_world_size()), [Shard(3)])
    )
    torch.manual_seed(0)
    model = BUILDERS[kind](h, w).double()
    par = parallelize(copy.deepcopy(model), dmesh)
    x = seeded(1, 2, 3, h, w, dtype=torch.float64)
    ref = model(x)
    gy = seeded(2, *ref.shape, dtype=torch.float64)
    ref.backward(gy)
    xs = distribute_tensor(x, dmesh, placements)
    with CommAudit() as audit:
        y = par(xs)
    gys = distribute_tensor(gy, dmesh, y.placements)
    with audit:
        y.backward(gys)
    failures = []
    if (e := rel_err(y, ref)) > TOL:
        failures.append(f"output: {e:.3g}")
    got = dict(par.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None or got[name].grad is None:  # unused (ViT blocks DPT never reads)
            failures += [f"grad {name}: on one side only"] if p.grad is not got[name].grad else []
            continue
        if (e := rel_err(got[name].grad, p.grad)) > TOL:
            failures.append(f"grad {name}: {e:.3g}")
    shapes = {tuple(p.shape) for p in model.parameters()}
    for m in model.modules():  # the bias gradient: (1, heads, N, N), any image size
        if hasattr(m, "relative_position_index"):
            n = m.relative_position_index.shape[0]
            shapes.add((1, m.relative_position_bias_table.shape[1], n, n))
    moved = audit.activation_sized(max(1, xs.to_local()[0].numel() // 4), shapes)
    if kind != "timm_fused":  # it sums the gradient of a (windows, heads, N, N) mask
        failures += [f"gathered activation: {r.op} {r.shape}" for r in moved]
    return failures


# timm, 16 x 24: 8 x 12 tokens, 3 windows of 4 along W (strips 6 + 6 at 2 ranks, 4 + 4 + 4
# at 3); merged to 4 x 6, padded to 2 windows. smp, 64 x 96: stages 16 x 24, 8 x 12
# (3 windows: strips 6 + 6, windows 8 + 4), 4 x 6 and 2 x 3 (one window over all ranks);
# 32 x 128 at 3 ranks: every stage uneven, 32 (11 + 11 + 10), 16 (6 + 5 + 5), 8 (3 + 3 + 2),
# 4 (2 + 1 + 1): the last stage 1 x 4, its window clipped to one row, (B, 1, 1, 1, 4, C),
# is no single-window cut of W (the W dim stays split).
# smp_vit: DPT on a ViT of 16 x 16 patches, 2 x 3 tokens split 2 + 1.
CASES = [
    ("timm", 16, 24, 2), ("timm_fused", 16, 24, 2), ("timm", 20, 26, 3), ("smp", 64, 96, 2),
    ("smp", 32, 128, 3), ("smp_vit", 32, 48, 2),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "h", "w", "world"), CASES)
def test_swin_model_matches_single_device(dist_pool, kind, h, w, world):
    pytest.importorskip("segmentation_models_pytorch") if kind.startswith("smp") else None
    for rank, failures in enumerate(dist_pool.run(world, model_failures, kind, h, w)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
