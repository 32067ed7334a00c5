"""The ``spconv-train predict`` command line: its arguments and options (typer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spconv_train.cli_options import nproc_option, set_option
from spconv_train.relaunch import launched_by_torchrun

__all__ = ["register_predict"]


def register_predict(app: typer.Typer) -> None:
    """Add ``spconv-train predict`` to ``app``."""

    @app.command("predict")
    def predict(
        checkpoint: Annotated[
            Path,
            typer.Argument(
                metavar="CHECKPOINT",
                help="Run folder (its best, else latest checkpoint), a checkpoints/step-N "
                "folder, or an exported .pt file (e.g. RUN_DIR/model.pt).",
                show_default=False,
            ),
        ],
        inputs: Annotated[
            list[Path],
            typer.Argument(
                metavar="INPUT...",
                help="Image files or folders of images (PNG, JPEG, TIFF, .npy), any width.",
                show_default=False,
            ),
        ],
        out: Annotated[
            Path,
            typer.Option(
                "--out", "-o", help="Output folder for <stem>.png and <stem>_overlay.png."
            ),
        ],
        masks: Annotated[
            Path | None,
            typer.Option(
                "--masks",
                help="Folder of ground-truth masks (<stem>.png/.tif/.npy): prints and writes "
                "per-class IoU/Dice to OUT/metrics.json.",
                show_default=False,
            ),
        ] = None,
        nproc: Annotated[int | None, nproc_option("1")] = None,
        overrides: Annotated[
            list[str] | None,
            set_option("Override a key of the saved config, e.g. --set parallel.sp=2."),
        ] = None,
        config: Annotated[
            Path | None,
            typer.Option("--config", help="Use this YAML config instead of the saved one."),
        ] = None,
        band_rows: Annotated[
            int | None,
            typer.Option(
                "--band-rows",
                min=0,
                help="Predict big images in bands of N output rows (plus context rows the "
                "tool derives from the network), written to tiled TIFFs; 0 = whole image "
                "at once. Default: planned from --memory-gb (printed first).",
                show_default=False,
            ),
        ] = None,
        memory_gb: Annotated[
            float | None,
            typer.Option(
                "--memory-gb",
                min=0.1,
                help="Memory budget per rank in GB (1e9 bytes) for the plan of bands and "
                "tiles. Default: 70 % of the available memory shared by the local ranks.",
                show_default=False,
            ),
        ] = None,
        slide_tiles: Annotated[
            bool | None,
            typer.Option(
                "--slide-tiles/--no-slide-tiles",
                help="Cut big images into tiles with context on all sides (--slide-tiles) "
                "or into full-width bands only. Default: tiles when they recompute less.",
                show_default=False,
            ),
        ] = None,
        approximate: Annotated[
            bool,
            typer.Option(
                "--approximate",
                help="Stream bands even where that cannot equal whole-image inference "
                "(global pooling, e.g. DeepLabV3/LR-ASPP; heights off the stride grid).",
            ),
        ] = False,
        probabilities: Annotated[
            bool,
            typer.Option(
                "--probabilities",
                help="Also write the class probabilities (softmax x 255, one channel per "
                "class): OUT/<stem>_probabilities.ome.tif; outputs are then band-streamed.",
            ),
        ] = False,
        output_format: Annotated[
            str,
            typer.Option(
                "--format",
                help="Masks (and probabilities) as: ome-tiff (pyramidal, tiled OME-TIFF "
                "<stem>.ome.tif with the input's pixel size, class names and colours), tiff "
                "(single-level tiled <stem>.tif), png (<stem>.png; band-streamed images: "
                "tiff), auto (png for images predicted whole, ome-tiff for big, "
                "band-streamed ones). OUT/classes.json lists the classes for QuPath.",
            ),
        ] = "auto",
        geojson: Annotated[
            bool,
            typer.Option(
                "--geojson",
                help="Also write OUT/<stem>.geojson: one polygon per predicted object of "
                "every class but 0, with its class name and colour (QuPath: File > Import "
                "objects). Needs shapely (pip install 'spconv-train\\[slides]').",
            ),
        ] = False,
    ) -> None:
        """Segment full-resolution images (or volumes) with a trained model, sharded over
        the ranks.

        Each rank reads and computes only its column strip of every image (its tile with
        --set "parallel.sp=\\[p, q]"; its block of a volume on a volume config); rank 0
        writes OUT/<stem>.png (class indices) and OUT/<stem>_overlay.png (big images:
        pyramidal OME-TIFFs, see --format; volumes: OUT/<stem>.npy). Images too narrow to
        split are padded on the right and cropped back.

        [bold]spconv-train predict runs/unet images/ --out preds --nproc 2[/]

        Exit codes: 0 done, 2 bad usage, input or config, 1 failure.
        """
        from ._command import predict_command

        command = predict_command
        if launched_by_torchrun():
            from torch.distributed.elastic.multiprocessing.errors import record

            command = record(predict_command)
        raise SystemExit(
            command(
                checkpoint,
                inputs,
                out,
                nproc,
                masks,
                overrides or (),
                config,
                band_rows=band_rows,
                approximate=approximate,
                probabilities=probabilities,
                output_format=output_format,
                geojson=geojson,
                memory_gb=memory_gb,
                slide_tiles=slide_tiles,
            )
        )
