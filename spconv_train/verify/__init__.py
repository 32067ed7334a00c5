"""``spconv-train verify``: prove that sharded training equals training on one device.

From the same initial weights and the same batches, K training steps run sharded over the
configured ``(dp, sp)`` mesh and on one device; the loss, the logits, every parameter
gradient, every parameter after the optimizer step and the BatchNorm running statistics
are compared at every step (see ``_core.py`` for how, ``_compare.py`` for the error measure
and default tolerances). The per-rank peak memory of both runs and the collectives of each
sharded step are reported too; an activation-sized gather fails the check.

Entry points:

* ``run_verify(config, steps=..., ...)``: inside an initialised process group, every rank.
* ``verify_command(config_path, ...)``: what the CLI calls (``_command.py``); re-launches
  itself through torchrun (``spconv_train.relaunch``) for ``nproc > 1`` when not already
  under torchrun.
* ``register(app)``: adds the ``verify`` command to the Typer app (``_cli.py``).

This module imports no torch at import time (the CLI imports it for ``--help``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._cli import register
from ._command import DEFAULT_STEPS, verify_command

if TYPE_CHECKING:
    from ._core import run_verify
    from ._report import VerifyReport

__all__ = ["DEFAULT_STEPS", "VerifyReport", "register", "run_verify", "verify_command"]


def __getattr__(name: str):
    # Lazy: ``run_verify`` and ``VerifyReport`` pull in torch.
    if name == "run_verify":
        from ._core import run_verify

        return run_verify
    if name == "VerifyReport":
        from ._report import VerifyReport

        return VerifyReport
    raise AttributeError(name)
