"""Typer argument and option types shared by the commands (``run``, ``verify``, ``predict``).

One declaration each, so that ``--set`` and ``--nproc`` read and behave alike in every
command's ``--help``. Imports no torch (``--help`` stays fast).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["ConfigArg", "SetOpt", "nproc_option", "set_option"]

ConfigArg = Annotated[
    Path,
    typer.Argument(
        metavar="CONFIG", help="YAML config file, e.g. configs/unet.yaml.", show_default=False
    ),
]


def set_option(help: str) -> typer.models.OptionInfo:
    """``--set KEY=VALUE`` / ``-s``: one config override, repeatable."""
    return typer.Option("--set", "-s", metavar="KEY=VALUE", help=help, show_default=False)


SetOpt = Annotated[
    list[str] | None,
    set_option(
        "Override one config key (value parsed as YAML); repeatable, "
        "e.g. --set training.steps=5 --set data.width=1024."
    ),
]


def nproc_option(default_text: str) -> typer.models.OptionInfo:
    """``--nproc N`` / ``-n``: local ranks to start through torchrun; ``default_text`` says
    what happens without it."""
    return typer.Option(
        "--nproc",
        "-n",
        min=1,
        help=f"Local ranks to start through torchrun (CPU/gloo unless there is one GPU per "
        f"rank). Default: {default_text}. Ignored under torchrun.",
        show_default=False,
    )
