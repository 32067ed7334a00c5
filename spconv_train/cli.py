"""The ``spconv-train`` command line (Typer): parse, validate, call; no training logic here.

Exit codes: 0 success; 2 bad usage or configuration (a config key, a data file, an image too
narrow for the network at ``parallel.sp`` ranks, a run directory that already holds a run);
1 a failed run (non-finite loss, a crash: its traceback is printed and, under torchrun,
recorded for the launcher's summary); 3 stopped by SIGTERM/SIGUSR1 (preemption) after
writing a checkpoint: continue with ``--resume``; 4 a rank waited longer than
``parallel.timeout_s`` for its peers (the watchdog names the step and collective).

An error raised during training is printed by the rank that raised it, as
``[rank r] error: ...`` (once when several ranks raise the same one); a rank that only
lost its connection to the failed rank says so in one line instead of a gloo traceback.

Config problems are reported before torch, any process group or any data is touched. Under
torchrun every worker reports the same config error and exits 2; torchrun itself then exits
1 (it maps any worker failure to 1) after printing the workers' exit codes.

``verify`` and ``predict`` live in the modules (or packages) ``spconv_train.verify`` and
``spconv_train.predict``: each exposes ``register(app: typer.Typer) -> None`` that adds its
command (keep torch imports inside the command so ``--help`` stays fast). Until it exists a
placeholder command says so.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from spconv_train.cli_options import ConfigArg, SetOpt
from spconv_train.config import (
    Config,
    ConfigError,
    config_to_dict,
    describe_grid,
    load_config,
    resolve_grid,
)
from spconv_train.logging.run_folder import RUN_FILES, StartPlan, finish_job, job_id, plan_start

__all__ = ["RUN_FILES", "StartPlan", "app", "fail", "load_or_exit", "main", "plan_start"]

app = typer.Typer(
    name="spconv-train",
    help="Train segmentation networks on images split along their width across devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # plain tracebacks: they end up in torchrun's logs
    context_settings={"help_option_names": ["-h", "--help"]},
)

_QUIET_RANK_DELAY_S = 3.0


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def fail(message: str, code: int = 2, *, all_ranks: bool = False) -> NoReturn:
    """Print ``error: message`` on stderr (rank 0 only unless ``all_ranks``) and exit."""
    rank = _rank()
    if all_ranks or rank == 0:
        prefix = f"[rank {rank}] " if all_ranks and "RANK" in os.environ else ""
        Console(stderr=True, highlight=False).print(
            f"[bold red]error:[/] {escape(prefix + message)}", soft_wrap=True
        )
    elif os.environ.get("WORLD_SIZE", "1") != "1":
        # Every rank fails together here; torchrun kills the others as soon as one exits.
        # Let rank 0 print the message first instead of being killed before it could.
        time.sleep(_QUIET_RANK_DELAY_S)
    # SystemExit, not typer.Exit: torchrun's ``record`` re-raises it without recording it
    # as a crash, and click passes it through.
    raise SystemExit(code)


def load_or_exit(config: Path, overrides: list[str] | None) -> Config:
    """Load and validate ``config`` with ``--set`` overrides, or exit 2 naming the key."""
    try:
        return load_config(config, list(overrides or []))
    except ConfigError as exc:
        fail(str(exc))


@app.command()
def run(
    config: ConfigArg,
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the latest checkpoint in run_dir.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Delete the run already in run_dir and start over."),
    ] = False,
) -> None:
    """Train from a YAML config, in one process or under torchrun.

    One rank: [bold]spconv-train run configs/unet.yaml[/]
    Sharded: [bold]torchrun --nproc-per-node 2 -m spconv_train run configs/unet.yaml[/]

    The run folder (run_dir) receives config.yaml, checkpoints/,
    tensorboard/, metrics.jsonl and model.pt (exported weights).
    Exit codes: 0 done, 2 bad usage or config, 1 the run failed,
    3 preempted (SIGTERM/SIGUSR1: checkpoint written, continue with --resume),
    4 a rank hung longer than parallel.timeout_s.
    """
    cfg = load_or_exit(config, overrides)
    from spconv_train.distributed import env_world_size, restart_count
    from spconv_train.distributed.launch_store import launch_recorded

    job = job_id()
    try:
        resolve_grid(cfg, env_world_size())  # parallel.sp: 0 -> the grid, saved and compared
        plan = plan_start(
            cfg,
            resume=resume,
            overwrite=overwrite,
            restarts=restart_count(),
            job=job,
            recorded=launch_recorded(job),  # the same answer on every node of a restart
        )
    except ConfigError as exc:
        fail(str(exc))
    # torchrun's error recording: an uncaught exception in a worker writes its traceback
    # to the file the launcher reads, so it shows up in torchrun's failure summary.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_train)(cfg, plan)


def _rank_failure(message: str, code: int) -> NoReturn:
    """Print ``message`` as this rank's error, at once (unless another rank already printed
    the same one), leave the process group and exit with ``code``."""
    from spconv_train.distributed import first_to_report, shutdown

    if first_to_report(message):
        prefix = f"[rank {_rank()}] " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
        Console(stderr=True, highlight=False).print(
            f"[bold red]error:[/] {escape(prefix + message)}", soft_wrap=True
        )
        sys.stderr.flush()
    shutdown(failed=True)
    raise SystemExit(code)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message, shortened (gloo's come with a source path)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _train(cfg: Config, plan: StartPlan) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from spconv_train.checkpoint.files import CheckpointError
    from spconv_train.data import DataError
    from spconv_train.distributed import is_peer_failure, shutdown
    from spconv_train.parallel import SpatialShardingError
    from spconv_train.train.loop import TrainingStopped, train
    from spconv_train.train.preemption import EXIT_PREEMPTED, Preempted
    from spconv_train.train.watchdog import EXIT_HUNG, last_phase

    try:
        train(cfg, resume=plan.resume, remove=plan.remove, notes=plan.notes, job=plan.record)
    except Preempted as exc:
        # torchrun SIGTERMs the other workers as soon as the first one exits: they are all
        # leaving with the same code already, so let them finish instead of dying by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown(barrier=True)  # every rank stopped after the same step and saved it
        if _rank() == 0:
            Console(stderr=True, highlight=False).print(
                f"spconv-train: {escape(str(exc))}", soft_wrap=True
            )
        raise SystemExit(EXIT_PREEMPTED) from None
    except BaseException as exc:
        if isinstance(exc, ConfigError | DataError):
            _rank_failure(str(exc), 2)
        if isinstance(exc, SpatialShardingError):
            hint = (
                "\n(check data.width (data.height for tiles) and parallel.sp: every strip or "
                "tile must be wider and taller than the halos)"
            )
            _rank_failure(str(exc) + hint, 2)
        if isinstance(exc, TrainingStopped):
            _rank_failure(str(exc), 1)
        where = last_phase() or "set-up"
        if is_peer_failure(exc):
            _rank_failure(
                f"stopped in {where}: lost the connection to another rank, which failed "
                f"first (its error is printed above or below). Detail: {_first_line(exc)}",
                1,
            )
        if isinstance(exc, RuntimeError) and "Timed out" in str(exc):
            detail = _first_line(exc)
            _rank_failure(f"timed out in {where} waiting for another rank: {detail}", EXIT_HUNG)
        if isinstance(exc, CheckpointError):  # corrupt checkpoints, full disk: one line
            _rank_failure(str(exc), exc.code)
        shutdown(failed=True)
        if isinstance(exc, CheckpointException):
            # A BaseException, which torchrun's ``record`` would not write to its error file.
            raise RuntimeError(f"checkpoint failed: {exc}") from exc
        raise
    if _rank() == 0:
        finish_job(cfg.run_dir)  # a later launch with the same run id is a new job
    shutdown(barrier=True)


@app.command("show-config")
def show_config(
    config: ConfigArg,
    overrides: SetOpt = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            "-n",
            min=1,
            help="Also check the config for this many ranks and show the (dp, sp) mesh.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the resolved, validated config (defaults < YAML < --set) as YAML."""
    cfg = load_or_exit(config, overrides)
    auto = cfg.parallel.sp == 0
    if world_size is not None:
        try:  # resolved first, so the printed config shows the chosen grid
            dp, sp = resolve_grid(cfg, world_size)
        except ConfigError as exc:
            fail(str(exc))
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    typer.echo(text.rstrip())
    if world_size is not None:
        how = ", chosen by parallel.sp: 0" if auto else ""
        typer.echo(f"# mesh for {world_size} rank(s): dp={dp} x sp={sp}{describe_grid(cfg)}{how}")


@app.command("make-data")
def make_data(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Folder to write the dataset into.")],
    num_train: Annotated[int, typer.Option(min=1, help="Training images.")] = 16,
    num_val: Annotated[int, typer.Option(min=1, help="Validation images.")] = 4,
    height: Annotated[int, typer.Option(min=1, help="Image height in pixels.")] = 128,
    width: Annotated[int, typer.Option(min=1, help="Image width in pixels.")] = 512,
    classes: Annotated[int, typer.Option(min=1, max=255, help="Number of classes.")] = 4,
    channels: Annotated[int, typer.Option(min=1, help="Image channels.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the generator.")] = 0,
    fmt: Annotated[
        Literal["png", "tif", "npy"], typer.Option("--format", help="Image file format.")
    ] = "png",
    depth: Annotated[
        int | None, typer.Option(min=1, help="Write 3-D volumes of this depth (.npy).")
    ] = None,
) -> None:
    """Write a synthetic dataset to disk in the folder layout.

    OUT gets images/{train,val}, masks/{train,val} (class-index
    PNGs) and classes.txt, ready for data.source=folder. With --depth: volumes
    (.npy images and masks) for data.kind=volume.
    """
    from spconv_train.data import write_synthetic_dataset

    if depth is not None:  # volumes: .npy only
        from spconv_train.data.synthetic3d import write_synthetic_volumes

        size = (depth, height, width)
        root = write_synthetic_volumes(
            out,
            num_train=num_train,
            num_val=num_val,
            size=size,
            num_classes=classes,
            seed=seed,
            in_channels=channels,
        )
        typer.echo(f"wrote {num_train} train + {num_val} val volumes {size} (DxHxW) to {root}")
        typer.echo(
            f"train on it: spconv-train run configs/unet3d.yaml --set data.source=folder "
            f"--set data.root={root} --set model.num_classes={classes} "
            f"--set model.in_channels={channels}"
        )
        return

    root = write_synthetic_dataset(
        out,
        num_train=num_train,
        num_val=num_val,
        height=height,
        width=width,
        num_classes=classes,
        seed=seed,
        in_channels=channels,
        fmt=fmt,
    )
    typer.echo(f"wrote {num_train} train + {num_val} val images ({height}x{width}) to {root}")
    typer.echo(
        f"train on it: spconv-train run configs/folder.yaml --set data.root={root} "
        f"--set model.num_classes={classes} --set model.in_channels={channels}"
    )


@app.command("convert")
def convert(
    image: Annotated[Path, typer.Argument(metavar="IMAGE", help="PNG, JPEG, TIFF or .npy file.")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Output .tif file.")],
    tile: Annotated[int, typer.Option(min=16, help="Tile edge in pixels (multiple of 16).")] = 512,
    compression: Annotated[
        Literal["zlib", "zstd", "lzw", "none"], typer.Option(help="Tile compression.")
    ] = "zlib",
    mask: Annotated[
        bool, typer.Option("--mask", help="A class-index mask: downsample levels by picking.")
    ] = False,
) -> None:
    """Write IMAGE as a tiled, compressed, pyramidal TIFF that ranks read tile by tile.

    Use it for PNG/JPEG over data.max_image_pixels (decoded whole on every rank) and for
    untiled TIFFs; pick a pyramid level with data.level.
    """
    from spconv_train.data import DataError
    from spconv_train.data.convert import convert_to_tiff

    try:
        sizes = convert_to_tiff(image, out, tile=tile, compression=compression, nearest=mask)
    except (DataError, ValueError) as exc:
        fail(str(exc))
    levels = ", ".join(f"{h}x{w}" for h, w in sizes)
    typer.echo(f"wrote {out}: {len(sizes)} level(s) {levels} (HxW), {tile}px {compression} tiles")


def _placeholder(name: str, summary: str) -> None:
    def command(ctx: typer.Context) -> None:
        fail(f"'{name}' is not available in this version yet", code=1)

    command.__doc__ = f"{summary} (not available yet)"
    app.command(
        name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(command)


def _add_optional_commands() -> None:
    """Register ``verify``/``predict`` from their modules, or placeholders without them."""
    for name, summary in (
        ("verify", "Check that the sharded run equals the single-device run"),
        ("predict", "Segment full-resolution images with a trained model"),
    ):
        try:
            module = importlib.import_module(f"spconv_train.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"spconv_train.{name}":
                raise
            module = None
        register = getattr(module, "register", None)  # None: not there (or not finished)
        if register is None:
            _placeholder(name, summary)
        else:
            register(app)


_add_optional_commands()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``spconv-train`` script and of ``python -m spconv_train``."""
    app(args=argv, prog_name="spconv-train")
