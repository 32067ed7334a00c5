"""segmentation_models_pytorch models in the product (issue 9, item 5): ``smp.<Arch>`` from
the registry, run width-sharded in fp64 and train mode on uneven strips, match one device
(output and every parameter gradient) with no activation-sized gather; transformer
encoders are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from spconv_train.models import create_model
from tests.dist_harness import mesh
from tests.op_check import check_strip_model
from tests.reference import dropout_off, seeded

TOL = 1e-9
CASES = {
    "Unet resnet34": ("smp.Unet", {"encoder_name": "resnet34", "decoder_channels": (16, 8, 4)}),
    "Unet efficientnet-b0": (
        "smp.Unet",
        {"encoder_name": "efficientnet-b0", "decoder_channels": (16, 8, 4)},
    ),
    "Unet timm efficientnet_b0": (
        "smp.Unet",
        {"encoder_name": "tu-efficientnet_b0", "decoder_channels": (16, 8, 4)},
    ),
    "Unet convnext": (
        "smp.Unet",
        {"encoder_name": "tu-convnext_atto", "encoder_depth": 4, "decoder_channels": (8,) * 4},
    ),
    "FPN": ("smp.FPN", {"decoder_pyramid_channels": 32, "decoder_segmentation_channels": 32}),
    "PSPNet": ("smp.PSPNet", {"psp_out_channels": 16}),
    # ASPP rates scaled down to the tiny strips (the defaults need 36 columns per strip)
    "DeepLabV3Plus": (
        "smp.DeepLabV3Plus",
        {"decoder_channels": 16, "decoder_atrous_rates": (1, 2, 3)},
    ),
    "UPerNet": ("smp.UPerNet", {"decoder_channels": 16}),
    "Segformer resnet": ("smp.Segformer", {"decoder_segmentation_channels": 16}),
}
SMALL = {"encoder_name": "resnet18", "encoder_depth": 4}  # overridden per case


def smp_checks(world: int, width: int, names: tuple[str, ...]) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    x = seeded(1, 2, 3, 32, width, dtype=torch.float64)
    for label in names:
        name, kwargs = CASES[label]
        kwargs = {**SMALL, "encoder_depth": 3, **kwargs} if "Unet" in label else {**SMALL, **kwargs}
        torch.manual_seed(0)  # the same weights on every rank
        model = create_model(name, num_classes=3, **kwargs).double().train()
        dropout_off(model)

        def g(shape):
            return seeded(5, *shape, dtype=torch.float64)

        # EfficientNet's drop-connect draws its mask: the same draw (seed)
        failures += check_strip_model(
            model,
            x,
            g,
            dmesh,
            world,
            traffic=None,
            tol=TOL,
            same_placements=True,
            label=f"{label} @{world} w={width}: ",
        )
    return failures


def test_smp_models_match_one_device(dist_pool):
    # uneven strips at every level: 112 = 16 * 7 over 2 ranks; 176 = 16 * 11 over 3
    runs = (
        (2, 112, ("Unet resnet34", "Unet convnext", "PSPNet", "UPerNet")),
        (3, 176, ("Unet efficientnet-b0", "Unet timm efficientnet_b0", "FPN", "DeepLabV3Plus")),
        (3, 176, ("Segformer resnet",)),
    )
    for world, width, names in runs:
        for name in names:  # one call per model: each stays far inside the harness timeout
            for failures in dist_pool.run(world, smp_checks, world, width, (name,)):
                assert not failures, failures


@pytest.mark.parametrize(
    "name, kwargs, reason",
    [
        ("smp.DPT", {"encoder_name": "tu-deit_tiny_patch16_224"}, "gather the whole activation"),
        ("smp.MAnet", {}, "position-attention.*gather the whole activation"),
    ],
)
def test_global_attention_refused_with_reason(name, kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        create_model(name, num_classes=2, **kwargs)


def test_encoder_weights_only_from_a_local_file(tmp_path):
    kw = {"encoder_name": "resnet18", "encoder_depth": 3, "decoder_channels": (8, 8, 8)}
    torch.manual_seed(0)
    donor = create_model("smp.Unet", num_classes=2, **kw)
    path = tmp_path / "encoder.pt"
    torch.save(donor.encoder.state_dict(), path)
    model = create_model("smp.Unet", num_classes=2, encoder_weights=str(path), **kw)
    got, want = model.encoder.state_dict(), donor.encoder.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(FileNotFoundError, match="never download"):
        create_model("smp.Unet", num_classes=2, encoder_weights="imagenet", **kw)


def test_smp_model_and_allow_gather_from_the_config():
    from spconv_train.config import load_config
    from spconv_train.models import build_model

    cfg = load_config(
        None,
        [
            "model.name=smp.Unet",
            "model.kwargs={encoder_name: resnet18, encoder_depth: 3, decoder_channels: [16, 8, 4]}",
            "parallel.allow_gather=true",
        ],
    )
    assert cfg.parallel.allow_gather is True
    model = build_model(cfg)
    assert type(model).__name__ == "Unet"
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, cfg.model.num_classes, 32, 32)
