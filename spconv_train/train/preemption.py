"""Preemption: SIGTERM / SIGUSR1 end the run at a step boundary with a checkpoint.

SLURM and Kubernetes send SIGTERM (SLURM also SIGUSR1 with ``--signal``) some seconds
before they kill a job. ``StopRequests`` replaces the default "die now" with "remember
it": the handler only records the signal. At the end of every step the ranks all-reduce
that record (one integer: cheap), so all of them stop after the same step even when the
signal reached only one rank, or the ranks at different times; the loop then writes a
checkpoint and raises ``Preempted``, which the CLI turns into exit code ``EXIT_PREEMPTED``.
``--resume`` continues exactly from that checkpoint.

torchrun forwards SIGTERM to its workers and waits ``--shutdown-timeout`` seconds (30 by
default) before it kills them; SIGUSR1 is forwarded only with
``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["EXIT_PREEMPTED", "STOP_SIGNALS", "Preempted", "StopRequests"]

#: Exit code of a run stopped by a signal after writing its checkpoint (README, ``cli.py``).
EXIT_PREEMPTED = 3

#: The signals that ask for a checkpoint and a clean stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal after writing the checkpoint of ``step``."""

    def __init__(self, signame: str, step: int, steps: int, checkpoint: str) -> None:
        super().__init__(
            f"stopped by {signame} after step {step} of {steps}; checkpoint written to "
            f"{checkpoint}. Continue the run with --resume (exit code {EXIT_PREEMPTED})"
        )
        self.signame, self.step, self.checkpoint = signame, step, checkpoint


class StopRequests:
    """Records stop signals from ``install()`` until the context manager exits.

    Installed only once training steps run: during set-up a signal keeps its default
    action, so a rank waiting at a rendezvous for a peer that already failed still dies at
    once when torchrun tears the job down (there is nothing to save yet). Outside the main
    thread (handlers cannot be installed there) nothing is recorded and ``agree`` still
    takes part in the all-reduce, so the ranks stay in step.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int = 0  # signal number of the first stop signal, 0: none
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum

    def install(self) -> None:
        """From now on, record the stop signals instead of dying (idempotent)."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def __enter__(self) -> StopRequests:
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def agree(self, device: torch.device, group: dist.ProcessGroup | None = None) -> str | None:
        """Collective: the name of a stop signal any rank received (``None``: keep going).

        Every rank must call it at the same point of every step.
        """
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None
