"""``verify_command``: what ``spconv-train verify`` runs (see the package docstring).

Loads and checks the config, re-launches itself through torchrun for ``nproc > 1`` when not
already under torchrun, and otherwise runs the comparison in this process group. Imports no
torch at import time (the CLI imports it for ``--help``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from spconv_train.relaunch import CHILD_ENV, launched_by_torchrun, run_torchrun

DEFAULT_STEPS = 3


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
