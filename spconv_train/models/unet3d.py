"""``unet3d``: the U-Net of ``unet.py`` for volumes (NCDHW), registered as ``"unet3d"``.

The same topology and options (``depth``, ``base_width``, ``norm``, ``up``,
``group_norm_groups``) with 3x3x3 convolutions, ``MaxPool3d(2)``, ``ConvTranspose3d(2, 2)``
(``up="bilinear"``: trilinear up-sampling) and ``BatchNorm3d``. Inputs whose D, H and W
are divisible by ``2 ** (depth - 1)`` need no resizing.
"""

from __future__ import annotations

from spconv_train.models.registry import register_model
from spconv_train.models.unet import UNet

__all__ = ["UNet3D"]


@register_model("unet3d")
class UNet3D(UNet):
    """U-Net for volumes: logits ``N x num_classes x D x H x W`` (arguments as ``UNet``)."""

    spatial_dims = 3
