"""``predict_command``: the ``spconv-train predict`` command behind its options (``_cli``):
checks the inputs, launches the ranks through torchrun when asked for more than one, and
runs ``_run.run_predict`` on each; every failure becomes an exit code and one message."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from spconv_train.relaunch import launched_by_torchrun, run_torchrun

from ._checkpoint import _load_config, any_size, resolve_checkpoint
from ._errors import PredictError
from ._inputs import _class_names, _collect

__all__ = ["predict_command"]


def _error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    if os.environ.get("RANK", "0") == "0":
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}")


def predict_command(
    checkpoint: str | Path,
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    nproc: int | None = None,
    masks_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    config_path: str | Path | None = None,
    *,
    band_rows: int | None = None,
    approximate: bool = False,
    probabilities: bool = False,
    memory_gb: float | None = None,
    slide_tiles: bool | None = None,
    output_format: str = "auto",
    geojson: bool = False,
) -> int:
    """Run ``spconv-train predict``; returns the exit code (0 done, 1 crash, 2 bad input,
    config, checkpoint or an image that cannot be split). Under torchrun every rank takes
    part; otherwise ``nproc`` (default 1) local ranks are started through torchrun.
    ``band_rows`` (None = planned from ``memory_gb`` GB per rank, 0 = whole image),
    ``slide_tiles``, ``approximate`` and ``probabilities`` control band-streamed prediction
    of big images (see docs/wsi.md); ``output_format`` and ``geojson`` the files written
    (``_slide``). A rank out of memory (killed by the kernel or a failed allocation) is
    reported as such with the plan; exit code 1."""
    from spconv_train.config import ConfigError, validate_for_world
    from spconv_train.data import DataError
    from spconv_train.parallel import SpatialShardingError

    try:
        kind, weights, saved = resolve_checkpoint(checkpoint)
        cfg = _load_config(kind, weights, saved, overrides, config_path)
        volumes = cfg.data.kind == "volume"
        if volumes and band_rows:  # before any file is read
            raise PredictError(
                f"--band-rows {band_rows}: volumes are predicted whole (each rank holds its "
                "block of every volume); leave --band-rows out or give 0"
            )
        from ._slide import slide_options

        slide = slide_options(output_format, geojson, volumes)
        nproc = nproc or 1
        if not launched_by_torchrun():  # the mesh fits the ranks, before any file is read
            validate_for_world(any_size(cfg), nproc)
        images = _collect(inputs, masks_dir, volumes)
        names = _class_names(cfg, masks_dir)
    except (PredictError, ConfigError, DataError) as exc:
        _error(str(exc))
        return 2
    if not launched_by_torchrun() and nproc > 1:
        args = [str(checkpoint), *map(str, inputs), "--out", str(out_dir)]
        args += ["--masks", str(masks_dir)] if masks_dir else []
        args += ["--config", str(config_path)] if config_path else []
        for text in overrides:
            args += ["--set", text]
        args += ["--band-rows", str(band_rows)] if band_rows is not None else []
        args += ["--approximate"] if approximate else []
        args += ["--probabilities"] if probabilities else []
        args += ["--format", output_format] if output_format != "auto" else []
        args += ["--geojson"] if geojson else []
        args += ["--memory-gb", str(memory_gb)] if memory_gb is not None else []
        args += {True: ["--slide-tiles"], False: ["--no-slide-tiles"]}.get(slide_tiles, [])
        return _launch(nproc, args)
    from spconv_train.distributed import init_distributed, shutdown

    try:
        init_distributed(cfg.parallel.backend, cpu_affinity=cfg.parallel.cpu_affinity)
        from ._run import run_predict
        from ._streamed import StreamOptions

        stream = StreamOptions(
            band_rows, approximate, probabilities, memory_gb=memory_gb, tiles=slide_tiles,
            slide=slide,
        )  # fmt: skip
        run_predict(cfg, kind, weights, images, out_dir, class_names=names, stream=stream)
    except (PredictError, ConfigError, DataError, SpatialShardingError) as exc:
        _error(str(exc))
        return 2
    except Exception as exc:
        from spconv_train.distributed import is_peer_failure

        from ._oom import is_oom, oom_message

        if is_peer_failure(exc):  # the rank that went away is reported by the launcher
            _error(f"another rank stopped ({exc})")
            return 1
        if not is_oom(exc):
            raise
        _error(oom_message(f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        shutdown()
    return 0


def _launch(nproc: int, args: list[str]) -> int:
    """``predict ARGS`` on ``nproc`` local ranks through torchrun; a worker killed by the
    kernel is reported as out of memory, with the plan the ranks printed."""
    from ._oom import FAILURES_ENV, PLAN_ENV, killed_report

    with tempfile.TemporaryDirectory(prefix="spconv-predict-") as tmp:
        env = {
            PLAN_ENV: str(Path(tmp) / "plan.txt"),
            FAILURES_ENV: str(Path(tmp) / "failures.json"),
        }
        code = run_torchrun(nproc, "predict", args, env, launcher="spconv_train.predict._watch")
        report = killed_report(Path(tmp)) if code else None
    if report:
        _error(report)
    return code
