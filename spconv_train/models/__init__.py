"""Single-device segmentation models and their registry.

Importing this package registers every built-in model, so ``create_model("unet", ...)``
works right after ``import spconv_train.models``. Parallelism is applied elsewhere
(``spconv_train.parallel``); nothing here imports it.
"""

# Imported for their side effect: each module registers its models on import.
from spconv_train.models import (  # noqa: F401
    monai_models,
    smp_models,
    torchvision_models,
    unet,
    unet3d,
)
from spconv_train.models.build import build_model, check_model_dims
from spconv_train.models.registry import (
    UnknownModelError,
    WeightsLoadError,
    create_model,
    list_models,
    register_model,
)
from spconv_train.models.unet import UNet
from spconv_train.models.unet3d import UNet3D

__all__ = [
    "UNet",
    "UNet3D",
    "UnknownModelError",
    "WeightsLoadError",
    "build_model",
    "check_model_dims",
    "create_model",
    "list_models",
    "register_model",
]
