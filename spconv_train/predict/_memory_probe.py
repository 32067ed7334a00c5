"""What a rank may use and what a pixel costs: the inputs of the memory plan.

``budget_bytes``: ``--memory-gb`` or, by default, the memory this rank may take without
pushing the machine into the kernel's OOM killer: what it holds now plus ``SAFETY`` of the
available memory (``MemAvailable`` on the CPU, the free memory of the GPU) shared by the
local ranks (``LOCAL_WORLD_SIZE``).

``probe_bytes_per_pixel``: the peak memory of one forward of the plain model over a small
probe on this rank's device, per pixel (``probe_bytes_per_pixel`` says how). The fixed
part (weights, the process) is what the rank holds before it (``current_bytes``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from spconv_train.parallel._step_meters import PeakBytes

__all__ = [
    "CPU_OVERHEAD",
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
#: Resident memory per byte of live tensors on the CPU: glibc's free lists and
#: fragmentation, kernels' own buffers, the halo copies of the sharded forward
#: (measured: docs/benchmarks.md, "Memory-planned predict").
CPU_OVERHEAD = 1.5
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


def probe_bytes_per_pixel(
    model: torch.nn.Module, in_channels: int, stride: int
) -> tuple[float, str]:
    """(bytes per pixel of ``model``'s forward on its device, how it was found), from one
    forward of a small probe (a square of at least 64 pixels, a multiple of ``stride``).
    On a GPU: the allocator's peak over what was allocated before, per pixel. On the
    CPU: the peak of the live tensors (``PeakBytes``; deterministic, unlike the resident
    set, which follows glibc's reuse of freed memory) times ``CPU_OVERHEAD``."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    side = max(64, 2 * stride) + (-max(64, 2 * stride)) % stride
    x = torch.rand(1, in_channels, side, side, generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        return max(peak / side**2, 1.0), "probed (GPU allocator peak)"
    counter = PeakBytes()
    with torch.no_grad(), counter:
        model(x)
    per_pixel = counter.peak / side**2 * CPU_OVERHEAD
    return max(per_pixel, 1.0), f"probed (live tensors x {CPU_OVERHEAD})"


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
