"""The PhysicsNeMo row of ``bench_conv.py``: NVIDIA PhysicsNeMo's ``ShardTensor`` halo
convolution on the same image and layer (imported only when ``physicsnemo`` is importable;
it is not a dependency of this project). Install it beside the benchmark, into its own
folder, with ``scripts/install_physicsnemo.sh`` (default ``.physicsnemo``), then run
``PYTHONPATH=.:.physicsnemo .venv/bin/python scripts/bench_conv.py``.

Written against nvidia-physicsnemo 2.2.2 (``physicsnemo.domain_parallel``).
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Shard


def physicsnemo_step(conv: nn.Conv2d, img: Tensor, mesh):
    """A forward+backward step of ``conv`` on ``img`` width-sharded as a ``ShardTensor``."""
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
        _device=img.device,
        _cuda=img.is_cuda,
    )
    # ...and its exit hook destroys "its" group, which the benchmark already did: runs
    # after this one (atexit is last-in first-out), so mark it uninitialised first.
    atexit.register(DistributedManager._shared_state.update, _is_initialized=False)

    # Its conv wrappers register automatically only when CUDA is present.
    pdp.register_custom_ops()
    x = pdp.scatter_tensor(img, 0, mesh, (Shard(3),), requires_grad=True)

    def step():
        conv(x.detach().requires_grad_()).sum().backward()

    return step
