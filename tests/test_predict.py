"""``spconv-train predict`` (issue 5, item 3): sharded full-resolution inference.

A tiny U-Net is checkpointed (DCP folder and exported ``.pt``) on the gloo worker pool; its
sharded predictions must equal the single-device arg-max pixel for pixel (fp32), the
overlays must exist, and ``metrics.json`` must hold the single-device confusion matrix.
Awkward widths are padded and cropped back (or refused with a clear error), and one real
``spconv-train predict --nproc 2`` goes through torchrun.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from spconv_train.config import load_config
from spconv_train.data import read_image, read_mask
from spconv_train.predict import PredictError, resolve_checkpoint
from spconv_train.predict._inputs import _collect
from spconv_train.train.loop import build_model
from spconv_train.train.metrics import ConfusionMatrix

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.num_classes=3", "model.kwargs={depth: 2, base_width: 4}"]


def _config(run_dir: Path, overrides: list[str] = ()):
    return load_config(None, [*TINY, f"run_dir={run_dir}", *overrides])


def make_run(run_dir: str, overrides: list[str]) -> None:
    """On every pool rank: the same seeded model trained for a few steps on one device (so
    that its predictions are not one class everywhere and its BatchNorm statistics are not
    (0, 1)), saved as a DCP checkpoint (collective) and exported to ``model.pt``."""
    from spconv_train.checkpoint import CheckpointManager
    from spconv_train.config import config_to_dict, dump_config
    from spconv_train.data import SyntheticDataset

    cfg = _config(Path(run_dir), overrides)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    data = SyntheticDataset(4, height=32, width=64, num_classes=3, seed=0)
    x = torch.stack([data[i][0] for i in range(4)])
    y = torch.stack([data[i][1] for i in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(25):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, ignore_index=255).backward()
        optimizer.step()
    if torch.distributed.get_rank() == 0:
        dump_config(cfg, Path(run_dir) / "config.yaml")
    CheckpointManager(run_dir).save(3, model, optimizer)
    CheckpointManager.export(model, Path(run_dir) / "model.pt", config=config_to_dict(cfg))


def predict_in_pool(checkpoint: str, inputs: list[str], out: str, masks: str | None, sets=()):
    """``run_predict`` on the pool ranks; returns ("ok", metrics) or ("error", message)."""
    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._inputs import _class_names
    from spconv_train.predict._run import run_predict

    kind, weights, saved = resolve_checkpoint(checkpoint)
    cfg = _load_config(kind, weights, saved, list(sets), None)
    images = _collect(inputs, masks)
    try:
        return "ok", run_predict(
            cfg, kind, weights, images, out, class_names=_class_names(cfg, masks)
        )
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return "error", f"{type(exc).__name__}: {exc}"


def _single_device(run_dir: Path, overrides: list[str] = ()):
    cfg = _config(run_dir, overrides)
    model = build_model(cfg)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True)["model"])
    return model.eval()


def _predict_one(model, path: Path, pad_to: int | None = None):
    """Single-device logits of the whole image (optionally zero-padded on the right)."""
    image = read_image(path, (0, Image.open(path).size[0]))
    w = image.shape[-1]
    if pad_to:
        image = torch.nn.functional.pad(image, (0, pad_to - w))
    with torch.no_grad():
        return model(image[None])[0, ..., :w]


def _assert_same_argmax(saved: np.ndarray, logits: torch.Tensor, label: str) -> None:
    """Pixel-for-pixel equality; only an exact near-tie (top-2 logits within 1e-5, where fp32
    rounding decides) could excuse a difference, and none is expected."""
    want = logits.argmax(0).numpy()
    top2 = logits.topk(2, dim=0).values
    near_tie = (top2[0] - top2[1]).numpy() < 1e-5
    differ = saved != want
    assert saved.shape == want.shape, label
    assert len(np.unique(want)) > 1 or label == "prime padded", f"{label}: one class only"
    assert not (differ & ~near_tie).any(), f"{label}: {int(differ.sum())} pixels differ"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from spconv_train.data import write_synthetic_dataset

    root = tmp_path_factory.mktemp("predict")
    write_synthetic_dataset(
        root / "data", num_train=1, num_val=3, height=32, width=64, num_classes=3
    )
    # An odd (prime) width: strips of 31 and 30 columns.
    odd = np.random.default_rng(0).integers(0, 255, (32, 61, 3), dtype=np.uint8)
    Image.fromarray(odd).save(root / "data" / "images" / "val" / "odd.png")
    mask = np.random.default_rng(1).integers(0, 3, (32, 61), dtype=np.uint8)
    mask[:4, :7] = 255  # ignored pixels
    Image.fromarray(mask).save(root / "data" / "masks" / "val" / "odd.png")
    return root


def test_predict_equals_single_device(dist_pool, data, tmp_path):
    run_dir = tmp_path / "run"
    dist_pool.run(2, make_run, str(run_dir), [])
    images, masks, out = data / "data/images/val", data / "data/masks/val", tmp_path / "out"
    step = run_dir / "checkpoints" / "step-000003"
    results = dist_pool.run(2, predict_in_pool, str(step), [str(images)], str(out), str(masks))
    status, metrics = results[0]
    assert status == "ok", metrics
    assert results[1] == ("ok", None)  # rank 1 writes nothing
    model = _single_device(run_dir)
    cm = ConfusionMatrix(3, 255)
    stems = sorted(p.stem for p in images.iterdir())
    for stem in stems:
        saved = np.array(Image.open(out / f"{stem}.png"))
        logits = _predict_one(model, images / f"{stem}.png")
        _assert_same_argmax(saved, logits, stem)
        overlay = Image.open(out / f"{stem}_overlay.png")
        assert overlay.mode == "RGB" and overlay.size == (saved.shape[1], saved.shape[0])
        mask = read_mask(masks / f"{stem}.png", (0, saved.shape[1]))
        cm.update(torch.from_numpy(saved).long()[None], mask[None])
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == metrics
    assert on_disk["confusion_matrix"] == cm.local.tolist()
    assert on_disk["images"] == len(stems) == 4
    want = cm.metrics()
    assert on_disk["pixel_accuracy"] == pytest.approx(want["pixel_accuracy"])
    got_iou = [c["iou"] for c in on_disk["classes"]]
    assert got_iou == pytest.approx([None if v != v else v for v in want["iou"]], nan_ok=True)
    assert [c["name"] for c in on_disk["classes"]] == ["background", "ellipse", "long_band"]


def test_awkward_widths_are_padded_or_refused(dist_pool, data, tmp_path):
    """Depth-3 U-Net at 3 ranks: width 17 leaves an empty strip after two poolings; it is
    padded to 96 and cropped back. LR-ASPP at 3 ranks needs ~250 columns: 64 fails even
    padded, with a message naming the image and the way out."""
    run_dir = tmp_path / "deep"
    deep = ["model.kwargs={depth: 3, base_width: 4}"]
    dist_pool.run(3, make_run, str(run_dir), deep)
    prime = data / "prime.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (32, 17, 3), dtype=np.uint8)).save(
        prime
    )
    out = tmp_path / "out"
    status, _ = dist_pool.run(3, predict_in_pool, str(run_dir), [str(prime)], str(out), None)[0]
    assert status == "ok"
    saved = np.array(Image.open(out / "prime.png"))
    assert saved.shape == (32, 17)
    model = _single_device(run_dir, deep)
    _assert_same_argmax(saved, _predict_one(model, prime, pad_to=96), "prime padded")

    narrow = data / "data/images/val/0000.png"
    sets = ["model.name=lraspp_mobilenet_v3_large", "model.kwargs={}"]
    status, message = dist_pool.run(
        3, predict_in_pool, str(run_dir / "checkpoints" / "step-000003"), [str(narrow)],
        str(tmp_path / "lr"), None, sets,
    )[0]  # fmt: skip
    # The U-Net checkpoint does not fit LR-ASPP: the load error names the checkpoint.
    assert status == "error" and "cannot load" in message

    status, message = dist_pool.run(3, narrow_lraspp, str(narrow), str(tmp_path / "lr"))[0]
    assert status == "error", message
    assert "ImagesFailed" in message and "0000.png" in message
    assert "not even padded to 96" in message and "fewer ranks" in message


def narrow_lraspp(image: str, out: str):
    """LR-ASPP (random weights, exported on the fly) on a 64-column image at 3 ranks."""
    from spconv_train.checkpoint import CheckpointManager
    from spconv_train.config import config_to_dict

    cfg = load_config(None, ["model.name=lraspp_mobilenet_v3_large", "model.num_classes=3"])
    torch.manual_seed(0)
    path = Path(out) / "lraspp.pt"
    CheckpointManager.export(build_model(cfg), path, config=config_to_dict(cfg))
    torch.distributed.barrier()
    return predict_in_pool(str(path), [image], out, None)


def test_predict_command_through_torchrun(dist_pool, data, tmp_path, monkeypatch):
    """``predict --nproc 2`` re-launches itself through torchrun (the command runs in this
    process: one interpreter start less; ``python -m spconv_train``: tests/test_cli.py)."""
    from spconv_train.cli import app

    run_dir = tmp_path / "run"
    dist_pool.run(2, make_run, str(run_dir), [])
    out, images = tmp_path / "out", data / "data/images/val"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SPCONV_TIMEOUT_S", "120")
    args = ["predict", str(run_dir / "model.pt"), str(images / "0001.png")]
    args += [str(images / "odd.png"), "--out", str(out), "--nproc", "2"]
    result = CliRunner().invoke(app, args)
    # no capfd: a worker group started in this test would write into capfd's file for good
    # (the workers' and torchrun's output is in pytest's captured output)
    assert result.exit_code == 0, result.output[-3000:]
    model = _single_device(run_dir)
    for stem in ("0001", "odd"):
        logits = _predict_one(model, images / f"{stem}.png")
        _assert_same_argmax(np.array(Image.open(out / f"{stem}.png")), logits, stem)
        assert (out / f"{stem}_overlay.png").is_file()
    assert not (out / "metrics.json").exists()  # no masks given


# --- inputs and errors (no process group) ----------------------------------------------------


def test_resolve_checkpoint_and_inputs(tmp_path, data):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "meta.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    assert resolve_checkpoint(run) == (
        "dcp",
        run / "checkpoints" / "step-000002",
        run / "config.yaml",
    )
    step = run / "checkpoints" / "step-000002"
    assert resolve_checkpoint(step) == ("dcp", step, run / "config.yaml")
    (run / "model.pt").write_bytes(b"x")
    assert resolve_checkpoint(run / "model.pt")[0] == "export"
    with pytest.raises(PredictError, match="not a run folder"):
        resolve_checkpoint(tmp_path)
    images, masks = data / "data/images/val", data / "data/masks/val"
    found = _collect([images], masks)
    assert [s for s, _, _ in found] == ["0000", "0001", "0002", "odd"]
    assert all(m is not None and m.stem == s for s, _, m in found)
    with pytest.raises(PredictError, match="no mask"):
        _collect([images], tmp_path / "run" / "checkpoints" / "step-000002")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "0000.png").write_bytes((images / "0000.png").read_bytes())
    with pytest.raises(PredictError, match="share the stem"):
        _collect([images / "0000.png", tmp_path / "x" / "0000.png"], None)


def test_predict_cli_errors(tmp_path, data):
    from spconv_train.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["predict", "--help"])
    assert result.exit_code == 0
    for word in ("CHECKPOINT", "INPUT", "--out", "--masks", "--nproc", "--set"):
        assert word in result.output
    image = str(data / "data/images/val/0000.png")
    missing = runner.invoke(app, ["predict", str(tmp_path / "nope"), image, "--out", "o"])
    assert missing.exit_code == 2
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    corrupt = runner.invoke(app, ["predict", str(bad), image, "--out", str(tmp_path / "o")])
    assert corrupt.exit_code == 2
