"""torchrun for ``predict --nproc N``, writing how its workers ended.

``python -m spconv_train.predict._watch TORCHRUN-ARGS`` runs torchrun's own ``main``; when
a worker fails it writes ``{local rank: {"exitcode", "signal"}}`` to the file named by
``_oom.FAILURES_ENV``, so the parent can tell a worker killed by the kernel (exit -9)
from one that stopped with an error. A kill is then reported by the parent as out of
memory, without torchrun's traceback; other failures keep torchrun's report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from ._oom import FAILURES_ENV


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; its exit code (1 when a worker failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as exc:
        ended = {
            str(rank): {"exitcode": f.exitcode, "signal": f.signal_name()}
            for rank, f in exc.failures.items()
        }
        path = os.environ.get(FAILURES_ENV)
        if path:
            Path(path).write_text(json.dumps(ended), encoding="utf-8")
        if path and any(f.exitcode == -signal.SIGKILL for f in exc.failures.values()):
            return 1  # the parent says "out of memory"
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
