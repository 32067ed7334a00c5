"""Process group and ``(dp, sp)`` device mesh set-up and tear-down.

Launched by torchrun, the usual environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) is read; launched as a plain process, a world-size-1 gloo
group on a free localhost port is created, so every code path (collectives, DCP
checkpoints) is the same in both cases.

The process-group timeout (``SPCONV_TIMEOUT_S``, default 600 s) bounds how long a rank
waits in a collective for a peer that died; torchrun normally tears the other workers down
much sooner, as soon as one worker exits with an error.
"""

from __future__ import annotations

import os
import random
import resource
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DistInfo",
    "build_mesh",
    "env_world_size",
    "gather_all",
    "init_distributed",
    "peak_memory_mb",
    "restart_count",
    "seed_everything",
    "shutdown",
]

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


def _timeout() -> timedelta:
    seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    return timedelta(seconds=seconds)


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"`` -> ``"nccl"`` when CUDA is available, else ``"gloo"``; others unchanged."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def _restart_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The launcher's store under a per-attempt prefix, for workers torchrun restarted.

    torch 2.14's ``env://`` rendezvous reuses the elastic agent's store across restarts
    without a per-attempt prefix, so restarted gloo workers read the previous attempt's
    (dead) peer addresses and fail to connect or hang (seen with ``--max-restarts``). Fresh
    keys per attempt avoid that; the first attempt keeps the plain ``env://`` path.
    """
    host, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500)
    # The agent hosts the store when it says so; otherwise rank 0 does (as env:// would).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host, port, world, is_master=not agent and rank == 0, timeout=timeout, multi_tenant=True
    )
    return dist.PrefixStore(f"spconv_train/attempt_{restart_count()}", store)


def init_distributed(backend: str = "auto") -> DistInfo:
    """Initialise the default process group (once) and pick this rank's device.

    Under torchrun the ``env://`` rendezvous is used (a fresh store prefix after a restart);
    otherwise a world-size-1 group on a free localhost port. ``nccl`` needs CUDA: each rank
    uses ``cuda:LOCAL_RANK``.
    """
    backend = resolve_backend(backend)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = (env_rank(), env_world_size()) if launched else (0, 1)
    local_rank = _env_int("LOCAL_RANK", 0) if launched else 0
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"backend": backend, "timeout": _timeout()}
        if backend == "nccl":
            kwargs["device_id"] = device
        if launched and restart_count() > 0:
            store = _restart_store(rank, world, kwargs["timeout"])
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


def build_mesh(dp: int, sp: int, device_type: str) -> DeviceMesh:
    """The 2-D ``("dp", "sp")`` mesh (``dp`` may be 1).

    Consecutive ranks share one image (rank ``r`` is ``sp`` rank ``r % sp`` of replica
    ``r // sp``), so halo traffic stays between neighbouring ranks, usually on one node.
    """
    if dp * sp != dist.get_world_size():
        raise ValueError(f"mesh {dp}x{sp} does not match world size {dist.get_world_size()}")
    return init_device_mesh(device_type, (dp, sp), mesh_dim_names=("dp", "sp"))


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
    if barrier and multi and not failed:
        dist.barrier()
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
