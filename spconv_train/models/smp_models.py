"""segmentation_models_pytorch (smp) architectures in the registry: ``smp.<Arch>``.

``model.name: smp.Unet`` (or ``smp.FPN``, ``smp.DeepLabV3Plus``, ``smp.UPerNet``, ...) with
``model.kwargs`` passed to ``smp.create_model`` (``encoder_name``, ``encoder_depth``,
``decoder_channels``, ...). Nothing is ever downloaded: the encoder is built with
``encoder_weights=None``; ``model.kwargs.encoder_weights: path/to/encoder.pt`` loads a
local state dict into the encoder (``model.weights`` loads a whole model, as for every
model). smp and timm are an optional dependency (``pip install .[smp]``, which
``make install`` does); the error says so when they are missing.

Mix Transformer encoders (``mit_b0`` .. ``mit_b5``, SegFormer's) run sharded: their
spatial-reduction attention is exact over the split pixel tokens by point-to-point ring
matmuls; Swin encoders (``tu-swin*``) attend inside windows and run sharded
(``docs/attention.md``). timm ViT encoders (``tu-vit_*``, in ``smp.DPT``) run sharded with
their class token and register tokens (``reg_tokens``): the first rank of the spatial
group holds them, and smp DPT's readout broadcasts the class token from it. The other
ViT-style timm encoders (DeiT, EVA, BEiT, MViT) are refused by name, untested.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spconv_train.models.registry import WeightsLoadError, register_family

ARCHITECTURES = (
    "Unet",
    "UnetPlusPlus",
    "FPN",
    "PSPNet",
    "DeepLabV3",
    "DeepLabV3Plus",
    "Linknet",
    "MAnet",
    "PAN",
    "UPerNet",
    "Segformer",
    "DPT",
)
#: SegFormer's Mix Transformer encoders, exact when sharded (``docs/attention.md``).
MIT_ENCODERS = tuple(f"mit_b{i}" for i in range(6))
#: Architectures that smp itself builds on no ``mit_*`` encoder.
NO_MIT_ARCHS = ("UnetPlusPlus", "Linknet", "DPT")
#: timm ViT encoders (smp.DPT): their global attention runs as ring attention, over the
#: class and register tokens too (held by the first rank of the spatial group).
VIT_ENCODERS = "tu-vit_"
#: Encoder name prefixes refused (see the module docstring).
GLOBAL_ATTENTION_ENCODERS = ("tu-deit", "tu-mvit", "tu-eva", "tu-beit")
#: Architectures whose *decoder* attends over all pixels.
GLOBAL_ATTENTION_ARCHS = {"MAnet": "its position-attention block (flatten every pixel, matmul)"}


def _smp():
    try:
        import segmentation_models_pytorch as smp
    except ImportError as exc:  # pragma: no cover - the extra is installed by make install
        raise ImportError(
            "smp models need segmentation_models_pytorch and timm: pip install '.[smp]' "
            "(make install does it)"
        ) from exc
    return smp


def mit_architectures() -> tuple[str, ...]:
    """The registry's smp architectures that take the ``mit_*`` encoders."""
    no = (*NO_MIT_ARCHS, *GLOBAL_ATTENTION_ARCHS)
    return tuple(a for a in ARCHITECTURES if a not in no)


def _check_encoder(arch: str, encoder: str, kwargs: dict) -> None:
    if encoder.startswith("mit_b") and arch in NO_MIT_ARCHS:
        raise ValueError(
            f"model smp.{arch}: smp builds no {arch} on a Mix Transformer encoder "
            f"({encoder!r}). Use it in one of "
            f"{', '.join(f'smp.{a}' for a in mit_architectures())}, or another encoder."
        )
    why = GLOBAL_ATTENTION_ARCHS.get(arch)
    if encoder.startswith(GLOBAL_ATTENTION_ENCODERS):
        why = (
            f"encoder {encoder!r} attends over all pixels with prefix tokens, relative or "
            f"rotary position embeddings or pooled keys, none of which has a sharded form yet"
        )
    if why:
        raise ValueError(
            f"model smp.{arch}: {why}: a width-sharded run would have to gather the whole "
            f"activation on every rank. Use a convolutional encoder (model.kwargs."
            f"encoder_name: resnet34, efficientnet-b0, tu-convnext_atto, ...), mit_b0 .. "
            f"mit_b5, tu-swin_*, tu-vit_* (smp.DPT), or another "
            f"architecture."
        )


def _load_encoder(model: nn.Module, path: str | Path) -> None:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model.kwargs.encoder_weights: {str(path)!r} is not a file. smp models never "
            f"download weights: give a local state-dict file of the encoder (or null)."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        from spconv_train.checkpoint.safe_load import load_error_text  # lazy: pulls in DCP

        # never torch's advice to retry with weights_only off (that runs the file's code)
        raise WeightsLoadError(
            f"could not read encoder weights {str(path)!r}: {load_error_text(exc)}"
        ) from None
    try:
        state = state.get("model", state) if isinstance(state, dict) else state
        model.encoder.load_state_dict(state, strict=True)
    except Exception as exc:
        raise WeightsLoadError(f"could not load encoder weights {str(path)!r}: {exc}") from exc


def _pixel_mlp_class(base: type) -> type:
    """smp Segformer's ``MLP`` (``flatten(2).transpose(1, 2)`` -> ``Linear`` -> back) as the
    same per-pixel ``Linear`` on a channels-last view: identical values and parameters, but
    no flattening of the sharded width into the pixel axis (which a width-sharded run could
    only follow by moving the activation)."""

    class PixelMLP(base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    PixelMLP.__name__ = PixelMLP.__qualname__ = f"Pixel{base.__name__}"
    return PixelMLP


def _channels_last_mlps(model: nn.Module) -> None:
    try:
        from segmentation_models_pytorch.decoders.segformer.decoder import MLP
    except ImportError:  # pragma: no cover - other smp versions
        return
    pixel = _pixel_mlp_class(MLP)
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = pixel


def _builder(arch: str):
    def build(*, num_classes: int, in_channels: int = 3, **kwargs) -> nn.Module:
        encoder = kwargs.pop("encoder_name", "resnet34")
        weights = kwargs.pop("encoder_weights", None)
        _check_encoder(arch, encoder, kwargs)
        if encoder.startswith(VIT_ENCODERS) and not kwargs.get("class_token", True):
            # timm pools a ViT without class token by "avg" only; the segmentation models
            # never use the pooled output
            kwargs.setdefault("global_pool", "avg")
        smp = _smp()
        model = smp.create_model(
            arch,
            encoder_name=encoder,
            encoder_weights=None,  # never download
            in_channels=in_channels,
            classes=num_classes,
            **kwargs,
        )
        _channels_last_mlps(model)
        if weights is not None:
            _load_encoder(model, weights)
        return model

    return build


register_family("smp", ARCHITECTURES, _builder, "smp.create_model")
