"""glibc malloc tuning for CPU runs (spconv_train/distributed/cpu_malloc.py), measured in
page faults.

Each case runs in a fresh interpreter that sets up the process group as a run does
(``init_distributed`` on CPU tunes malloc): the thresholds are per process, and glibc's
dynamic ones depend on the allocation history, which a pytest worker has plenty of.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# A "step" allocates ``count`` blocks of ``mib`` MiB, touches every page, and frees them
# all; per case (``kind count mib`` triples on the command line, run in turn) the median
# minor page faults of 10 steps after 10 warm-up steps is printed.
# ``raw``: the blocks come straight from libc malloc with nothing allocated in between, so
# untuned glibc deterministically trims the freed heap top (above its dynamic trim
# threshold, twice the largest block freed from an mmap) and faults every page in again.
# ``torch``: the blocks are CPU tensors, as a training step allocates them.
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys, torch
    from spconv_train.distributed import init_distributed, shutdown
    init_distributed("gloo")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def step(kind, count, size):
        if kind == "torch":
            ts = [torch.empty(size // 4).fill_(1.5) for _ in range(count)]
            return sum(float(t[-1]) for t in ts)
        ptrs = [libc.malloc(size) for _ in range(count)]
        for p in ptrs:
            libc.memset(p, 1, size)
        for p in ptrs:
            libc.free(p)
    for c in range(1, len(sys.argv), 3):
        kind, count, mib = sys.argv[c], int(sys.argv[c + 1]), int(sys.argv[c + 2])
        faults = []
        for i in range(20):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step(kind, count, mib * 2**20)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        print(sorted(faults[10:])[5])
    shutdown()
    """
)


def _start(tuning: str, *cases: tuple[str, int, int]) -> subprocess.Popen:
    """One fresh interpreter with ``SPCONV_MALLOC_TUNING=tuning`` that runs every
    ``(kind, count, mib)`` case in turn (``_faults_per_step`` reads its answer)."""
    env = {**os.environ, "SPCONV_MALLOC_TUNING": tuning}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    argv = [sys.executable, "-c", PROBE, *(str(v) for case in cases for v in case)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _faults_per_step(proc: subprocess.Popen, n_cases: int) -> list[float]:
    """The page faults per step of each of the ``n_cases`` cases ``proc`` runs."""
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return [float(v) for v in out.strip().splitlines()[-n_cases:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_cpu_run_keeps_freed_pages_between_steps():
    # Both interpreters at once (the faults are counted per process): their start-ups
    # overlap on two cores.
    # 32 MiB touched per step is 8192 pages: untuned, glibc gives them back and refaults.
    # Tuned, the thresholds are fixed (no allocation history counts): the raw blocks and
    # the tensors of a step, 3 x 10 MiB and 6 x 5 MiB (below the 32 MiB mmap threshold),
    # in one interpreter.
    untuned = _start("0", ("raw", 4, 8))
    tuned = _start("1", ("raw", 4, 8), ("torch", 3, 10), ("torch", 6, 5))
    assert _faults_per_step(untuned, 1)[0] > 8000
    tuned_faults = _faults_per_step(tuned, 3)
    assert all(f < 50 for f in tuned_faults), tuned_faults


def test_tuning_reports_and_is_idempotent(monkeypatch):
    import spconv_train.distributed.cpu_malloc as cm

    monkeypatch.setattr(cm, "_done", None)
    monkeypatch.setenv(cm.ENV, "0")
    assert cm.tune_cpu_allocator() is False
    monkeypatch.setenv(cm.ENV, "1")
    assert cm.tune_cpu_allocator() is False  # the first answer stands for the process
    monkeypatch.setattr(cm, "_done", None)
    assert cm.tune_cpu_allocator() is sys.platform.startswith("linux")
