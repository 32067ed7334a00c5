"""The memory plan of ``predict`` (issue 24, items 1-2), without a process group.

The plan keeps a rank's estimate within its budget and picks the layout (full-width bands
or tiles with context on all sides) with the lower recompute factor, computed from the
pieces' real read ranges; the probe's bytes per pixel are the live tensors' peak
(deterministic, linear in the pixels); an out-of-memory failure is recognised from its
type or from the message other ranks receive, and a kill from torchrun's failure file;
the progress prints plain lines with an ETA when stderr is no terminal.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from spconv_train.predict._memory_plan import choose_plan, recompute
from spconv_train.predict._memory_probe import probe_bytes_per_pixel
from spconv_train.predict._oom import is_oom, killed_report, oom_message
from spconv_train.predict._progress import PredictProgress

# The 67 Mpx slide of issue 24 with the resnet18 U-Net's geometry (stride 32, margin 416).
SLIDE = dict(height=4096, width=16384, grid=(1, 2), stride=32, margin=416)
GB = 10**9


def test_recompute_counts_the_read_ranges():
    """Bands of 100 rows (rounded up to 104 on the stride 8) with 16 context rows: every
    band reads its rows plus the context that lies inside the image."""
    factor, largest = recompute(300, 100, 8, 16)
    # kept [0,104) [104,208) [208,300): read 0-120, 88-224, 192-300
    assert largest == 136
    assert factor == pytest.approx((120 + 136 + 108) / 300)
    assert recompute(300, 0, 8, 16) == (1.0, 300)
    assert recompute(300, 400, 8, 16) == (1.0, 300)


def test_wide_slide_bands_do_not_fit_tiles_do():
    """Full-width bands of the 67 Mpx slide cannot fit 4 GB per rank (the issue's OOM); the
    plan then cuts tiles that fit, with a recompute factor below 2. Without any piece that
    fits, the plan says so."""
    cost = dict(bytes_per_pixel=600.0, base_bytes=GB, budget_bytes=4 * GB)
    bands = choose_plan(**SLIDE, **cost, tiles=False)
    assert bands.layout == "bands" and not bands.fits
    # no band fits: bands keeping twice their context (832 + 2 x 416 rows read), as the
    # issue's user got them, but now with the warning
    assert bands.band_rows == 832 and bands.pixels_per_rank == 1664 * 8192
    (warning,) = bands.warnings()
    assert "over the 4.00 GB budget" in warning and "--memory-gb" in warning
    tiles = choose_plan(**SLIDE, **cost)
    assert tiles.layout == "tiles" and tiles.fits
    assert tiles.estimated_bytes <= 4 * GB
    assert tiles.recompute_factor < 2 and not tiles.warnings()
    rows, cols = tiles.read_shape
    assert tiles.pixels_per_rank == rows * -(-cols // 2)
    assert f"tiles of {tiles.tile_rows} x {tiles.tile_cols} px" in tiles.describe()
    hopeless = choose_plan(**SLIDE, bytes_per_pixel=600.0, base_bytes=GB, budget_bytes=GB)
    assert not hopeless.fits and (hopeless.tile_rows, hopeless.tile_cols) == (832, 832)


def test_bands_when_they_recompute_least():
    """A tall narrow image: full-width bands are the best tiles; a small one: whole."""
    cost = dict(bytes_per_pixel=600.0, base_bytes=GB, budget_bytes=2 * GB)
    tall = choose_plan(40000, 1024, (1, 2), 32, 416, **cost)
    assert tall.layout == "bands" and tall.fits
    free_rows = (GB - 1024 * 1.0 * tall.tile_rows) / 600 / 512
    assert tall.tile_rows + 2 * 416 <= free_rows < tall.tile_rows + 2 * 416 + 2 * 32
    small = choose_plan(1000, 1000, (1, 2), 32, 416, **cost)
    assert small.whole and small.recompute_factor == 1.0


def test_explicit_band_rows_and_warning():
    """--band-rows is taken as given; a factor above 2 warns and names what lowers it."""
    plan = choose_plan(**SLIDE, bytes_per_pixel=600.0, base_bytes=GB, budget_bytes=64 * GB,
                       band_rows=256)  # fmt: skip
    assert plan.layout == "bands" and plan.band_rows == 256
    assert plan.recompute_factor == pytest.approx(recompute(4096, 256, 32, 416)[0])
    (warning,) = plan.warnings()
    assert "recompute factor" in warning
    assert "--nproc" in warning and "--memory-gb" in warning and "--slide-tiles" in warning


def test_probe_is_the_live_tensor_peak():
    """The CPU probe: the peak of a chain of convolutions' live activations per pixel, the
    same on every call (x the allocator overhead)."""
    from spconv_train.predict._memory_probe import CPU_OVERHEAD

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 2, 1)
    ).eval()
    first, how = probe_bytes_per_pixel(model, 3, 4)
    assert probe_bytes_per_pixel(model, 3, 4)[0] == first
    # input (3 floats; created before) is not counted; at the peak the conv output (8)
    # and the ReLU's (8) are alive: 16 floats = 64 B, then 8 + 2 floats
    assert first == pytest.approx(64 * CPU_OVERHEAD)
    assert "live tensors" in how


def test_out_of_memory_recognised():
    """Type, torch's CPU allocator text and another rank's forwarded failure."""
    assert is_oom(MemoryError("x"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_oom(RuntimeError("another rank failed: MemoryError: x"))
    assert not is_oom(RuntimeError("another rank failed: ValueError: x"))
    text = oom_message("MemoryError: x", "plan 10x10: whole image")
    assert text.startswith("out of memory: MemoryError: x")
    assert "plan 10x10" in text and "--memory-gb" in text and "--band-rows" in text


def test_killed_report(tmp_path):
    """A worker that exited -9 is reported as out of memory with the plan; -15 alone (a
    worker torchrun stopped) or exit 1 is not."""
    (tmp_path / "plan.txt").write_text("plan 4096x16384: bands of 32 rows\n")
    failures = {"0": {"exitcode": -15, "signal": "SIGTERM"}, "1": {"exitcode": -9}}
    (tmp_path / "failures.json").write_text(json.dumps(failures))
    report = killed_report(tmp_path)
    assert report.startswith("out of memory: rank 1 was killed by the kernel (SIGKILL")
    assert "plan 4096x16384" in report and "--memory-gb" in report
    (tmp_path / "failures.json").write_text(json.dumps({"0": {"exitcode": 1}}))
    assert killed_report(tmp_path) is None


def test_progress_plain_lines(monkeypatch):
    """No terminal: a line with the image, the piece, the share done and an ETA."""
    import spconv_train.predict._progress as progress

    clock = iter(range(0, 1000, 20))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    out = io.StringIO()
    bar = PredictProgress(2, True, stream=out)
    bar.image("a", 4)
    bar.advance()  # 1 of 4 pieces of image 1 of 2: 12.5 % after 40 s
    lines = out.getvalue().splitlines()
    assert lines[-1] == ("predict: image 1/2 a: piece 1/4 (12 %), elapsed 0:00:40, ETA 0:04:40")
    for _ in range(3):
        bar.advance()
    assert "(50 %)" in out.getvalue().splitlines()[-1]
    silent = io.StringIO()
    PredictProgress(2, False, stream=silent).image("a", 4)
    assert silent.getvalue() == ""


def test_writer_abort_before_any_band(tmp_path):
    """A failure at the first piece (out of memory, typically) aborts the TIFF writer
    before any band was put: abort returns and leaves no file (it used to wait forever)."""
    import threading

    import numpy as np

    from spconv_train.predict._writers import TiledTiffWriter

    writer = TiledTiffWriter(tmp_path / "x.tif", (10, 10), np.uint8)
    done = threading.Thread(target=writer.abort, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "abort hangs"
    assert not (tmp_path / "x.tif").exists()


def test_column_pieces_proven_like_bands():
    """``check_plan(axis=3)``: tiles of 12 columns with the U-Net's margin equal the whole
    probe row at a width on the stride grid, not off it or with a short margin."""
    from spconv_train.predict._receptive import CHECK_RTOL, StreamPlan, analyse, check_plan
    from tests.test_predict_bands import UNET, _model

    _, unet = _model(UNET)
    plan = analyse(unet, 3)
    assert check_plan(unet, plan, 160, 12, 3, axis=3) <= CHECK_RTOL
    assert check_plan(unet, plan, 163, 12, 3, axis=3) > CHECK_RTOL
    assert check_plan(unet, StreamPlan(plan.stride, 4), 160, 12, 3, axis=3) > CHECK_RTOL


def test_cli_memory_options_reach_the_ranks(tmp_path, monkeypatch):
    """``--memory-gb`` and ``--slide-tiles`` are documented and passed on to the torchrun
    ranks, which run through the launcher that reports kills."""
    import numpy as np
    from typer.testing import CliRunner

    import spconv_train.predict._command as predict
    from spconv_train.cli import app
    from tests.test_predict_bands import UNET, _export

    result = CliRunner().invoke(app, ["predict", "--help"], env={"COLUMNS": "200"})
    assert "--memory-gb" in result.output and "--no-slide-tiles" in result.output
    weights, _ = _export(tmp_path / "m.pt", UNET)
    np.save(tmp_path / "x.npy", np.zeros((3, 32, 32), np.float32))
    seen = []
    monkeypatch.setattr(predict, "run_torchrun", lambda *a, **k: seen.append((a, k)) or 0)
    kw = {"memory_gb": 1.5, "slide_tiles": False}
    assert predict.predict_command(weights, [tmp_path / "x.npy"], tmp_path / "o", 2, **kw) == 0
    ((args, kwargs),) = seen
    assert args[2][-3:] == ["--memory-gb", "1.5", "--no-slide-tiles"]
    assert kwargs["launcher"] == "spconv_train.predict._watch"
