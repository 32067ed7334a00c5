"""A configurable U-Net (Ronneberger et al., 2015) as plain single-device PyTorch.

Layout for ``depth=4``, ``base_width=32`` (channel widths per level)::

    in -> DoubleConv(32) -------------------------------------------> Up -> head -> logits
            Down(64) ------------------------------------> Up(32)
              Down(128) -------------------> Up(64)
                Down(256)  (bottleneck) -> Up(128)

``depth`` counts the levels including the bottleneck, so there are ``depth - 1`` poolings.
Inputs whose height and width are divisible by ``2 ** (depth - 1)`` need no resizing. For
other sizes each decoder step resizes the up-sampled map to its skip's size with bilinear
``F.interpolate`` before concatenating (same rule for both up-sampling modes).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from spconv_train.models.registry import register_model

__all__ = ["DoubleConv", "Down", "Up", "UNet"]

Norm = Literal["batch", "group", "none"]
UpMode = Literal["transpose", "bilinear"]

_NORMS = ("batch", "group", "none")
_UP_MODES = ("transpose", "bilinear")

#: Layers per number of spatial dims: 2 (images, NCHW) or 3 (volumes, NCDHW, ``unet3d``).
_LAYERS = {
    2: dict(conv=nn.Conv2d, bn=nn.BatchNorm2d, pool=nn.MaxPool2d, up=nn.ConvTranspose2d),
    3: dict(conv=nn.Conv3d, bn=nn.BatchNorm3d, pool=nn.MaxPool3d, up=nn.ConvTranspose3d),
}
#: The interpolation mode "bilinear" means for each number of spatial dims.
_LINEAR = {2: "bilinear", 3: "trilinear"}


def _make_norm(norm: Norm, channels: int, groups: int, dims: int = 2) -> nn.Module:
    if norm == "batch":
        return _LAYERS[dims]["bn"](channels)
    if norm == "group":
        if channels % groups:
            raise ValueError(
                f"group norm needs channels divisible by group_norm_groups; got {channels} "
                f"channels and {groups} groups (change base_width or group_norm_groups)"
            )
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


class DoubleConv(nn.Sequential):
    """Two ``3x3 conv -> norm -> ReLU`` blocks; keeps the spatial size (padding=1).
    ``dims=3``: the same with 3x3x3 convolutions on volumes."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: Norm = "batch",
        groups: int = 8,
        dims: int = 2,
    ) -> None:
        # A conv directly followed by a norm does not need a bias: the norm re-centres it.
        bias = norm == "none"
        conv = _LAYERS[dims]["conv"]
        super().__init__(
            conv(in_channels, out_channels, kernel_size=3, padding=1, bias=bias),
            _make_norm(norm, out_channels, groups, dims),
            nn.ReLU(inplace=True),
            conv(out_channels, out_channels, kernel_size=3, padding=1, bias=bias),
            _make_norm(norm, out_channels, groups, dims),
            nn.ReLU(inplace=True),
        )


class Down(nn.Sequential):
    """Halve the spatial size with ``MaxPool2d(2)`` (``MaxPool3d``), then :class:`DoubleConv`."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: Norm = "batch",
        groups: int = 8,
        dims: int = 2,
    ) -> None:
        super().__init__(
            _LAYERS[dims]["pool"](2),
            DoubleConv(in_channels, out_channels, norm, groups, dims),
        )


class Up(nn.Module):
    """Double the spatial size, concatenate the encoder skip, then :class:`DoubleConv`.

    The up-sampling maps ``in_channels`` to ``out_channels`` (the skip's width), so the
    concatenation has ``2 * out_channels`` channels.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: Norm = "batch",
        up: UpMode = "transpose",
        groups: int = 8,
        dims: int = 2,
    ) -> None:
        super().__init__()
        layers, self.mode = _LAYERS[dims], _LINEAR[dims]
        if up == "transpose":
            self.up: nn.Module = layers["up"](in_channels, out_channels, kernel_size=2, stride=2)
        else:
            # Parameter-free resize, then a 1x1 conv to reduce the channels.
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode=self.mode, align_corners=False),
                layers["conv"](in_channels, out_channels, kernel_size=1),
            )
        self.conv = DoubleConv(2 * out_channels, out_channels, norm, groups, dims)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        if x.shape[2:] != skip.shape[2:]:
            # Only for sizes not divisible by 2 ** (depth - 1): pooling floored an odd size.
            x = F.interpolate(x, size=skip.shape[2:], mode=self.mode, align_corners=False)
        return self.conv(torch.cat([skip, x], dim=1))


@register_model("unet")
class UNet(nn.Module):
    """U-Net for semantic segmentation returning logits ``N x num_classes x H x W``.

    Args:
        in_channels: input image channels.
        num_classes: output channels (one logit per class).
        depth: number of levels including the bottleneck (``depth - 1`` poolings), >= 1.
        base_width: channels of the first level; level ``i`` has ``base_width * 2**i``.
        norm: ``"batch"`` (BatchNorm2d), ``"group"`` (GroupNorm) or ``"none"``.
        up: ``"transpose"`` (ConvTranspose2d k=2 s=2) or ``"bilinear"`` (Upsample + 1x1 conv).
        group_norm_groups: groups for ``norm="group"``; must divide ``base_width``.
    """

    #: 2: images (NCHW); 3: volumes (NCDHW), see ``unet3d.UNet3D``.
    spatial_dims: int = 2

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        depth: int = 4,
        base_width: int = 32,
        norm: Norm = "batch",
        up: UpMode = "transpose",
        group_norm_groups: int = 8,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if norm not in _NORMS:
            raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
        if up not in _UP_MODES:
            raise ValueError(f"up must be one of {_UP_MODES}, got {up!r}")

        widths = [base_width * 2**i for i in range(depth)]
        g, dims = group_norm_groups, self.spatial_dims
        self.inc = DoubleConv(in_channels, widths[0], norm, g, dims)
        self.downs = nn.ModuleList(
            Down(c_in, c_out, norm, g, dims)
            for c_in, c_out in zip(widths[:-1], widths[1:], strict=True)
        )
        # Decoder runs from the bottleneck back up, so pair the widths in reverse.
        self.ups = nn.ModuleList(
            Up(c_in, c_out, norm, up, g, dims)
            for c_in, c_out in zip(widths[:0:-1], widths[-2::-1], strict=True)
        )
        self.head = _LAYERS[dims]["conv"](widths[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``N x in_channels x H x W`` to logits ``N x num_classes x H x W``."""
        x = self.inc(x)
        skips = []
        for down in self.downs:
            skips.append(x)
            x = down(x)
        for up, skip in zip(self.ups, reversed(skips), strict=True):
            x = up(x, skip)
        return self.head(x)
