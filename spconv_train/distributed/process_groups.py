"""Process group and ``(dp, sp)`` device mesh set-up and tear-down.

Launched by torchrun, the usual environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) is read; launched as a plain process, a world-size-1 gloo
group on a free localhost port is created, so every code path (collectives, DCP
checkpoints) is the same in both cases.

The process-group timeout (``init_distributed(timeout_s=...)``, else ``SPCONV_TIMEOUT_S``,
default 600 s) bounds how long a rank waits in a collective for a peer that died; torchrun
normally tears the other workers down much sooner, as soon as one worker exits with an
error. ``is_peer_failure`` and ``first_to_report`` help a failing rank say what happened
once, with its rank, instead of a wall of identical messages or a bare gloo error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import resource
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spconv_train.config import ConfigError
from spconv_train.distributed.cpu_affinity import bind_local_rank
from spconv_train.distributed.cpu_malloc import tune_cpu_allocator
from spconv_train.distributed.launch_store import attempt_store

TIMEOUT_ENV = "SPCONV_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank, world_size, local_rank: as torchrun numbers them (0, 1, 0 for a plain run).
        backend: the process-group backend in use (``"gloo"`` or ``"nccl"``).
        device: this rank's device (``cuda:LOCAL_RANK`` or ``cpu``).
        launched: True when started by torchrun (or another launcher setting ``RANK``).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    launched: bool

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the only rank that writes logs and files)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from exc


def env_world_size() -> int:
    """World size announced by the launcher (1 when not launched by torchrun).

    Readable before any process group exists, so the config can be validated first.
    """
    return _env_int("WORLD_SIZE", 1)


def env_rank() -> int:
    """Global rank announced by the launcher (0 when not launched by torchrun)."""
    return _env_int("RANK", 0)


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def free_port() -> int:
    """A free TCP port on localhost (for single-node process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_timeout_s() -> float:
    """``SPCONV_TIMEOUT_S`` if set, else 600: how long a rank waits for its peers."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError as exc:
        raise RuntimeError(f"environment variable {TIMEOUT_ENV}={value!r} is not a number") from exc
    if not seconds > 0:
        raise RuntimeError(f"environment variable {TIMEOUT_ENV}={value!r} must be positive")
    return seconds


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"`` -> ``"nccl"`` when CUDA is available, else ``"gloo"``; others unchanged."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def gpu_of_local_rank(local_rank: int, local_ranks: int) -> torch.device:
    """``cuda:LOCAL_RANK`` for an NCCL rank, or a ``ConfigError`` that says what to change
    when this node has no CUDA or fewer GPUs than local ranks (NCCL needs one GPU per rank;
    CUDA's own "invalid device ordinal" names neither the cause nor the fix)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("parallel.backend", "nccl needs CUDA, which is not available here; "
                          "use parallel.backend: gloo (or auto) to run on the CPU")  # fmt: skip
    if local_rank >= count:
        raise ConfigError(
            "parallel.backend",
            f"local rank {local_rank} has no GPU: this node has {count} "
            f"GPU(s) for {local_ranks} local ranks and NCCL needs one per rank; start at most "
            f"{count} per node (torchrun --nproc-per-node {count}, or --nproc {count}) or run "
            "on the CPU with --set parallel.backend=gloo",
        )
    return torch.device("cuda", local_rank)


def init_distributed(
    backend: str = "auto", timeout_s: float | None = None, cpu_affinity: bool = True
) -> DistInfo:
    """Initialise the default process group (once) and pick this rank's device.

    Under torchrun the agent's store is used under a prefix of this attempt's own
    (``launch_store.attempt_store``; ``env://`` when the agent hosts none);
    otherwise a world-size-1 group on a free localhost port. ``nccl`` needs CUDA: each rank
    uses ``cuda:LOCAL_RANK``. ``timeout_s``: the group's collective timeout (None:
    ``default_timeout_s()``). On CPU, glibc's malloc thresholds are fixed first
    (``cpu_malloc.tune_cpu_allocator``) and, with ``cpu_affinity``, every local rank is bound
    to its own share of the cores (``cpu_affinity.bind_local_rank``) before gloo starts its
    threads, which are then made ``SCHED_IDLE`` (``parallel.gloo_threads_idle``).
    """
    # here, not at the top: a command that stops before its process group (a refused run
    # folder, --help) starts without the parallel layer (DTensor, Dynamo: seconds of CPU)
    from spconv_train.parallel import gloo_threads_idle

    backend = resolve_backend(backend)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = (env_rank(), env_world_size()) if launched else (0, 1)
    local_rank = _env_int("LOCAL_RANK", 0) if launched else 0
    if backend == "nccl":
        device = gpu_of_local_rank(local_rank, _env_int("LOCAL_WORLD_SIZE", 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # CPU tensors come from malloc: keep a step's pages for the next (cpu_malloc.py).
        tune_cpu_allocator()
        if cpu_affinity and launched and not dist.is_initialized():
            bind_local_rank(local_rank, _env_int("LOCAL_WORLD_SIZE", 1))
    # gloo's threads must not take cores from the compute threads (parallel/_comm_threads.py)
    with gloo_threads_idle() if backend == "gloo" else contextlib.nullcontext():
        if not dist.is_initialized():
            seconds = default_timeout_s() if timeout_s is None else timeout_s
            kwargs = {"backend": backend, "timeout": timedelta(seconds=seconds)}
            if backend == "nccl":
                kwargs["device_id"] = device
            # torchrun's store outlives attempts: a prefix only this attempt shares
            store = attempt_store(rank, world, kwargs["timeout"]) if launched else None
            if store is not None:
                dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
            elif launched:
                dist.init_process_group(init_method="env://", **kwargs)
            else:
                dist.init_process_group(
                    init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kwargs
                )
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=backend,
        device=device,
        launched=launched,
    )


def build_mesh(
    dp: int,
    sp: int,
    device_type: str,
    grid: tuple[int, int] | Mapping[str, int] | None = None,
) -> DeviceMesh:
    """The 2-D ``("dp", "sp")`` mesh (``dp`` may be 1), or with ``grid = (p, q)`` (p * q == sp)
    the 3-D ``("dp", "sp_h", "sp_w")`` mesh of H x W tiles, or with a mapping
    ``{name: ranks}`` (``config.grid_mesh_dims``: ``sp_d`` / ``sp_h`` / ``sp_w``, product
    ``sp``) the ``("dp", *names)`` mesh of volume blocks.

    Consecutive ranks share one image (rank ``r`` is ``sp`` rank ``r % sp`` of replica
    ``r // sp``; tiles and blocks are numbered row-major over the spatial dims), so halo
    traffic stays between neighbouring ranks, usually on one node.
    """
    from spconv_train.parallel import ParallelDims, gloo_threads_idle

    if dp * sp != dist.get_world_size():
        raise ValueError(f"mesh {dp}x{sp} does not match world size {dist.get_world_size()}")
    dims = ParallelDims.of(dp, sp, grid)  # raises for a grid that does not hold sp ranks
    shape, names = dims.shape, dims.names
    # gloo's threads (the mesh's new groups start their own) must not take cores from the
    # compute threads (parallel/_comm_threads.py)
    with gloo_threads_idle() if dist.get_backend() == "gloo" else contextlib.nullcontext():
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def spatial_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The spatial sub-mesh of a ``build_mesh`` mesh: ``("sp",)``, ``("sp_h", "sp_w")`` or
    the volume block dims (every dim but ``"dp"``)."""
    from spconv_train.parallel import ParallelDims

    names = ParallelDims.spatial_names_of(mesh)
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def shutdown(*, barrier: bool = False, failed: bool = False) -> None:
    """Tear the process groups down (safe to call twice, or without any).

    ``barrier``: after a successful run, first meet all ranks at a barrier, so no rank closes
    its connections while a peer may still be finishing a collective. ``failed``: after an
    error (the peers may be stuck anywhere), leave the NCCL groups of a multi-rank job to the
    launcher: destroying them aborts communicators collectively and can hang (torchtitan
    does the same); gloo groups are torn down locally either way.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    multi = dist.get_world_size() > 1
    if failed and multi and dist.get_backend() == "nccl":
        return
    from spconv_train.parallel import restore_gloo_threads

    restore_gloo_threads()  # torn down idle-only, gloo aborted the process (_comm_threads.py)
    if barrier and multi and not failed:
        dist.barrier()
    if dist.get_backend() == "gloo":
        # A gloo worker thread drops its reference to a finished collective (and with it
        # tensors that need the GIL to be freed) only after the waiting rank has moved on.
        # If Python is finalizing by then, the thread is killed inside that destructor and
        # the process aborts ("terminate called without an active exception"; core dump:
        # ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> take_gil -> pthread_exit). Seen
        # after the preemption barrier with the rank's threads bound to one core. A moment
        # with the GIL released lets the worker finish first.
        time.sleep(0.05)
    dist.destroy_process_group()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank in MiB: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def seed_everything(seed: int) -> None:
    """Seed torch, python and numpy: with the same seed every rank builds the same weights."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass


def gather_all(obj: object) -> list:
    """``obj`` of every rank, in rank order, on every rank (small picklable objects only)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# What gloo (and NCCL) say when a peer's process died or closed its connections: the
# failure of this rank is a consequence, the cause is printed by the peer.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",  # NCCL
    "failed on another rank",  # spconv_train.checkpoint's agreement
)


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` only says that another rank went away (its own error is the cause)."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in _PEER_GONE)


def first_to_report(message: str, timeout_s: float = 5.0) -> bool:
    """True on the first rank of the job to report ``message`` (False on later ones).

    Ranks failing together (a layer too wide for every strip, a checkpoint that fits none)
    then print one line instead of one per rank. Uses the process group's store; True when
    there is none or it does not answer within ``timeout_s`` (better twice than never).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=timeout_s))
        key = "spconv_train/reported/" + hashlib.sha1(message.encode()).hexdigest()
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host may be gone: report anyway
        return True
