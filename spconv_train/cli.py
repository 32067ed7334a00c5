"""The ``spconv-train`` command line (Typer): parse, validate, call; no training logic here.

Exit codes: 0 success; 2 bad usage or configuration (a config key, a data file, an image too
narrow for the network at ``parallel.sp`` ranks, a run directory that already holds a run);
1 a failed run (non-finite loss, a crash: its traceback is printed and, under torchrun,
recorded for the launcher's summary).

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from spconv_train.config import (
    Config,
    ConfigError,
    config_to_dict,
    load_config,
    validate_for_world,
)

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

#: What a run leaves in its directory (the only things ``--overwrite`` deletes).
RUN_FILES = ("config.yaml", "checkpoints", "tensorboard", "metrics.jsonl", "model.pt")

ConfigArg = Annotated[
    Path,
    typer.Argument(
        metavar="CONFIG", help="YAML config file, e.g. configs/unet.yaml.", show_default=False
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one config key (value parsed as YAML); repeatable, "
        "e.g. --set training.steps=5 --set data.width=1024.",
        show_default=False,
    ),
]


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


@dataclass(frozen=True)
class StartPlan:
    """How ``run`` starts: ``resume`` from the latest checkpoint (if any); ``remove`` the
    previous run's files first (``--overwrite``); ``notes`` to print."""

    resume: bool = False
    remove: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def _config_changes(cfg: Config, saved: Path) -> list[str]:
    """Settings that differ from the config saved by the run being resumed."""
    try:
        old = config_to_dict(load_config(saved, check_paths=False))
    except ConfigError:
        return []

    def flat(d: dict, prefix: str = "") -> dict:
        out: dict = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old), flat(config_to_dict(cfg))
    changed = [k for k in b if a.get(k) != b[k]]
    return [f"changed since the saved config: {k}: {a.get(k)!r} -> {b[k]!r}" for k in changed]


def plan_start(cfg: Config, *, resume: bool, overwrite: bool, restarts: int) -> StartPlan:
    """Decide how ``run`` starts in ``cfg.run_dir`` (reads only; before any process group).

    A folder holding a run (any of ``RUN_FILES``) is refused unless ``resume`` or
    ``overwrite``. When torchrun restarts failed workers (``restarts > 0``) the run
    continues from its latest checkpoint (``checkpoint.resume: auto``) or starts over
    (``never``) without asking. ``resume`` without a checkpoint starts fresh (with a note),
    so a job script may always pass ``--resume``.
    """
    run_dir = Path(cfg.run_dir)
    if resume and overwrite:
        raise ConfigError("--resume", "cannot be combined with --overwrite; pick one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("run_dir", f"{run_dir} exists and is not a directory")
    found = tuple(name for name in RUN_FILES if (run_dir / name).exists())
    if restarts > 0:
        resume = resume or cfg.checkpoint.resume == "auto"
        note = f"torchrun restart {restarts}: " + ("resuming" if resume else "starting over")
        return StartPlan(resume=resume, remove=() if resume else found, notes=[note])
    if found and not (resume or overwrite):
        raise ConfigError(
            "run_dir",
            f"{run_dir} already holds a run ({', '.join(found)}); pass --resume to continue "
            "it, --overwrite to start over, or choose another folder with --set run_dir=...",
        )
    notes = []
    if resume:
        has_ckpt = (run_dir / "checkpoints").is_dir() and any(
            p.name.startswith("step-") for p in (run_dir / "checkpoints").iterdir()
        )
        if not has_ckpt:
            notes.append(f"--resume: no checkpoint in {run_dir}; starting from step 0")
        if (run_dir / "config.yaml").is_file():
            notes += _config_changes(cfg, run_dir / "config.yaml")
    return StartPlan(resume=resume, remove=found if overwrite else (), notes=notes)


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
    Exit codes: 0 done, 2 bad usage or config, 1 the run failed.
    """
    cfg = load_or_exit(config, overrides)
    from spconv_train.distributed import env_world_size, restart_count

    try:
        validate_for_world(cfg, env_world_size())
        plan = plan_start(cfg, resume=resume, overwrite=overwrite, restarts=restart_count())
    except ConfigError as exc:
        fail(str(exc))
    # torchrun's error recording: an uncaught exception in a worker writes its traceback
    # to the file the launcher reads, so it shows up in torchrun's failure summary.
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_train)(cfg, plan)


def _train(cfg: Config, plan: StartPlan) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from spconv_train.checkpoint_files import CheckpointError
    from spconv_train.data import DataError
    from spconv_train.distributed import shutdown
    from spconv_train.parallel import SpatialShardingError
    from spconv_train.train.loop import TrainingStopped, train

    try:
        train(cfg, resume=plan.resume, remove=plan.remove, notes=plan.notes)
    except BaseException as exc:
        shutdown(failed=True)
        if isinstance(exc, ConfigError):
            fail(str(exc))
        if isinstance(exc, SpatialShardingError):
            hint = "\n(check data.width and parallel.sp: every strip must be wider than the halos)"
            fail(str(exc) + hint)
        if isinstance(exc, DataError):
            fail(str(exc), all_ranks=True)
        if isinstance(exc, TrainingStopped):
            fail(str(exc), code=1)
        if isinstance(exc, CheckpointError):  # corrupt checkpoints, full disk: one line
            fail(str(exc), code=exc.code)
        if isinstance(exc, CheckpointException):
            # A BaseException, which torchrun's ``record`` would not write to its error file.
            raise RuntimeError(f"checkpoint failed: {exc}") from exc
        raise
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
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    typer.echo(text.rstrip())
    if world_size is not None:
        try:
            dp, sp = validate_for_world(cfg, world_size)
        except ConfigError as exc:
            fail(str(exc))
        typer.echo(f"# mesh for {world_size} rank(s): dp={dp} x sp={sp}")


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
) -> None:
    """Write a synthetic dataset to disk in the folder layout.

    OUT gets images/{train,val}, masks/{train,val} (class-index
    PNGs) and classes.txt, ready for data.source=folder.
    """
    from spconv_train.data import write_synthetic_dataset

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
