"""One training step: THE function both ``run`` (``train/loop.py``) and ``verify`` execute.

``verify`` proves that sharded training equals training on one device; it can only prove
that of the code ``run`` executes if it runs the same step function, not a copy of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from torch import Tensor, nn

from .optim import clip_gradients


class TrainingStopped(RuntimeError):
    """The run stopped on purpose with a message for the user (exit code 1, no traceback)."""


class NonFiniteStep(TrainingStopped):
    """A step's loss or gradient norm is not finite; ``what`` names which, ``value`` and the
    0-based ``step`` say where (the trainer adds the step's files and the likely cause)."""

    def __init__(self, what: str, value: float, step: int) -> None:
        super().__init__(
            f"non-finite {what} ({value}) at step {step + 1}; stopping without a checkpoint"
            + (" (lower optimizer.lr or check the data)" if what == "loss" else "")
        )
        self.what, self.value, self.step = what, value, step


@dataclass
class StepResult:
    """What one step leaves for logging and checking."""

    logits: Tensor  # the model output (a DTensor when the model is parallelized)
    loss: float  # the loss value, the same on every rank (a global mean)
    grad_norm: float  # total gradient norm before clipping
    lr: float  # the learning rate the optimizer step used


def train_step(
    model: nn.Module,
    image: Tensor,
    target: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer,
    scheduler,
    *,
    params: Sequence[Tensor],
    grad_clip: float | None,
    step: int,
    autocast: AbstractContextManager | None = None,
    after_backward: Callable[[], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> StepResult:
    """Forward (under ``autocast``), loss, backward, gradient clipping over ``params``,
    optimizer and scheduler step, gradients cleared.

    ``step`` is the 0-based index of this step (for error messages). ``after_backward`` runs
    between the backward and the clipping (``verify`` records the raw gradients there).
    Raises ``NonFiniteStep`` (a ``TrainingStopped``) for a non-finite loss (before the
    backward) or gradient norm (before the optimizer step), so no non-finite value reaches
    the weights.
    ``on_phase("loss" | "backward")`` is called as each phase starts (the trainer's
    watchdog names the phase, and its collectives, where a rank hangs).
    """
    phase = on_phase if on_phase is not None else (lambda name: None)
    with autocast if autocast is not None else nullcontext():
        logits = model(image)
    phase("loss")
    loss = loss_fn(logits, target)
    value = float(loss.detach())  # the same on every rank (a global mean)
    if not math.isfinite(value):
        raise NonFiniteStep("loss", value, step)
    phase("backward")
    loss.backward()
    if after_backward is not None:
        after_backward()
    grad_norm = clip_gradients(params, grad_clip)
    if not math.isfinite(grad_norm):
        raise NonFiniteStep("gradient norm", grad_norm, step)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(logits, value, grad_norm, lr)
