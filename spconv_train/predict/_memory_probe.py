"""What a rank may use and what a pixel costs: the inputs of the memory plan.

``budget_bytes``: ``--memory-gb`` or, by default, the memory this rank may take without
pushing the machine into the kernel's OOM killer: what it holds now plus ``SAFETY`` of the
available memory (``MemAvailable`` on the CPU, the free memory of the GPU) shared by the
local ranks (``LOCAL_WORLD_SIZE``).

``probe_bytes_per_pixel``: the peak memory of forwards of the plain model over two probe
bands of different heights, on this rank's device; the difference per pixel is the cost of
one more pixel, without the fixed part (weights, the process). On a GPU the caching
allocator counts it (``max_memory_allocated``). On the CPU no allocator keeps such a count
(tensors come from plain ``malloc``), so the probe reads the kernel's peak resident set
instead: glibc is first asked to give its free pages back (``malloc_trim``, else freed
memory that a probe reuses would hide its cost), the peak is reset to the current
resident set (``/proc/self/clear_refs`` ``5``) and read after the forward (``VmHWM``).
Where that is impossible (not Linux, not glibc), ``FALLBACK_BYTES_PER_PIXEL`` stands in
and the plan says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

__all__ = [
    "FALLBACK_BYTES_PER_PIXEL",
    "SAFETY",
    "budget_bytes",
    "current_bytes",
    "io_bytes_per_pixel",
    "plan_cost",
    "probe_bytes_per_pixel",
]

#: Share of the available memory the ranks of a machine plan to use (the rest: the page
#: cache of the image files, the writers' threads, other processes, estimate errors).
SAFETY = 0.7
#: Bytes per pixel when the probe cannot measure (the default U-Net in fp32 on CPU).
FALLBACK_BYTES_PER_PIXEL = 1000.0
#: Per pixel besides the network: the input read and normalised (3 float copies of
#: ``C`` channels), the logits copied off the device and sliced (2 x ``K`` floats), the
#: int64 arg-max and the rounded probabilities.
_IO_FLOATS_PER_CHANNEL = 3


def io_bytes_per_pixel(in_channels: int, num_classes: int) -> float:
    """Bytes per pixel of a piece outside the network's forward (see above)."""
    return 4.0 * (_IO_FLOATS_PER_CHANNEL * in_channels + 2 * num_classes) + 8 + num_classes


def _status(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_bytes(device: torch.device) -> int:
    """Memory this rank holds now: allocated GPU memory, else the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status("VmRSS") or 0


def _available(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_bytes(device: torch.device, memory_gb: float | None = None) -> int:
    """The per-rank budget: ``memory_gb`` GB, else what the rank holds plus ``SAFETY`` of
    the available memory divided by the local ranks."""
    if memory_gb is not None:
        return int(memory_gb * 1e9)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(current_bytes(device) + SAFETY * _available(device) / local)


def _trim() -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_of(run, device: torch.device) -> int | None:
    """Peak memory added by ``run()`` over what was held before it (None: not measurable)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    _trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        return None
    before = _status("VmRSS")
    run()
    peak = _status("VmHWM")
    return None if before is None or peak is None else peak - before


def probe_bytes_per_pixel(
    model: torch.nn.Module, in_channels: int, stride: int, *, cols: int = 256
) -> tuple[float, str]:
    """(bytes per pixel of ``model``'s forward on its device, how it was found): the growth
    of the peak memory from a ``r x cols`` to a ``2r x cols`` probe band (``r`` about 256
    rows, a multiple of ``stride``), per added pixel."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    rows = max(stride, -(-256 // stride) * stride)
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for r in (rows, 2 * rows, rows, 2 * rows):  # twice: the first forward warms up the kernels
        x = torch.rand(1, in_channels, r, cols, generator=gen).to(device)
        with torch.no_grad():
            peaks.append(_peak_of(lambda x=x: model(x), device))
        del x
    if any(p is None for p in peaks):
        return FALLBACK_BYTES_PER_PIXEL, "default (no peak memory count on this system)"
    grow = (peaks[3] - peaks[2]) / (rows * cols)
    if grow <= 0:  # noise: fall back to the whole peak of the bigger probe per pixel
        grow = peaks[3] / (2 * rows * cols)
    where = "GPU allocator" if device.type == "cuda" else "resident set"
    return max(grow, 1.0), f"probed ({where} peak of {rows}- and {2 * rows}-row bands)"


def plan_cost(model, cfg, stride: int, device: torch.device, memory_gb: float | None) -> tuple:
    """``(bytes per pixel, fixed bytes, budget bytes, how the bytes per pixel were found)``
    of this job (collective): the largest cost and fixed part and the smallest budget over
    the ranks, so that every rank plans the same pieces."""
    import torch.distributed as dist

    bpp, how = probe_bytes_per_pixel(model, cfg.model.in_channels, stride)
    bpp += io_bytes_per_pixel(cfg.model.in_channels, cfg.model.num_classes)
    mine = [bpp, float(current_bytes(device)), -float(budget_bytes(device, memory_gb))]
    agreed = torch.tensor(mine, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(agreed, dist.ReduceOp.MAX)
    bpp, base, budget = agreed.tolist()
    return bpp, int(base), int(-budget), how
