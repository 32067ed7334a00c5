"""Single-process tests of the model registry, the U-Net and the torchvision wrappers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import spconv_train.models as models_pkg
from spconv_train.models import (
    UNet,
    UnknownModelError,
    WeightsLoadError,
    create_model,
    list_models,
    register_model,
)

# smp.* models have their own grid with small encoders (tests/test_smp_models.py)
# unet3d takes volumes: its own tests (tests/test_unet3d.py); monai.* models (UNETR's size is
# fixed by img_size) are tested small in tests/test_swinunetr.py
BUILTIN_MODELS = [
    n for n in list_models() if not n.startswith(("smp.", "monai.")) and n != "unet3d"
]

NUM_CLASSES = 3
# Small enough to be fast on 2 CPU cores; 64 and 96 are divisible by 2**3 (unet depth 4).
H, W = 64, 96
TORCHVISION_MODELS = [
    "deeplabv3_mobilenet_v3_large",
    "deeplabv3_resnet50",
    "fcn_resnet50",
    "lraspp_mobilenet_v3_large",
]


def _input(n: int = 2, c: int = 3, h: int = H, w: int = W, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=gen)


def _check_forward_backward(model: nn.Module, x: torch.Tensor, num_classes: int) -> None:
    out = model(x)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (x.shape[0], num_classes, x.shape[2], x.shape[3])
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- every registered model


def test_list_models_contains_builtins() -> None:
    names = list_models()
    assert names == sorted(names)
    assert set(TORCHVISION_MODELS) | {"unet"} <= set(names)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_registered_model_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, num_classes=NUM_CLASSES)
    model.train()  # batch 2: DeepLabV3's pooled-branch BatchNorm needs > 1 value per channel
    _check_forward_backward(model, _input(), NUM_CLASSES)


@pytest.mark.parametrize("name", TORCHVISION_MODELS)
def test_torchvision_in_channels(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, num_classes=2, in_channels=1).eval()
    first_conv = next(m for m in model.net.backbone.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    with torch.no_grad():
        out = model(_input(n=1, c=1))
    assert out.shape == (1, 2, H, W)


# ---------------------------------------------------------------------------------- U-Net


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
@pytest.mark.parametrize("up", ["transpose", "bilinear"])
@pytest.mark.parametrize("depth", [2, 3])
def test_unet_variants(norm: str, up: str, depth: int) -> None:
    torch.manual_seed(0)
    model = create_model(
        "unet", num_classes=NUM_CLASSES, depth=depth, base_width=8, norm=norm, up=up
    )
    _check_forward_backward(model, _input(h=32, w=48), NUM_CLASSES)
    # A conv followed by a norm carries no bias; without a norm it does.
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert all((c.bias is None) == (norm != "none") for c in convs)


@pytest.mark.parametrize("in_channels", [1, 4])
def test_unet_in_channels(in_channels: int) -> None:
    torch.manual_seed(0)
    model = create_model("unet", num_classes=5, in_channels=in_channels, depth=3, base_width=8)
    _check_forward_backward(model, _input(c=in_channels, h=32, w=48), 5)


@pytest.mark.parametrize("up", ["transpose", "bilinear"])
def test_unet_odd_input_size(up: str) -> None:
    # Sizes not divisible by 2**(depth-1): the decoder resizes to each skip's size.
    torch.manual_seed(0)
    model = UNet(in_channels=3, num_classes=2, depth=3, base_width=8, up=up).eval()
    with torch.no_grad():
        out = model(_input(n=1, h=37, w=51))
    assert out.shape == (1, 2, 37, 51)


def test_unet_depth_one_and_structure() -> None:
    model = UNet(in_channels=3, num_classes=2, depth=1, base_width=8)
    assert len(model.downs) == 0 and len(model.ups) == 0
    model = UNet(in_channels=3, num_classes=2, depth=4, base_width=8)
    assert [d[1][0].out_channels for d in model.downs] == [16, 32, 64]
    assert [u.conv[0].out_channels for u in model.ups] == [32, 16, 8]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"norm": "layer"}, "norm must be one of"),
        ({"up": "nearest"}, "up must be one of"),
        ({"depth": 0}, "depth must be >= 1"),
        ({"norm": "group", "base_width": 12, "group_norm_groups": 8}, "divisible"),
    ],
)
def test_unet_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_model("unet", num_classes=2, **kwargs)


# -------------------------------------------------------------------------------- weights


def _unet(**kwargs) -> nn.Module:
    return create_model("unet", num_classes=NUM_CLASSES, depth=2, base_width=8, **kwargs)


@pytest.mark.parametrize("wrap", [False, True])
def test_weights_round_trip(tmp_path: Path, wrap: bool) -> None:
    torch.manual_seed(0)
    src = _unet().eval()
    path = tmp_path / "unet.pt"
    state = src.state_dict()
    torch.save({"model": state, "step": 7} if wrap else state, path)

    torch.manual_seed(1)  # a different init, so equality must come from the file
    dst = create_model(
        "unet", num_classes=NUM_CLASSES, depth=2, base_width=8, weights=str(path)
    ).eval()
    x = _input(n=1, h=32, w=48)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_weights_round_trip_torchvision(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = create_model("lraspp_mobilenet_v3_large", num_classes=2).eval()
    path = tmp_path / "lraspp.pth"
    torch.save(src.state_dict(), path)
    torch.manual_seed(1)
    dst = create_model("lraspp_mobilenet_v3_large", num_classes=2, weights=path).eval()
    x = _input(n=1)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_weights_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        _unet(weights=path)


def test_weights_mismatched_keys(tmp_path: Path) -> None:
    state = _unet().state_dict()
    state["extra.weight"] = torch.zeros(1)
    dropped = sorted(state)[:7]
    for key in dropped:
        del state[key]
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(WeightsLoadError) as info:
        _unet(weights=path)
    msg = str(info.value)
    assert "bad.pt" in msg
    assert "missing keys (7)" in msg and "(+2 more)" in msg
    assert dropped[0] in msg and dropped[5] not in msg  # at most 5 keys shown
    assert "unexpected keys (1): extra.weight" in msg


def test_weights_shape_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "other_classes.pt"
    torch.save(create_model("unet", num_classes=7, depth=2, base_width=8).state_dict(), path)
    with pytest.raises(WeightsLoadError, match="other_classes.pt"):
        _unet(weights=path)


# --------------------------------------------------------------------------------- errors


def test_unknown_model_did_you_mean() -> None:
    with pytest.raises(UnknownModelError) as info:
        create_model("unte", num_classes=2)
    assert isinstance(info.value, KeyError)
    msg = str(info.value)
    assert "did you mean 'unet'" in msg
    for name in list_models():
        assert name in msg


def test_unknown_model_without_close_match() -> None:
    with pytest.raises(KeyError, match="Available models"):
        create_model("zzzzzzzz", num_classes=2)


def test_bad_kwarg() -> None:
    with pytest.raises(TypeError, match=r"'unet'.*'widht'.*accepted options: .*base_width"):
        create_model("unet", num_classes=2, widht=16)
    with pytest.raises(TypeError, match="fcn_resnet50.*accepted options: \\(none\\)"):
        create_model("fcn_resnet50", num_classes=2, depth=3)


def test_register_duplicate_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_model("unet")(UNet)


def test_models_do_not_import_parallel() -> None:
    # The design keeps model code single-device: no module here may import the parallel layer.
    package_dir = Path(models_pkg.__file__).parent
    for source in package_dir.glob("*.py"):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("spconv_train.parallel") for n in names), source
