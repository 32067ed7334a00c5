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

import typer

from ._checkpoint import PAD_MULTIPLE, any_size, load_export, resolve_checkpoint
from ._command import predict_command
from ._errors import ImagesFailed, PredictError

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


def __getattr__(name: str):
    if name == "run_predict":  # lazy: it pulls in torch
        from ._run import run_predict

        return run_predict
    raise AttributeError(name)


def register(app: typer.Typer) -> None:
    """Add ``spconv-train predict`` to ``app`` (its options: ``_cli``)."""
    from ._cli import register_predict

    register_predict(app)
