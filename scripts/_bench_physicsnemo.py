"""The PhysicsNeMo row of ``bench_conv.py``: NVIDIA PhysicsNeMo's ``ShardTensor`` halo
convolution on the same image and layer (imported only when ``physicsnemo`` is importable;
it is not a dependency of this project). Install it beside the benchmark in its own venv::

    python -m venv /tmp/pn && /tmp/pn/bin/pip install nvidia-physicsnemo torch==2.14.1 \
        torchvision==0.29.1 && /tmp/pn/bin/pip install -e .   # then run bench_conv with it

Written against nvidia-physicsnemo 2.2.2 (``physicsnemo.domain_parallel``).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import Shard


def physicsnemo_step(conv: nn.Conv2d, img: Tensor, mesh):
    """A forward+backward step of ``conv`` on ``img`` width-sharded as a ``ShardTensor``."""
    import physicsnemo.domain_parallel as pdp

    # Its conv wrappers register automatically only when CUDA is present.
    pdp.register_custom_ops()
    x = pdp.scatter_tensor(img, 0, mesh, (Shard(3),), requires_grad=True)

    def step():
        conv(x.detach().requires_grad_()).sum().backward()

    return step
