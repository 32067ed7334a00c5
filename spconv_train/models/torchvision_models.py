"""torchvision segmentation models behind the registry's common interface.

Each model is built with ``weights=None, weights_backbone=None`` and ``aux_loss=False``:
nothing is ever downloaded (training machines may have no network). Pretrained weights
come only from a local file via ``create_model(..., weights=path)``.

torchvision's models return ``{"out": logits}``; :class:`TorchvisionSegmentation` unwraps
that so every registry model returns a plain ``N x num_classes x H x W`` tensor.

For ``in_channels != 3`` the backbone's first convolution is replaced by a fresh
``nn.Conv2d`` with the same kernel size, stride, padding, dilation, groups and bias but
``in_channels`` inputs (randomly initialised, like the rest of the model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision.models import segmentation

from spconv_train.models.registry import register_model

__all__ = ["TorchvisionSegmentation", "replace_first_conv"]


class TorchvisionSegmentation(nn.Module):
    """Wrap a torchvision segmentation model so forward returns ``net(x)["out"]``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x C x H x W`` to logits ``N x num_classes x H x W``."""
        return self.net(x)["out"]


def replace_first_conv(module: nn.Module, in_channels: int) -> None:
    """Swap the first ``nn.Conv2d`` in ``module`` (in registration order) for one with
    ``in_channels`` inputs and otherwise identical hyper-parameters.

    Raises:
        ValueError: if ``module`` holds no ``nn.Conv2d``.
    """
    for name, child in module.named_modules():
        if isinstance(child, nn.Conv2d):
            if child.in_channels == in_channels:
                return
            new = nn.Conv2d(
                in_channels,
                child.out_channels,
                kernel_size=child.kernel_size,
                stride=child.stride,
                padding=child.padding,
                dilation=child.dilation,
                groups=child.groups,
                bias=child.bias is not None,
                padding_mode=child.padding_mode,
            )
            module.set_submodule(name, new)
            return
    raise ValueError(f"no nn.Conv2d found in {type(module).__name__}")


def _build(
    factory: Callable[..., nn.Module], num_classes: int, in_channels: int
) -> TorchvisionSegmentation:
    net = factory(weights=None, weights_backbone=None, num_classes=num_classes, aux_loss=False)
    if in_channels != 3:
        # Every torchvision segmentation model keeps its feature extractor in `.backbone`,
        # whose first conv is the stem (resnet `conv1`, mobilenet `features.0.0`).
        replace_first_conv(net.backbone, in_channels)
    return TorchvisionSegmentation(net)


@register_model("fcn_resnet50")
def fcn_resnet50(*, num_classes: int, in_channels: int = 3) -> TorchvisionSegmentation:
    """FCN with a ResNet-50 backbone (random init)."""
    return _build(segmentation.fcn_resnet50, num_classes, in_channels)


@register_model("deeplabv3_resnet50")
def deeplabv3_resnet50(*, num_classes: int, in_channels: int = 3) -> TorchvisionSegmentation:
    """DeepLabV3 with a ResNet-50 backbone (random init)."""
    return _build(segmentation.deeplabv3_resnet50, num_classes, in_channels)


@register_model("deeplabv3_mobilenet_v3_large")
def deeplabv3_mobilenet_v3_large(
    *, num_classes: int, in_channels: int = 3
) -> TorchvisionSegmentation:
    """DeepLabV3 with a MobileNetV3-Large backbone (random init)."""
    return _build(segmentation.deeplabv3_mobilenet_v3_large, num_classes, in_channels)


@register_model("lraspp_mobilenet_v3_large")
def lraspp_mobilenet_v3_large(*, num_classes: int, in_channels: int = 3) -> TorchvisionSegmentation:
    """LR-ASPP with a MobileNetV3-Large backbone (random init)."""
    return _build(segmentation.lraspp_mobilenet_v3_large, num_classes, in_channels)
