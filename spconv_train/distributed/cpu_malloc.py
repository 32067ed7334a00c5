"""Keep glibc's malloc from handing large CPU tensors back to the kernel after every step.

PyTorch allocates CPU tensors with plain ``malloc``. glibc serves a block of more than
``M_MMAP_THRESHOLD`` bytes with a fresh ``mmap`` and returns a heap top of more than
``M_TRIM_THRESHOLD`` bytes to the kernel on ``free``. Both thresholds move on their own
("dynamic" thresholds) with the allocation history of the process, so in a training step
that frees its activations together, some processes give their pages back after every step
and fault them in again on the next (a minor page fault and a zeroed page for every 4 KiB
touched), and others do not. Measured on the 2-core CI machine (docs/benchmarks.md,
"CPU allocator"): one rank of a 2-rank ``Conv2d(16,16,3)`` step on 16x256x512 strips took
13,000 page faults and 68 ms per step, the other none and 39 ms; the whole job waits for
the slow rank.

``tune_cpu_allocator`` fixes both thresholds (which also turns the dynamic adjustment off):
blocks of up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap is
not trimmed below 1 GiB of free top, so a steady-state step reuses its pages. The process
keeps the memory of its peak step, as PyTorch's CUDA caching allocator does on a GPU.

Set ``SPCONV_MALLOC_TUNING=0`` to leave malloc alone (e.g. to measure the difference).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_cpu_allocator"]

ENV = "SPCONV_MALLOC_TUNING"
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30
# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_done: bool | None = None


def tune_cpu_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once; later calls return the
    first answer). Returns True when they were set, False where the C library is not glibc,
    ``mallopt`` refused, or ``SPCONV_MALLOC_TUNING=0``."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl's mallopt is a no-op)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
