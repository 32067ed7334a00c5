"""``spconv-train predict`` under bad input (issue 8, item 9).

A file that is not a spconv-train checkpoint is named without torch's ``weights_only=False``
advice; an image too small for the model fails with the same clear message at 1 and at 2
ranks, the other images are still written, and the exit code says that something failed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from spconv_train.config import config_to_dict, load_config
from spconv_train.data._readers import read_image
from spconv_train.models import build_model

TINY = ["model.num_classes=3", "model.kwargs={depth: 3, base_width: 4}"]


def _export(path: Path) -> torch.nn.Module:
    """A seeded random tiny U-Net exported as ``model.pt`` (no process group needed)."""
    from spconv_train.checkpoint import CheckpointManager

    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(cfg)
    CheckpointManager.export(model, path, config=config_to_dict(cfg))
    return model.eval()


def _image(path: Path, h: int, w: int, seed: int) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``a_flat`` (3 rows: too small for two 2x2 poolings even padded), ``b_narrow`` (3
    columns: padded) and ``c_ok``; the model is exported next to them."""
    root = tmp_path_factory.mktemp("predict_errors")
    images = root / "images"
    images.mkdir()
    _image(images / "a_flat.png", 3, 40, 1)
    _image(images / "b_narrow.png", 32, 3, 2)
    _image(images / "c_ok.png", 32, 64, 3)
    _export(root / "model.pt")
    return root


def _padded_single_device(model_path: Path, image: Path, pad_to: int) -> np.ndarray:
    cfg = load_config(None, TINY)
    model = build_model(cfg).eval()
    model.load_state_dict(torch.load(model_path, weights_only=True)["model"])
    x = read_image(image, (0, Image.open(image).size[0]))
    w = x.shape[-1]
    with torch.no_grad():
        logits = model(torch.nn.functional.pad(x, (0, pad_to - w))[None])[0, ..., :w]
    return logits.argmax(0).numpy()


@pytest.mark.parametrize(
    "content",
    [
        np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8).tobytes(),
        b"\x80\x02random",  # a pickle header followed by garbage
        b"",
    ],
    ids=["random", "pickle-header", "empty"],
)
def test_random_bytes_checkpoint_is_named_without_torch_advice(tmp_path, inputs, content):
    from spconv_train.cli import app

    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    image = str(inputs / "images" / "c_ok.png")
    result = CliRunner().invoke(app, ["predict", str(bad), image, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{bad}: not a spconv-train checkpoint" in text
    assert "weights_only" not in text and "arbitrary code" not in text
    assert "Traceback" not in result.output


def test_torch_file_without_model_is_named(tmp_path, inputs):
    from spconv_train.cli import app

    other = tmp_path / "other.pt"
    torch.save({"state": torch.arange(3)}, other)
    image = str(inputs / "images" / "c_ok.png")
    result = CliRunner().invoke(app, ["predict", str(other), image, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "not a spconv-train checkpoint (no 'model' state dict" in " ".join(result.output.split())


def test_one_rank_narrow_image_is_padded_and_the_rest_continue(tmp_path, inputs):
    """``predict --nproc 1``: the 3-column image is padded like at 2 ranks (no raw max_pool2d
    traceback), the 3-row image fails with the clear message, ``c_ok`` is still written
    after it, and the exit code is 2 with a summary."""
    from spconv_train.cli import app

    out = tmp_path / "out"
    args = ["predict", str(inputs / "model.pt"), str(inputs / "images"), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--nproc", "1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "1 of 3 image(s) failed (the others were written)" in text
    assert "a_flat.png: image 3x40 (HxW) cannot be run by this model over sp=1" in text
    assert "not even padded to 64 columns" in text
    assert sorted(p.name for p in out.iterdir()) == [
        "b_narrow.png",
        "b_narrow_overlay.png",
        "c_ok.png",
        "c_ok_overlay.png",
        "predict.json",
    ]
    assert "b_narrow: width 3 padded to 32" in text
    want = _padded_single_device(inputs / "model.pt", inputs / "images" / "b_narrow.png", 32)
    saved = np.array(Image.open(out / "b_narrow.png"))
    assert saved.shape == (32, 3) and (saved == want).all()


def predict_all(model: str, images: str, out: str):
    """``run_predict`` on the pool ranks: ("ok", None) or (exception type, failed, message)."""
    from spconv_train.predict import ImagesFailed, resolve_checkpoint
    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._inputs import _collect
    from spconv_train.predict._run import run_predict

    kind, weights, saved = resolve_checkpoint(model)
    cfg = _load_config(kind, weights, saved, [], None)
    try:
        run_predict(cfg, kind, weights, _collect([images], None), out)
    except ImagesFailed as exc:
        return type(exc).__name__, sorted(exc.failed), str(exc)
    return "ok", None


def test_two_ranks_failed_image_does_not_stop_the_others(dist_pool, tmp_path, inputs):
    out = tmp_path / "out"
    model, images = str(inputs / "model.pt"), str(inputs / "images")
    results = dist_pool.run(2, predict_all, model, images, str(out))
    assert results[0] == results[1]  # every rank knows what failed
    name, failed, message = results[0]
    assert name == "ImagesFailed" and failed == ["a_flat"]
    assert "image 3x40 (HxW) cannot be run by this model over sp=2" in message
    assert "fewer ranks" in message
    assert sorted(p.name for p in out.iterdir() if not p.stem.endswith("_overlay")) == [
        "b_narrow.png",
        "c_ok.png",
        "predict.json",
    ]
    want = _padded_single_device(inputs / "model.pt", inputs / "images" / "b_narrow.png", 64)
    assert (np.array(Image.open(out / "b_narrow.png")) == want).all()
