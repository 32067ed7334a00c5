"""The Typer command ``spconv-train verify`` (options and help text only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spconv_train.cli_options import ConfigArg, SetOpt, nproc_option
from spconv_train.relaunch import launched_by_torchrun

from ._command import DEFAULT_STEPS, verify_command


def register(app: typer.Typer) -> None:
    """Add ``spconv-train verify`` to ``app``."""

    @app.command("verify")
    def verify(
        config: ConfigArg,
        overrides: SetOpt = None,
        steps: Annotated[
            int, typer.Option("--steps", "-k", min=1, help="Training steps to compare.")
        ] = DEFAULT_STEPS,
        nproc: Annotated[int | None, nproc_option("max(parallel.sp, 2)")] = None,
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
