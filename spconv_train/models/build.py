"""The single-device model a run config names: ``build_model(cfg)``.

Shared by ``run``, ``verify`` and ``predict`` (and the benchmark scripts), so that every
command turns ``model.*`` into a model, and a bad name, option or weights file into a
``ConfigError`` naming the config key, the same way.
"""

from __future__ import annotations

from torch import nn

from spconv_train.config import Config, ConfigError
from spconv_train.models.registry import UnknownModelError, WeightsLoadError, create_model


def check_model_dims(cfg: Config, model: nn.Module) -> None:
    """A 3-D model (``spatial_dims = 3``, e.g. ``unet3d``) for volumes, a 2-D one for images;
    otherwise ``ConfigError`` before anything runs. Models without the attribute are 2-D."""
    dims = getattr(model, "spatial_dims", 2)
    if cfg.data.kind == "volume" and dims != 3:
        raise ConfigError(
            "model.name",
            f"{cfg.model.name} is a 2-D model but data.kind is volume; use a 3-D model "
            "such as unet3d",
        )
    if cfg.data.kind == "image" and dims == 3:
        raise ConfigError(
            "data.kind",
            f"is image but {cfg.model.name} is a 3-D model; set data.kind: volume",
        )


def build_model(cfg: Config) -> nn.Module:
    """The single-device model of ``cfg.model``; bad names/options/weights -> ``ConfigError``."""
    m = cfg.model
    try:
        model = create_model(
            m.name,
            num_classes=m.num_classes,
            in_channels=m.in_channels,
            weights=m.weights,
            **dict(m.kwargs),
        )
    except UnknownModelError as exc:
        raise ConfigError("model.name", str(exc)) from exc
    except (FileNotFoundError, WeightsLoadError) as exc:
        raise ConfigError("model.weights", str(exc)) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.kwargs", str(exc)) from exc
    check_model_dims(cfg, model)  # volumes need a 3-D model, images a 2-D one
    return model
