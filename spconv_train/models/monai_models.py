"""MONAI networks from a config: ``model.name: monai.UNETR`` / ``monai.SwinUNETR``.

``model.kwargs`` go to the MONAI class (``img_size`` for UNETR's position embedding,
``feature_size``, ``depths``, ``window_size``, ...); ``spatial_dims`` is 2 unless given
(3 for volumes, with ``data.kind: volume``). Built with random weights (``model.weights``
loads a whole model, as for every registry model). Needs the ``monai`` extra
(``pip install '.[monai]'``, which ``make install`` does); MONAI is imported when a model is
built, not when the registry is.
"""

from __future__ import annotations

from torch import nn

from spconv_train.models.registry import register_family

#: the MONAI classes offered, by registry name
NETWORKS = ("UNETR", "SwinUNETR")


def _monai_nets():
    try:
        from monai.networks import nets
    except ImportError as exc:  # pragma: no cover - the extra is installed by make install
        raise ImportError(
            "monai models need MONAI and einops: pip install '.[monai]' (make install does it)"
        ) from exc
    return nets


def _builder(name: str):
    def build(*, num_classes: int, in_channels: int = 3, **kwargs) -> nn.Module:
        dims = int(kwargs.pop("spatial_dims", 2))
        model = getattr(_monai_nets(), name)(
            in_channels=in_channels, out_channels=num_classes, spatial_dims=dims, **kwargs
        )
        model.spatial_dims = dims  # volumes need a 3-D model (models/build.py)
        return model

    return build


register_family("monai", NETWORKS, _builder, "monai.networks.nets.{name}")
