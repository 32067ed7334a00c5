"""One shared harness for multi-process tests: real gloo process groups on CPU.

``DistPool`` keeps, per world size, a group of spawned worker processes with an initialised
gloo process group, and runs top-level test functions on every rank of a group at once
(``pool.run(world, fn, *args)`` returns the list of per-rank results). Starting once per
world size instead of once per test keeps the many-case grids fast on 2 cores.

A rank that raises makes ``run`` raise with that rank's traceback; the group is then torn
down and respawned for the next test (a failed collective can leave it unusable). A
process group timeout guards against hangs.

``SPCONV_TEST_DEVICE=cuda`` runs the workers on CUDA with NCCL, one GPU per rank
(``DEVICE``; tests that build their tensors through ``device()`` / ``mesh()`` follow);
a world larger than the GPU count is skipped (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from spconv_train.distributed import free_port, shutdown
from spconv_train.parallel import gloo_threads_idle
from spconv_train.parallel._errors import _SPATIAL_MESHES

# Per call: the fp64 ResNet-50 grids at 3 ranks take ~100 s on 2 idle cores.
TIMEOUT_S = float(os.environ.get("SPCONV_TEST_TIMEOUT", "400"))
#: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
DEVICE = os.environ.get("SPCONV_TEST_DEVICE", "cpu")
_MESHES: dict = {}


def device() -> torch.device:
    """This worker's device: the CPU, or its own GPU under ``SPCONV_TEST_DEVICE=cuda``."""
    if DEVICE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["SPCONV_TEST_WORKER"] = "1"
    # A hung rank is asked for its Python stacks (every thread) before it is killed, so a
    # hang in CI names the line it waits on.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    with gloo_threads_idle():  # as a CPU run does (spconv_train/parallel/_comm_threads.py)
        dist.init_process_group(
            "nccl" if DEVICE == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S / 2),
        )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        # each task starts with no model parallelized on the cached meshes: the guard of
        # DTensor's gathers outside a forward (``_errors._SPATIAL_MESHES``) is process-wide, and
        # an earlier test's model would otherwise switch it on for this one's own calls
        _SPATIAL_MESHES.clear()
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure must reach the test
            results.put((rank, False, traceback.format_exc()))
    shutdown()  # gloo threads back to normal first (parallel/_comm_threads.py)


def mesh(shape: tuple[int, ...] | int, names: tuple[str, ...] | None = None):
    """A (cached) CPU DeviceMesh over all ranks of the current worker group."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = names or (("sp",) if len(shape) == 1 else ("dp", "sp"))
    key = (shape, names)
    if key not in _MESHES:
        with gloo_threads_idle():  # the mesh's groups start threads of their own
            _MESHES[key] = init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    return _MESHES[key]


def _context():
    """The start method of the workers. On CPU a fork server that imported this module
    (torch, spconv_train) and the model libraries most test files use once: each worker
    then starts without its own ~4 s of imports (a fork of the pytest process itself could
    inherit OpenMP / gloo state). CUDA keeps spawn. A library not installed is skipped."""
    if DEVICE == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "spconv_train.models", "segmentation_models_pytorch"])
    return ctx


class _Group:
    def __init__(self, world: int):
        ctx = _context()
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(out) - set(errors))
                dead = {r: self.procs[r].exitcode for r in missing if not self.procs[r].is_alive()}
                if dead:
                    # A killed worker (e.g. by the kernel's OOM killer: exit code -9) never
                    # answers; its peers would wait for the process group timeout.
                    errors[-1] = (
                        f"ranks {sorted(dead)} died (exit codes {dead}; -9: killed, "
                        "e.g. out of memory)"
                    )
                    break
                if time.monotonic() > deadline:
                    errors[-1] = (
                        f"ranks {missing} did not finish within {timeout:.0f} s (hang?); "
                        "their stacks are in the captured stderr"
                    )
                    self.dump_stacks(missing)
                    break
                continue
            (out if ok else errors)[rank] = value
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise AssertionError(
                f"{fn.__name__} failed on rank(s) {sorted(errors)} of {self.world}:\n{report}"
            )
        return [out[r] for r in range(self.world)]

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask the given ranks to print every thread's Python stack to stderr."""
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and self.procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)

    def close(self, force: bool = False) -> None:
        """Ask the workers to leave and wait up to 10 s (``force``: kill them now)."""
        if not force:
            self.ask_to_leave()
        self.reap(time.monotonic() + (0 if force else 10))

    def ask_to_leave(self) -> None:
        for q in self.tasks:
            q.put(None)

    def reap(self, deadline: float) -> None:
        """Wait for the workers until ``deadline`` (``time.monotonic()``), then kill the
        ones still there."""
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()


class DistPool:
    """Worker groups keyed by world size, created on first use."""

    def __init__(self) -> None:
        self.groups: dict[int, _Group] = {}

    def run(self, world: int, fn, *args, timeout: float = TIMEOUT_S, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank of a ``world``-process gloo group and
        return the per-rank results; raise with the traceback if any rank fails."""
        if DEVICE == "cuda" and world > torch.cuda.device_count():
            import pytest

            pytest.skip(f"{world} ranks need {world} GPUs (NCCL: one GPU per rank)")
        group = self.groups.get(world)
        if group is None:
            group = self.groups[world] = _Group(world)
        try:
            return group.run(fn, args, kwargs, timeout)
        except AssertionError:
            group.close(force=True)
            del self.groups[world]
            raise

    def close(self) -> None:
        # every group leaves at once: their gloo shutdowns overlap (one after the other,
        # they added ~20 s to the end of the test run)
        for g in self.groups.values():
            g.ask_to_leave()
        deadline = time.monotonic() + 5
        for g in self.groups.values():
            g.reap(deadline)
        self.groups.clear()


def train_on_group(config: str, sets: list[str], resume: bool = False) -> str:
    """``train()`` of the YAML file ``config`` with the ``--set`` overrides ``sets`` on every
    rank of a worker group, as ``spconv-train run`` runs it under torchrun (without the
    process start-ups); returns this rank's console output (rank 0's holds the run's lines).
    Use through ``dist_pool.run(world, train_on_group, config, sets, resume)``."""
    import contextlib
    import io

    import torch._dynamo
    import torch.distributed as dist

    from spconv_train.config import load_config
    from spconv_train.train import loop

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # the run logger's console writes to sys.stdout
            loop.train(load_config(config, sets), resume=resume)
    finally:
        torch._dynamo.reset()  # a compiled run leaves no compiled code to the next test
    dist.barrier()
    return out.getvalue()
