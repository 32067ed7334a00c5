"""Every Mix Transformer encoder ``mit_b0`` .. ``mit_b5`` is accepted by the model registry
and from YAML in every smp architecture that takes them, and refused by name in the others
(issue 23 item 4). The models are built on the meta device: every constructor runs, no
weights are allocated or initialised (mit_b5 models hold ~85 M parameters)."""

from __future__ import annotations

import pytest
import torch

from spconv_train.config import ConfigError, load_config
from spconv_train.models import build_model, create_model
from spconv_train.models.smp_models import ARCHITECTURES, MIT_ENCODERS, mit_architectures

pytest.importorskip("segmentation_models_pytorch")


@pytest.fixture
def on_meta(monkeypatch):
    """Build on the meta device. MiT reads its stochastic-depth rates with ``.item()`` off
    a ``torch.linspace``, which a meta tensor cannot answer: that one stays on the CPU; its
    ``trunc_normal_`` init (slow on meta, and meaningless there) is skipped."""
    from segmentation_models_pytorch.encoders import mix_transformer

    linspace = torch.linspace
    monkeypatch.setattr(torch, "linspace", lambda *a, **k: linspace(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(mix_transformer, "trunc_normal_", lambda t, **k: t)
    with torch.device("meta"):
        yield


def built_encoders(archs, encoders) -> dict[tuple[str, str], tuple[int, tuple[int, ...]]]:
    """Each ``smp.<arch>`` built through the registry on each encoder: its encoder's
    parameter count and output channels."""
    built = {}
    for arch in archs:
        for encoder in encoders:
            enc = create_model(f"smp.{arch}", num_classes=2, encoder_name=encoder).encoder
            built[arch, encoder] = sum(p.numel() for p in enc.parameters()), tuple(enc.out_channels)
    return built


def test_every_mit_encoder_in_every_architecture_that_takes_it(on_meta):
    assert set(mit_architectures()) == {
        "Unet", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "PAN", "UPerNet", "Segformer",
    }  # fmt: skip
    # a decoder sees only its encoder's channels, and mit_b1 .. mit_b5 share theirs (they
    # differ in depth and MLP width): every architecture on b0 and b1, every encoder in one
    # architecture (the whole grid: scripts/check_foreign_models.py --transformers)
    built_encoders(mit_architectures(), MIT_ENCODERS[:2])
    built = built_encoders(["Segformer"], MIT_ENCODERS)
    millions = [round(built["Segformer", e][0] / 1e6, 1) for e in MIT_ENCODERS]
    assert millions == [3.3, 13.2, 24.2, 44.1, 60.8, 81.4], millions
    assert len({built["Segformer", e][1] for e in MIT_ENCODERS[1:]}) == 1


def test_mit_encoders_refused_by_name_elsewhere(on_meta):
    for arch in sorted(set(ARCHITECTURES) - set(mit_architectures())):
        with pytest.raises(ValueError, match=rf"model smp\.{arch}: ") as err:
            create_model(f"smp.{arch}", num_classes=2, encoder_name="mit_b1")
        # where the encoder works instead, or why the architecture is refused sharded
        assert "smp.Segformer" in str(err.value) or "gather" in str(err.value), err.value


YAML = """\
model:
  name: {name}
  num_classes: 3
  kwargs: {{encoder_name: {encoder}}}
data: {{height: 64, width: 96}}
"""


def test_mit_encoder_from_yaml(tmp_path, on_meta):
    path = tmp_path / "mit.yaml"
    path.write_text(YAML.format(name="smp.UPerNet", encoder="mit_b3"))
    model = build_model(load_config(path, []))
    assert type(model).__name__ == "UPerNet"
    assert sum(p.numel() for p in model.encoder.parameters()) == 44_072_128


def test_mit_encoder_in_linknet_is_a_config_error(tmp_path, on_meta):
    path = tmp_path / "mit.yaml"
    path.write_text(YAML.format(name="smp.Linknet", encoder="mit_b2"))
    with pytest.raises(ConfigError, match=r"model\.kwargs.*smp builds no Linknet.*smp\.Unet"):
        build_model(load_config(path, []))
