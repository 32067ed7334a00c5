"""``spconv-train verify``: prove that sharded training equals training on one device.

From the same initial weights and the same batches, K training steps run sharded over the
configured ``(dp, sp)`` mesh and on one device; the loss, the logits, every parameter
gradient, every parameter after the optimizer step and the BatchNorm running statistics
are compared at every step (see ``_core.py`` for how, ``_compare.py`` for the error measure
and default tolerances). The per-rank peak memory of both runs and the collectives of each
sharded step are reported too; an activation-sized gather fails the check.

Entry points:

* ``run_verify(config, steps=..., ...)``: inside an initialised process group, every rank.
* ``verify_command(config_path, ...)``: what the CLI calls; re-launches itself through
  torchrun for ``nproc > 1`` when not already under torchrun.
* ``register(app)``: adds the ``verify`` command to the Typer app.

This module imports no torch at import time (the CLI imports it for ``--help``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from ._launch import CHILD_ENV, launched_by_torchrun, run_torchrun

if TYPE_CHECKING:
    from ._core import run_verify
    from ._report import VerifyReport

__all__ = [
    "VerifyReport",
    "launched_by_torchrun",
    "register",
    "run_torchrun",
    "run_verify",
    "verify_command",
]

DEFAULT_STEPS = 3


def __getattr__(name: str):
    # Lazy: ``run_verify`` and ``VerifyReport`` pull in torch.
    if name == "run_verify":
        from ._core import run_verify

        return run_verify
    if name == "VerifyReport":
        from ._report import VerifyReport

        return VerifyReport
    raise AttributeError(name)


def _error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    if os.environ.get("RANK", "0") == "0":
        Console(stderr=True, highlight=False).print(
            f"[bold red]error:[/] {escape(message)}", soft_wrap=True
        )


def _child_args(
    config_path: Path,
    overrides: Sequence[str],
    steps: int,
    json_path: Path,
    rtol: float | None,
    atol: float | None,
    reference: str,
    dtype: str,
    resync: bool,
) -> list[str]:
    args = [str(config_path)]
    for text in overrides:
        args += ["--set", text]
    args += ["--steps", str(steps), "--json", str(json_path)]
    args += ["--reference", reference, "--dtype", dtype]
    args += [] if resync else ["--independent"]
    if rtol is not None:
        args += ["--rtol", repr(rtol)]
    if atol is not None:
        args += ["--atol", repr(atol)]
    return args


def _launch(cfg, config_path, overrides, steps, nproc, json_path, tol, how) -> int:
    """``nproc`` local ranks through torchrun; the verdict comes back through the JSON report
    (the workers exit 0 after a completed comparison, so torchrun prints no crash summary
    for a failed one)."""
    overrides = list(overrides)
    if cfg.parallel.backend == "auto":
        import torch

        if torch.cuda.device_count() < nproc:  # one GPU per rank or none: CPU with gloo
            overrides.append("parallel.backend=gloo")
    with tempfile.TemporaryDirectory(prefix="spconv-verify-") as tmp:
        target = Path(json_path) if json_path is not None else Path(tmp) / "report.json"
        target.unlink(missing_ok=True)
        args = _child_args(config_path, overrides, steps, target, *tol, *how)
        code = run_torchrun(nproc, "verify", args)
        if code != 0 or not target.is_file():
            return code or 1
        return 0 if json.loads(target.read_text())["passed"] else 1


def verify_command(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    steps: int = DEFAULT_STEPS,
    nproc: int | None = None,
    json_path: str | Path | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    reference: Literal["all", "rank0"] = "all",
    dtype: Literal["float64", "config"] = "float64",
    resync: bool = True,
) -> int:
    """Run ``spconv-train verify``; returns the exit code: 0 all within tolerance, 1 a
    mismatch (or a crash), 2 a bad config (or data, or an image too narrow for ``sp``).

    Under torchrun (``RANK`` set) every rank runs the comparison in the launched process
    group. Otherwise ``nproc`` (default: ``max(parallel.sp, 2)``) local ranks are
    started through torchrun (``nproc=1`` runs in this process, world size 1).
    """
    from spconv_train.config import ConfigError, load_config, validate_for_world

    from ._compare import resolve_tolerances

    try:
        cfg = load_config(config_path, list(overrides))
        if dtype not in ("float64", "config") or reference not in ("all", "rank0"):
            raise ValueError(f"bad dtype {dtype!r} or reference {reference!r}")
        precision = "fp64" if dtype == "float64" else cfg.training.precision
        resolve_tolerances(precision, {"rtol": rtol, "atol": atol})
        if not launched_by_torchrun():
            sp = cfg.parallel.sp  # a grid [p, q] / [d, h, w] holds their product
            nproc = nproc or max(sp if isinstance(sp, int) else math.prod(sp), 2)
            validate_for_world(cfg, nproc)
    except (ConfigError, ValueError) as exc:
        _error(str(exc))
        return 2
    if not launched_by_torchrun() and nproc > 1:
        how = (reference, dtype, resync)
        return _launch(cfg, config_path, overrides, steps, nproc, json_path, (rtol, atol), how)
    tolerances = {"rtol": rtol, "atol": atol}
    return _verify_here(cfg, steps, json_path, tolerances, reference, dtype, resync)


def _verify_here(cfg, steps, json_path, tolerances, reference, dtype, resync) -> int:
    from spconv_train.config import ConfigError
    from spconv_train.data import DataError
    from spconv_train.distributed import init_distributed, shutdown
    from spconv_train.parallel import SpatialShardingError

    from ._core import run_verify

    try:
        init_distributed(cfg.parallel.backend, cpu_affinity=cfg.parallel.cpu_affinity)
        report = run_verify(
            cfg,
            steps=steps,
            tolerances=tolerances,
            json_path=json_path,
            reference=reference,
            dtype=dtype,
            resync=resync,
        )
    except (ConfigError, DataError) as exc:
        _error(str(exc))
        return 2
    except SpatialShardingError as exc:
        _error(
            f"{exc}\n(check data.width and parallel.sp: every strip must be wider than the halos)"
        )
        return 2
    finally:
        shutdown()
    if os.environ.get(CHILD_ENV) and json_path is not None:
        return 0  # the launching parent reads the verdict from the JSON report
    return 0 if report.passed else 1


def register(app: typer.Typer) -> None:
    """Add ``spconv-train verify`` to ``app``."""

    @app.command("verify")
    def verify(
        config: Annotated[
            Path, typer.Argument(metavar="CONFIG", help="YAML config file.", show_default=False)
        ],
        overrides: Annotated[
            list[str] | None,
            typer.Option(
                "--set",
                "-s",
                metavar="KEY=VALUE",
                help="Override one config key (value parsed as YAML); repeatable.",
                show_default=False,
            ),
        ] = None,
        steps: Annotated[
            int, typer.Option("--steps", "-k", min=1, help="Training steps to compare.")
        ] = DEFAULT_STEPS,
        nproc: Annotated[
            int | None,
            typer.Option(
                "--nproc",
                "-n",
                min=1,
                help="Local ranks to start through torchrun (CPU/gloo unless there is one "
                "GPU per rank). Default: max(parallel.sp, 2). Ignored under torchrun.",
                show_default=False,
            ),
        ] = None,
        json_path: Annotated[
            Path | None,
            typer.Option("--json", metavar="PATH", help="Write the full report as JSON."),
        ] = None,
        rtol: Annotated[
            float | None,
            typer.Option(
                min=0.0,
                help="Relative tolerance for every tensor (default: 1e-6 float64, 1e-4 fp32, "
                "1e-1 bf16).",
                show_default=False,
            ),
        ] = None,
        atol: Annotated[
            float | None,
            typer.Option(
                min=0.0, help="Absolute tolerance (default 0: relative only).", show_default=False
            ),
        ] = None,
        reference: Annotated[
            str,
            typer.Option(
                help="Where the one-device reference runs: 'all' ranks, or 'rank0' only "
                "(less host memory; it sends each rank its part).",
            ),
        ] = "all",
        dtype: Annotated[
            str,
            typer.Option(
                help="'float64' (exact check: both runs in float64, any difference above "
                "rounding is a bug) or 'config' (training.precision: fp32 or bf16 autocast; "
                "a tensor passes within 10x the one-device run's own rounding noise, measured "
                "against the same step in float64, unless --rtol/--atol are given).",
            ),
        ] = "float64",
        independent: Annotated[
            bool,
            typer.Option(
                "--independent",
                help="Two independent runs. Default: every reference step starts from the "
                "sharded run's state after the previous step, so each step's errors are its "
                "own rather than rounding differences grown by the chaotic dynamics of "
                "training.",
            ),
        ] = False,
    ) -> None:
        """Check that sharded training equals one device, tensor by tensor.

        From the same weights and batches, runs --steps training steps on one
        device and sharded over the configured mesh, and compares the loss,
        the logits, every gradient, every parameter after the optimizer step
        and the BatchNorm running statistics. Prints a table and a verdict,
        peak memory per rank and the collectives per step (an
        activation-sized gather fails). Dropout is disabled on both sides.

        Laptop: [bold]spconv-train verify configs/unet.yaml --nproc 2[/]
        Cluster: [bold]torchrun --nproc-per-node 8 -m spconv_train verify CONFIG[/]

        Exit codes: 0 all within tolerance, 1 mismatch, 2 bad usage or config.
        """
        if reference not in ("all", "rank0"):
            raise typer.BadParameter("must be 'all' or 'rank0'", param_hint="--reference")
        if dtype not in ("float64", "config"):
            raise typer.BadParameter("must be 'float64' or 'config'", param_hint="--dtype")
        command = verify_command
        if launched_by_torchrun():
            # torchrun's error recording: a worker's traceback reaches the launcher's summary.
            from torch.distributed.elastic.multiprocessing.errors import record

            command = record(verify_command)
        code = command(
            config,
            overrides or (),
            steps,
            nproc,
            json_path,
            rtol,
            atol,
            reference,
            dtype,
            not independent,
        )
        raise SystemExit(code)
