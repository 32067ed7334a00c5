"""Memory-planned ``predict`` at 2 ranks (issue 24, items 1-2): tiles equal one device,
out of memory is said as such.

A seeded U-Net (stride 4, margin 36) predicts a 148 x 236 image (strips of 118 columns,
no multiple of the stride) under a budget that fits neither the whole image nor
full-width bands of more than a few rows: the plan cuts tiles with context on all four
sides, and the written mask must equal the single-device arg-max; the plan, the checkpoint
and ``predict.json`` are printed / written. A rank whose allocation fails (``MemoryError``
test hook) makes both ranks report out of memory; a rank killed with SIGKILL under
``predict --nproc 2`` makes the command exit 1 with "out of memory", the plan and the flags.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from spconv_train.predict._oom import KILL_ENV, MEMORYERROR_ENV
from tests.test_predict_bands import (
    UNET,
    _assert_argmax,
    _export,
    _image,
    _reference,
    _tiled,
    predict_pool,
)

REPO = Path(__file__).resolve().parents[1]
#: bytes per pixel, fixed bytes, budget: tiles of 32 x 40 kept pixels (see the test)
COST = (1000.0, 0, 6_000_000, "test")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    weights, model = _export(root / "unet.pt", UNET, steps=25)
    image = _image(root / "slide.npy", 148, 236, 4)
    return root, weights, image, _reference(model, image)


def _with_hook(env: dict, weights: str, image: str, out: str, **stream):
    """``run_predict`` with the test hook variables ``env`` set on this rank; (type of
    the error it raised, whether that reads as out of memory, the report)."""
    from rich.console import Console

    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._inputs import _collect
    from spconv_train.predict._oom import is_oom, oom_message
    from spconv_train.predict._run import run_predict
    from spconv_train.predict._streamed import StreamOptions

    cfg = _load_config("export", Path(weights), None, [], None)
    os.environ.update(env)
    try:
        console = Console(file=io.StringIO())
        stream = StreamOptions(**stream)
        run_predict(
            cfg, "export", weights, _collect([image], None), out, console=console, stream=stream
        )
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, is_oom(exc), oom_message(f"{type(exc).__name__}: {exc}")
    finally:
        for key in env:
            os.environ.pop(key, None)
    return "ok", False, ""


def test_tiles_first_plan_equals_one_device(dist_pool, case, tmp_path):
    """2 ranks, strips: the tiles-first plan (5 x 6 tiles of 32 x 40 px, where no
    full-width band fits the budget) writes the single-device arg-max and probabilities;
    predict.json names the checkpoint."""
    from spconv_train.predict._memory_plan import choose_plan

    root, weights, image, logits = case
    plan = choose_plan(148, 236, (1, 2), 4, 36, *COST[:3], extra_bytes_per_pixel=4)
    bands = choose_plan(148, 236, (1, 2), 4, 36, *COST[:3], extra_bytes_per_pixel=4, tiles=False)
    assert plan.layout == "tiles" and plan.band_rows and plan.block_cols and plan.fits
    assert not bands.fits  # no full-width band fits this budget
    out = tmp_path / "tiles"
    status, _, text = dist_pool.run(
        2, predict_pool, weights, [str(image)], str(out), cost=COST, probabilities=True
    )[0]
    assert status == "ok", text
    assert plan.describe() in text
    assert (
        f"{len(range(0, 148, plan.tile_rows))} x {len(range(0, 236, plan.block_cols))} tiles"
        in text
    )
    saved = _tiled(out / "slide.ome.tif")
    _assert_argmax(saved, logits, "tiles-first plan at 2 ranks")
    assert int((saved != logits.argmax(0).numpy()).sum()) == 0
    probs = _tiled(out / "slide_probabilities.ome.tif")
    want = (logits.softmax(0) * 255).round().permute(1, 2, 0).numpy()
    assert probs.shape == (148, 236, 3) and np.abs(probs - want).max() <= 1
    record = json.loads((out / "predict.json").read_text())
    assert record["checkpoint"] == str(Path(weights).resolve())
    assert record["kind"] == "export" and record["step"] is None and record["images"] == 1
    assert f"checkpoint {Path(weights).resolve()} (no step recorded)" in text


def test_memory_error_on_one_rank(dist_pool, case, tmp_path):
    """Rank 1's allocation fails at its first band: both ranks stop with a MemoryError
    that reads as out of memory, reported with the plan and the flags."""
    root, weights, image, _ = case
    env = {MEMORYERROR_ENV: "1"}
    results = dist_pool.run(
        2, _with_hook, env, weights, str(image), str(tmp_path / "o"), cost=COST, band_rows=16
    )
    for name, oom, report in results:
        assert name == "MemoryError" and oom
        assert report.startswith("out of memory: MemoryError")
        assert "plan 148x236: bands of 16 rows" in report and "--memory-gb" in report


@pytest.mark.e2e  # runs the command line and torchrun as processes
def test_killed_rank_reported_as_out_of_memory(case, tmp_path, monkeypatch, capfd):
    """``predict --nproc 2``: rank 1 kills itself with SIGKILL at its first band (the
    kernel's OOM killer does the same): exit 1 and "out of memory" with the plan. (The
    command runs in this process; its torchrun and workers are processes.)"""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    root, weights, image, _ = case
    monkeypatch.setenv(KILL_ENV, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    args = ["predict", weights, str(image), "--out", str(tmp_path / "o"), "--nproc", "2"]
    result = CliRunner().invoke(app, [*args, "--band-rows", "16"])
    text = result.output + "".join(capfd.readouterr())
    assert result.exit_code == 1, text
    assert "out of memory: rank 1 was killed by the kernel (SIGKILL, exit code -9)" in text
    assert "plan 148x236: bands of 16 rows" in text
    assert "--memory-gb" in text and "--band-rows" in text
