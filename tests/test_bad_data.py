"""Bad data is caught up front or skipped as promised (issue 8, item 8).

- A truncated JPEG or TIFF passes PIL's ``verify``; ``check_decodable`` catches it up front.
- A sample that fails to load during training on ONE rank only (the others read other
  strips of the same image) is skipped by every rank together in skip mode, and stops
  every rank with the same ``DataError`` in error mode: no rank is left waiting in a
  collective.
- Skipped files are named on the console and in ``metrics.jsonl`` and counted in the
  summary; a validation image too narrow for the mesh stops the run before training.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from spconv_train.data import DataError, FolderDataset, write_synthetic_dataset
from spconv_train.data.checks import check_decodable


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def _truncate(path: Path, keep: float = 0.6) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _dataset(root: Path, num_train: int = 4, num_val: int = 1) -> Path:
    """A folder dataset of 32x64 PNGs with 3 classes."""
    write_synthetic_dataset(
        root, num_train=num_train, num_val=num_val, height=32, width=64, num_classes=3
    )
    return root


def _add_truncated_jpeg(root: Path, split: str = "train", stem: str = "bad") -> Path:
    image = root / "images" / split / f"{stem}.jpg"
    Image.fromarray(_pixels(32, 64, 7)).save(image, quality=90)
    mask = np.random.default_rng(8).integers(0, 3, (32, 64), dtype=np.uint8)
    Image.fromarray(mask).save(root / "masks" / split / f"{stem}.png")
    return _truncate(image)


# --- up front --------------------------------------------------------------------------------


def test_check_decodable_finds_truncated_jpeg_tiff_png(tmp_path):
    good = {
        "a.jpg": lambda p: Image.fromarray(_pixels(48, 80, 0)).save(p),
        "b.png": lambda p: Image.fromarray(_pixels(48, 80, 1)).save(p),
        "c.tif": lambda p: tifffile.imwrite(p, _pixels(48, 80, 2)),
        "d.tiff": lambda p: Image.fromarray(_pixels(48, 80, 3)).save(p),
    }
    for name, write in good.items():
        write(tmp_path / name)
        check_decodable(tmp_path / name)  # complete files pass
        bad = tmp_path / f"trunc_{name}"
        bad.write_bytes((tmp_path / name).read_bytes())
        _truncate(bad)
        with pytest.raises(DataError) as info:
            check_decodable(bad)
        assert info.value.path == str(bad) and str(bad) in str(info.value)
        assert "truncated" in str(info.value)
    # Trailing bytes after a JPEG's end marker: decoded fully, and it decodes: passes.
    trailing = tmp_path / "trailing.jpg"
    trailing.write_bytes((tmp_path / "a.jpg").read_bytes() + b"\x00" * 16)
    check_decodable(trailing)


def test_truncated_jpeg_is_caught_by_validate_all(tmp_path):
    root = _dataset(tmp_path / "d", num_train=2)
    bad = _add_truncated_jpeg(root)
    with pytest.raises(DataError, match="bad.jpg: corrupt or truncated image") as info:
        FolderDataset(root, "train", num_classes=3).validate_all()
    assert "1 bad sample(s)" in str(info.value)
    ds = FolderDataset(root, "train", num_classes=3, on_bad_sample="skip")
    skipped = ds.validate_all()
    assert [Path(f) for f, _ in skipped] == [bad] and len(ds) == 2


# --- during training, on one rank only --------------------------------------------------------


def feed_with_rank1_failure(root: str, mode: str, bad_stem: str, n: int):
    """On every pool rank: a ``TrainFeed`` over ``root`` (sp = world) whose loads fail for
    ``bad_stem`` on rank 1 only (e.g. a tile of a TIFF that only rank 1 reads); returns the
    sample names of the first ``n`` batches and what was skipped, or the error."""
    from spconv_train.config import load_config
    from spconv_train.distributed import build_mesh
    from spconv_train.train.data_feed import TrainFeed

    cfg = load_config(
        None,
        [
            "data.source=folder",
            f"data.root={root}",
            f"data.on_bad_sample={mode}",
            "data.height=32",
            "data.width=64",
            "model.num_classes=3",
            "run_dir=/nonexistent",
        ],
    )
    source = FolderDataset(root, "train", num_classes=3, on_bad_sample=mode)
    source.validate_all()
    rank = torch.distributed.get_rank()
    original = source.load
    seen: list[str] = []

    def load(i, cols=None):
        if source.name(i) == bad_stem and rank == 1:
            raise DataError(f"{source.files(i)[0]}: simulated decode error", path=str(
                source.files(i)[0]), reason="simulated decode error")  # fmt: skip
        seen.append(source.name(i))
        return original(i, cols)

    source.load = load
    world = torch.distributed.get_world_size()
    feed = TrainFeed(source, cfg, build_mesh(1, world, "cpu"), torch.device("cpu"))
    batches, skipped = [], []
    try:
        it = iter(feed)
        for _ in range(n):
            batch = next(it)
            batches.append((seen[-1], batch.image.to_local().sum().item()))
            skipped += feed.pop_skipped()
    except DataError as exc:
        return "error", str(exc), batches
    return "ok", skipped, batches, feed.state_dict()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return _dataset(tmp_path_factory.mktemp("bad_data") / "d", num_train=4)


def test_training_decode_error_on_one_rank_skips_on_all(dist_pool, data_root):
    results = dist_pool.run(2, feed_with_rank1_failure, str(data_root), "skip", "0002", 6)
    (s0, skipped0, batches0, state0), (s1, skipped1, batches1, state1) = results
    assert s0 == s1 == "ok"
    bad_file = str(data_root / "images" / "train" / "0002.png")
    assert skipped0 == skipped1 == [(bad_file, "simulated decode error")]  # named once
    names0 = [name for name, _ in batches0]
    assert names0 == [name for name, _ in batches1]  # the same samples on both ranks
    assert "0002" not in names0 and len(names0) == 6  # skipped in both epochs
    assert state0 == state1
    # The batches are those of an uninterrupted feed with 0002's batches left out.
    reference = dist_pool.run(2, feed_with_rank1_failure, str(data_root), "skip", "none", 8)
    want = [b for b in reference[0][2] if b[0] != "0002"][:6]
    assert batches0 == want


def test_training_decode_error_on_one_rank_stops_all_in_error_mode(dist_pool, data_root):
    results = dist_pool.run(2, feed_with_rank1_failure, str(data_root), "error", "0002", 6)
    for status, message, _ in results:
        assert status == "error"
        assert "0002.png: simulated decode error (while loading a training batch)" in message
        assert "data.on_bad_sample: skip" in message
    assert results[0][1] == results[1][1]


# --- validation images too narrow for the mesh ----------------------------------------------


def narrow_val_check(root: str):
    from spconv_train.config import load_config
    from spconv_train.distributed import build_mesh
    from spconv_train.models import build_model
    from spconv_train.parallel import parallelize
    from spconv_train.train.data_feed import MeshCoords
    from spconv_train.train.val_check import check_val_sizes

    sets = ["model.num_classes=3", "model.kwargs={depth: 2, base_width: 4}"]
    cfg = load_config(None, [*sets, "data.height=32", "data.width=64", "run_dir=/nonexistent"])
    source = FolderDataset(root, "val", num_classes=3)
    mesh = build_mesh(1, torch.distributed.get_world_size(), "cpu")
    torch.manual_seed(0)
    model = parallelize(build_model(cfg), mesh).train()
    try:
        check_val_sizes(model, source, cfg, MeshCoords.of(mesh), mesh["sp"], torch.device("cpu"))
    except DataError as exc:
        return "error", str(exc), model.training
    return "ok", None, model.training


def test_narrow_validation_image_is_reported_up_front(dist_pool, tmp_path):
    """Width 4 runs on one device but leaves rank 2 without a column at 3 ranks (strips of
    2, 2 and 0); width 64 (the training crop) is not even probed."""
    root = _dataset(tmp_path / "d", num_train=1, num_val=1)
    Image.fromarray(_pixels(32, 4, 4)).save(root / "images" / "val" / "thin.png")
    Image.fromarray(np.zeros((32, 4), np.uint8)).save(root / "masks" / "val" / "thin.png")
    results = dist_pool.run(3, narrow_val_check, str(root))
    for status, message, training in results:
        assert status == "error" and training  # train mode restored
        assert "thin.png: validation image 32x4 (HxW) cannot run through unet" in message
        assert "parallel.sp=3" in message and "smaller parallel.sp" in message
    (root / "images" / "val" / "thin.png").unlink()
    (root / "masks" / "val" / "thin.png").unlink()
    assert dist_pool.run(3, narrow_val_check, str(root))[0] == ("ok", None, True)


# --- the command line, one process ------------------------------------------------------------

CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4}}}}
data: {{source: folder, root: {root}, height: 32, width: 64, on_bad_sample: {mode}}}
training: {{steps: 3, val_every: 3, log_every: 1}}
checkpoint: {{every: 3}}
logging: {{tensorboard: false, progress: false}}
"""


def _run(tmp_path: Path, root: Path, mode: str, name: str):
    """``spconv-train run`` in this process (one rank)."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    run_dir = tmp_path / name
    config = tmp_path / f"{name}.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir, root=root, mode=mode), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config)], env={"COLUMNS": "200"})
    return result, run_dir


def test_run_names_and_counts_skipped_files_or_stops(tmp_path, monkeypatch):
    """Skip mode: the truncated JPEG (up front) and a PNG that fails to decode in the middle
    of training are named on the console and in metrics.jsonl and counted in the summary.
    Error mode: exit 2 naming the JPEG before anything is trained."""
    import spconv_train.data.folder as folder

    root = _dataset(tmp_path / "d", num_train=3)
    bad = _add_truncated_jpeg(root)
    flaky = root / "images" / "train" / "0001.png"
    original = folder.read_image_raw

    def read_image_raw(path, cols, *args, **kwargs):
        if Path(path) == flaky:  # passes the up-front checks, fails when training reads it
            raise DataError(f"{path}: cannot decode (simulated)", path=str(path),
                            reason="cannot decode (simulated)")  # fmt: skip
        return original(path, cols, *args, **kwargs)

    monkeypatch.setattr(folder, "read_image_raw", read_image_raw)
    result, run_dir = _run(tmp_path, root, "skip", "skip")
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output[-3000:]
    assert f"skipped train sample {bad} (up front): corrupt or truncated image" in out
    at = re.search(rf"skipped train sample {re.escape(str(flaky))} \(at step (\d)\): cannot", out)
    assert at, out  # three steps: a whole epoch and more, so 0001 is met
    assert "skipped samples │ 2 (named above and in metrics.jsonl" in out
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in lines if r["split"] == "skipped"]
    assert [(r["step"], r["file"], r["data_split"]) for r in skipped] == [
        (0, str(bad), "train"),
        (int(at.group(1)), str(flaky), "train"),  # named once
    ]
    assert "truncated" in skipped[0]["reason"]
    assert [r["step"] for r in lines if r["split"] == "train"] == [1, 2, 3]

    result, run_dir = _run(tmp_path, root, "error", "error")
    assert result.exit_code == 2, result.output[-3000:]
    assert f"{bad}: corrupt or truncated image" in " ".join(result.output.split())
    assert not (run_dir / "checkpoints").exists()  # nothing trained
