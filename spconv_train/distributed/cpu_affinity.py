"""Bind each local rank of a CPU run to its own share of the machine's cores.

On CPU every rank computes on its own thread(s) and gloo adds helper threads that read the
sockets (``parallel/_comm_threads.py``). Left to the scheduler, a rank's helper thread is
woken onto whichever core looks best, often the one where the *other* rank is computing,
and then waits there for a scheduler tick; the rank that needs the message waits with it.
Bound to its own rank's cores (and made ``SCHED_IDLE``), the helper runs the moment its
rank blocks on a message, on the core that rank just left idle, and never takes a core
from a computing rank. Measured on the 2-core CI machine (docs/benchmarks.md, "CPU thread
placement"): a 2-rank ``Conv2d(16, 16, 3)`` forward + backward on 16 x 256 x 1024 takes
19.0 ms per step bound and idle-only, 21.5 ms idle-only but not bound, 23.2 ms with
neither, on a no-communication floor of 16.4 ms.

``bind_local_rank`` splits the cores this process may use (``os.sched_getaffinity``, so a
SLURM or container cpuset is respected) into ``LOCAL_WORLD_SIZE`` equal contiguous shares
and binds every thread of the process, present and future, to share ``LOCAL_RANK``. It does
nothing when there are fewer cores than local ranks (they must share cores anyway), for a
single local rank, off Linux, or with ``parallel.cpu_affinity: false`` /
``SPCONV_CPU_AFFINITY=0`` (e.g. two jobs sharing one machine's cores).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "bind_local_rank", "local_share"]

ENV = "SPCONV_CPU_AFFINITY"


def local_share(local_rank: int, local_world: int, cores: list[int]) -> list[int] | None:
    """Local rank ``local_rank``'s share of ``cores``: ``len(cores) // local_world``
    contiguous cores (the remainder stays unused), or ``None`` when there are fewer cores than
    local ranks or only one local rank."""
    if local_world <= 1 or len(cores) < local_world or not 0 <= local_rank < local_world:
        return None
    per = len(cores) // local_world
    return sorted(cores)[local_rank * per : (local_rank + 1) * per]


def bind_local_rank(local_rank: int, local_world: int) -> list[int] | None:
    """Bind every thread of this process to its local rank's share of the allowed cores
    (``local_share``); returns the cores, or ``None`` when nothing was bound (see the module
    docstring). Call it before creating process groups, so their threads start bound."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    share = local_share(local_rank, local_world, sorted(os.sched_getaffinity(0)))
    if share is None:
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), share)
        except OSError:  # the thread ended meanwhile
            continue
    return share
