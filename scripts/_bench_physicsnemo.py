"""The PhysicsNeMo rows of the benchmarks: NVIDIA PhysicsNeMo's ``ShardTensor`` halo
convolution (``bench_conv.py``) and its ring attention (``bench_attention.py``), imported
only when ``physicsnemo`` is importable (it is not a dependency of this project). Install it
beside the benchmark, into its own folder, with ``scripts/install_physicsnemo.sh`` (default
``.physicsnemo``), then run e.g.
``PYTHONPATH=.:.physicsnemo .venv/bin/python scripts/bench_conv.py``.

Written against nvidia-physicsnemo 2.2.2 (``physicsnemo.domain_parallel``).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Shard


def attach_manager(device: torch.device) -> None:
    """Point PhysicsNeMo's ``DistributedManager`` at the benchmark's existing process group
    and register its ``ShardTensor`` wrappers (convolution, SDPA, ...)."""
    import physicsnemo.domain_parallel as pdp
    from physicsnemo.distributed import DistributedManager

    # PhysicsNeMo keeps its own view of the process group in a shared-state singleton that
    # its setup() fills while creating the group; the benchmark's group already exists.
    DistributedManager._shared_state.update(
        _is_initialized=True,
        _distributed=True,
        _rank=dist.get_rank(),
        _world_size=dist.get_world_size(),
        _local_rank=dist.get_rank() % max(torch.cuda.device_count(), 1),
        _device=device,
        _cuda=device.type == "cuda",
    )
    # ...and its exit hook destroys "its" group, which the benchmark already did: runs
    # after this one (atexit is last-in first-out), so mark it uninitialised first.
    atexit.register(DistributedManager._shared_state.update, _is_initialized=False)

    # Its wrappers register automatically only when CUDA is present.
    pdp.register_custom_ops()


def physicsnemo_step(conv: nn.Conv2d, img: Tensor, mesh):
    """A forward+backward step of ``conv`` on ``img`` width-sharded as a ``ShardTensor``."""
    import physicsnemo.domain_parallel as pdp

    attach_manager(img.device)
    x = pdp.scatter_tensor(img, 0, mesh, (Shard(3),), requires_grad=True)

    def step():
        conv(x.detach().requires_grad_()).sum().backward()

    return step


def physicsnemo_attention_step(
    shape: tuple[int, int, int, int], sizes: tuple[int, ...], mesh, device: torch.device
) -> tuple[Callable[[], None], float]:
    """PhysicsNeMo's ring attention: a forward+backward step of
    ``F.scaled_dot_product_attention`` on fresh ``1 x heads x L_rank x E`` q, k, v of this
    rank, wrapped as ``ShardTensor`` sequence shards (``sizes``: ``L_rank`` of every rank);
    and the max abs difference of its output from plain SDPA on a ``shape`` sequence
    scattered with ``scatter_tensor`` (checked once here).

    PhysicsNeMo 2.2.2 routes sharded q, k, v to its ``RingSDPA``
    (``physicsnemo/domain_parallel/shard_utils/attention_patches.py``), built on CUDA streams
    and ``aten._scaled_dot_product_efficient_attention``, which has no CPU kernel: on CPU
    the check raises, and the benchmark reports that instead of a row of numbers."""
    import physicsnemo.domain_parallel as pdp
    from physicsnemo.domain_parallel import ShardTensor

    attach_manager(device)
    torch.manual_seed(0)  # the same whole sequence on every rank
    q, k, v = (torch.randn(shape, device=device) for _ in "qkv")
    shards = (pdp.scatter_tensor(t, 0, mesh, (Shard(2),)) for t in (q, k, v))
    try:
        diff = (
            F.scaled_dot_product_attention(*shards).full_tensor()
            - F.scaled_dot_product_attention(q, k, v)
        ).abs()
    except (RuntimeError, NotImplementedError) as exc:
        if device.type == "cuda":
            raise
        raise RuntimeError(
            "needs CUDA (PhysicsNeMo's RingSDPA: CUDA streams, memory-efficient SDPA kernel"
            " with no CPU kernel); run with --device cuda"
        ) from exc
    local = [(1, shape[1], n, shape[3]) for n in sizes]
    rank = dist.get_rank()

    def step() -> None:
        torch.manual_seed(rank)
        # explicit shard shapes: wrapping needs no communication
        qkv = (
            ShardTensor.from_local(
                torch.randn(local[rank], device=device).requires_grad_(),
                mesh,
                (Shard(2),),
                sharding_shapes={0: local},
            )
            for _ in "qkv"
        )
        out = F.scaled_dot_product_attention(*qkv)
        out.backward(torch.ones_like(out))

    return step, diff.max().item()
