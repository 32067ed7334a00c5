"""Out of memory, said as such: the plan of the failing run and the flags that change it.

A rank can run out of memory in two ways. The kernel's OOM killer ends it with SIGKILL:
the rank can print nothing, torchrun only sees ``exitcode -9``. ``predict --nproc N`` runs
torchrun through ``_watch``, which writes how every worker ended to a file the parent
reads (``FAILURES_ENV``); the plan comes from a file the first rank writes when it
prints the plan (``PLAN_ENV``). Or an allocation fails inside the rank (Python's
``MemoryError``, torch's ``OutOfMemoryError`` or its CPU allocator's "can't allocate
memory"): ``is_oom`` recognises it on the failing rank and in the message other ranks
receive of it, and the rank reports it with the plan it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

__all__ = [
    "FAILURES_ENV",
    "PLAN_ENV",
    "OOM_NAMES",
    "announce",
    "fault_hook",
    "is_oom",
    "killed_report",
    "oom_message",
]

#: File (set by the launching parent) where the first rank writes the plan it prints.
PLAN_ENV = "SPCONV_PREDICT_PLAN_FILE"
#: File (set by the launching parent) where ``_watch`` writes how the workers ended.
FAILURES_ENV = "SPCONV_PREDICT_FAILURES_FILE"
#: Test hooks: the global rank (``"1"``) that kills itself with SIGKILL, or raises
#: MemoryError, at its first piece.
KILL_ENV = "SPCONV_PREDICT_TEST_KILL_RANK"
MEMORYERROR_ENV = "SPCONV_PREDICT_TEST_MEMORYERROR_RANK"
OOM_NAMES = ("MemoryError", "OutOfMemoryError")
_OOM_TEXT = re.compile(
    r"(another rank failed: (MemoryError|OutOfMemoryError)|can't allocate memory|"
    r"CUDA out of memory)"
)
_FIX = (
    "lower --memory-gb (the plan then cuts smaller pieces) or --band-rows, or use more "
    "ranks (--nproc) or a machine with more memory"
)
_last_plan: list[str] = []


def announce(plan, how: str, lead: bool, console) -> None:
    """Print ``plan`` (a ``MemoryPlan``) and its warnings on the group's first rank (not
    for an image that fits whole); keep its text for an out-of-memory report and write it
    to ``PLAN_ENV`` on global rank 0."""
    text = f"{plan.describe()}; bytes per pixel {how}"
    _last_plan[:] = [text]
    path = os.environ.get(PLAN_ENV)
    if path and lead and os.environ.get("RANK", "0") == "0":
        Path(path).write_text(text + "\n", encoding="utf-8")
    if not lead or (plan.whole and plan.fits):
        return
    console.print(f"[bold]{_escape(text)}[/]", soft_wrap=True)
    for warning in plan.warnings():
        console.print(f"[yellow]warning[/] {_escape(warning)}", soft_wrap=True)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def fault_hook() -> None:
    """The test hooks (``KILL_ENV``, ``MEMORYERROR_ENV``), once per process."""
    import torch.distributed as dist

    rank = str(dist.get_rank()) if dist.is_initialized() else "0"
    if os.environ.pop(KILL_ENV, None) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.pop(MEMORYERROR_ENV, None) == rank:
        raise MemoryError("test hook: allocation failed")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is this rank's (or, by its message, another rank's) failed
    allocation."""
    return type(exc).__name__ in OOM_NAMES or bool(_OOM_TEXT.search(str(exc)))


def oom_message(what: str, plan: str | None = None) -> str:
    """The report: ``what`` happened, the plan, the flags to change."""
    plan = plan if plan is not None else (_last_plan[0] if _last_plan else None)
    lines = [f"out of memory: {what}"]
    lines.append(f"  {plan}" if plan else "  (no band plan was printed yet)")
    lines.append(f"  {_FIX}")
    return "\n".join(lines)


def killed_report(folder: Path) -> str | None:
    """The out-of-memory report for a torchrun job whose worker was killed with SIGKILL
    (from the ``FAILURES_ENV`` and ``PLAN_ENV`` files in ``folder``), else None."""
    try:
        failures = json.loads((folder / "failures.json").read_text())
    except (OSError, ValueError):
        return None
    killed = sorted(int(r) for r, f in failures.items() if f.get("exitcode") == -signal.SIGKILL)
    if not killed:
        return None
    try:
        plan = (folder / "plan.txt").read_text().strip()
    except OSError:
        plan = None
    ranks = ", ".join(map(str, killed))
    what = (
        f"rank {ranks} was killed by the kernel (SIGKILL, exit code -9), most likely by its "
        "out-of-memory killer"
    )
    return oom_message(what, plan or "")
