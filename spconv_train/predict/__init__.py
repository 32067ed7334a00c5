"""``spconv-train predict``: segment full-resolution images of any width with a trained model.

Every image is split along its width over the spatial ranks (``sp`` = all ranks unless
``--set parallel.sp=K``; with ``dp = world / sp`` replicas, image ``i`` goes to replica
``i % dp``). Each rank reads only its own column strip (PNG/JPEG are decoded whole and
sliced, TIFF and ``.npy`` are read strip-wise), runs the parallelized model in eval mode
without gradients, and takes the arg-max over the classes of its strip. Rank 0 then
gathers the uint8 class-index strips and the RGB overlay strips (1 and 3 bytes per pixel:
far smaller than the activations, which never leave their rank) and writes
``<stem>.png`` (class indices; 16-bit if there are more than 256 classes) and
``<stem>_overlay.png`` into the output folder. With ``--masks DIR`` (``<stem>.*`` masks) a
confusion matrix is counted strip by strip, summed over all ranks, printed as a
per-class IoU/Dice table and written to ``metrics.json``.

Widths that cannot be split: when the first forward of an image raises
``SpatialShardingError`` (e.g. a strip of a deep, down-sampled layer ends up empty), the
image is padded on the right with zeros to the next multiple of ``32 * sp`` columns, run
again, and the prediction is cropped back to the original width. The padding changes
nothing left of the original right edge for a network with zero-padded convolutions only
at the very first layer, but deeper layers see the padded zeros (through their
receptive field), so predictions within a receptive field of the right edge may differ
from an unpadded single-device run; the summary names every padded image. If the padded
width fails too (a strip narrower than a layer's halo), the error says so and suggests
fewer ranks.

Big images are predicted piece by piece, exactly equal to whole-image inference, and
written as tiled TIFFs band by band (``_streamed``, ``_receptive``, ``_bands``,
``_writers``; docs/wsi.md), then as pyramidal OME-TIFFs with the input's pixel size and
the class names, and with ``--geojson`` as polygons (``_slide``, ``_geojson``). The
pieces are full-width row bands, or tiles with context on all sides, as large as the
per-rank memory budget allows (``--memory-gb``; the plan, printed first, comes from a
probe of the model's bytes per pixel: ``_memory_plan``, ``_memory_probe``), or bands of
``--band-rows``. A rank out of memory is reported as such (``_oom``, ``_watch``); a
progress bar shows images and pieces with an ETA (``_progress``); the checkpoint and its
step are printed and written to ``OUT/predict.json`` (``_record``).

H x W tiles: with ``--set parallel.sp=[p, q]`` every image (and every band) is split into
p x q tiles instead of strips; each rank reads only its tile (``_layout``). Volumes (a
config with ``data.kind: volume``): every volume is split along ``parallel.shard_dim``,
each rank reads only its block, and ``<stem>.npy`` label volumes are written
(``_volumes``; docs/volumes.md).

Checkpoints: a run folder (its best, else latest checkpoint), a ``step-N`` checkpoint
folder (both use the run's ``config.yaml``), or an exported ``.pt`` holding
``{"model", "config"}``; ``--config`` replaces the saved config.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import typer

from spconv_train.verify import launched_by_torchrun, run_torchrun

from ._errors import ImagesFailed, PredictError
from ._inputs import _class_names, _collect

__all__ = [
    "PAD_MULTIPLE",
    "ImagesFailed",
    "PredictError",
    "any_size",
    "load_export",
    "predict_command",
    "register",
    "resolve_checkpoint",
    "run_predict",
]

#: Padded widths are multiples of ``PAD_MULTIPLE * sp`` (32 = the output stride of the
#: usual backbones, and 2**5 for a U-Net of depth <= 6).
PAD_MULTIPLE = 32


def __getattr__(name: str):
    if name == "run_predict":  # lazy: it pulls in torch
        from ._run import run_predict

        return run_predict
    raise AttributeError(name)


def resolve_checkpoint(path: str | Path) -> tuple[str, Path, Path | None]:
    """``(kind, weights, config.yaml or None)`` for a run folder, a checkpoint folder or an
    exported ``.pt`` (kind ``"dcp"`` or ``"export"``)."""
    p = Path(path)
    if p.is_file():
        return "export", p, None
    if (p / "meta.json").is_file():
        return "dcp", p, p.parent.parent / "config.yaml"
    if (p / "checkpoints").is_dir() or (p / "model.pt").is_file():
        for pointer in ("best", "latest"):
            f = p / "checkpoints" / pointer
            name = f.read_text().strip() if f.is_file() else ""
            if name and (p / "checkpoints" / name / "meta.json").is_file():
                return "dcp", p / "checkpoints" / name, p / "config.yaml"
        if (p / "model.pt").is_file():
            return "export", p / "model.pt", p / "config.yaml"
    raise PredictError(
        f"{p}: not a run folder, a checkpoint folder (with meta.json) or an exported .pt file"
    )


_NOT_EXPORT_HINT = (
    "give a run folder, a checkpoints/step-N folder or the model.pt written by spconv-train run"
)


def load_export(path: Path) -> dict:
    """The ``{"model", "config"}`` dict of an exported ``.pt`` file, read with
    ``weights_only=True``; anything else raises ``PredictError`` naming the file (never
    torch's advice to retry with ``weights_only`` off, which would run arbitrary code
    from a file that is not a spconv-train export)."""
    import pickle

    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, ValueError) as exc:
        # UnpicklingError: bytes that are not a weights-only pickle; RuntimeError: not a
        # torch zip archive; the others: truncated or random bytes.
        raise PredictError(
            f"{path}: not a spconv-train checkpoint (cannot be read as a weights-only torch "
            f"file: {type(exc).__name__}); {_NOT_EXPORT_HINT}"
        ) from None
    except OSError as exc:
        raise PredictError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise PredictError(
            f"{path}: not a spconv-train checkpoint (no 'model' state dict in it); "
            + _NOT_EXPORT_HINT
        )
    return saved


def _load_config(kind: str, weights: Path, config_yaml: Path | None, overrides, config_path):
    """The config to build the model with (the saved one unless ``config_path``)."""
    from spconv_train.config import load_config

    overrides = list(overrides)
    if not any(o.strip().startswith("parallel.sp") for o in overrides):
        overrides.append("parallel.sp=0")  # every rank shares each image by default
    source = config_path or (config_yaml if config_yaml and config_yaml.is_file() else None)
    if source is not None:
        return load_config(source, overrides, check_paths=False)
    if kind == "export":
        import yaml

        saved = load_export(weights).get("config")
        if saved:
            with tempfile.TemporaryDirectory() as tmp:
                f = Path(tmp) / "config.yaml"
                f.write_text(yaml.safe_dump(saved), encoding="utf-8")
                return load_config(f, overrides, check_paths=False)
    raise PredictError(f"{weights}: no saved config found; pass --config CONFIG")


def any_size(cfg):
    """``cfg`` without the training crop size (``data.depth/height/width`` null): predict
    takes every image or volume at its own size."""
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, depth=None, height=None, width=None)
    )


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


def register(app: typer.Typer) -> None:
    """Add ``spconv-train predict`` to ``app`` (its options: ``_cli``)."""
    from ._cli import register_predict

    register_predict(app)
