"""A per-rank watchdog: a rank that waits too long in one phase stops the job, loudly.

The training loop announces each phase as it starts (``beat("step 7: forward pass ...")``,
naming the collectives the phase runs). A daemon thread checks that the current phase has
not lasted longer than ``timeout_s``; if it has (a peer rank hangs, was stopped with
SIGSTOP, or died without closing its connections), it prints one line naming the rank, the
step, the phase and its collectives, and ends the process with ``os._exit(EXIT_HUNG)``:
an exception could not reach a main thread blocked inside a C++ collective. torchrun then
stops the other workers as for any failed worker.

The process group's own timeout is set somewhat longer (``process_group_timeout``), so
the watchdog, whose message says where the job was, normally fires first; the group's
timeout stays as a backstop for phases the watchdog does not cover (start-up).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

__all__ = ["EXIT_HUNG", "Watchdog", "last_phase", "process_group_timeout"]

#: Exit code of a rank stopped by the watchdog (documented in the README and ``cli.py``).
EXIT_HUNG = 4

# The last phase announced in this process (read by the CLI's error report after the
# watchdog object is gone): which step and collective a failing rank was in.
_LAST_PHASE: list[str | None] = [None]


def last_phase() -> str | None:
    """The phase this rank announced last (``None`` before the first ``beat``)."""
    return _LAST_PHASE[0]


def process_group_timeout(timeout_s: float) -> float:
    """The process group's timeout for a watchdog of ``timeout_s``: a little longer, so the
    watchdog's message (which names the step and phase) comes first."""
    return timeout_s * 1.25 + 5.0


class Watchdog:
    """Stops this process when one announced phase lasts longer than ``timeout_s``.

    ``beat(what)`` starts a new phase (main thread); ``close()`` stops the thread. Use as
    a context manager. ``enabled=False`` (a single process: no peer to wait for, and a long
    step on one device is no hang) only records the phases. ``exit`` replaces ``os._exit``
    (tests).
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        *,
        enabled: bool = True,
        exit=os._exit,  # noqa: A002
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self._exit = exit
        self._phase: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spconv-watchdog", daemon=True)
        if enabled:
            self._thread.start()

    def beat(self, what: str) -> None:
        """Phase ``what`` starts now (its name should say which collectives it runs)."""
        _LAST_PHASE[0] = what
        self._phase = (what, time.monotonic())  # one tuple: read atomically by the thread

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            phase = self._phase
            if phase is None:
                continue
            what, since = phase
            waited = time.monotonic() - since
            if waited > self.timeout_s:
                self._fire(what, waited)
                return

    def _fire(self, what: str, waited: float) -> None:
        message = (
            f"[rank {self.rank}] error: watchdog: stuck for {waited:.0f} s in {what} "
            f"(parallel.timeout_s={self.timeout_s:g}). A peer rank is probably hung, stopped "
            "or dead (its own message, if any, is above); stopping this rank with exit code "
            f"{EXIT_HUNG}. If this phase is legitimately this slow, raise parallel.timeout_s."
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        finally:
            self._exit(EXIT_HUNG)
