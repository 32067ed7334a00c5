"""A plain tensor added to token tensors whose local shards are not the token layout of
their placements (``_token_layout.local_part``): refused with ``SpatialShardingError`` naming the
op, the module and the shard sizes, never a bare size error or a silent broadcast.

The tokens are those of a ``2 x 3 x 2`` patch grid split along its middle dim, rows 2 + 1,
built by ``DTensor.from_local`` as ``_StridedShard(1, split_factor=2)``: that placement
gives each rank 6 tokens (``H' x W'`` chunked evenly), the shards hold 8 and 4."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import device, mesh
from tests.reference import seeded


def add_outcome() -> str:
    """The refusal's text (or what happened instead) on this rank."""
    dmesh = mesh(2)
    rank = dist.get_rank()
    tokens = seeded(1, 1, 12, 4, dtype=torch.float64).to(device())
    rows = (0, 1) if rank == 0 else (2,)
    held = [d * 6 + h * 2 + w for d in range(2) for h in rows for w in range(2)]
    x = DTensor.from_local(
        tokens[:, held], dmesh, [_StridedShard(1, split_factor=2)], run_check=False,
        shape=tokens.shape, stride=tokens.stride(),
    )  # fmt: skip
    pos = seeded(2, 1, 12, 4, dtype=torch.float64).to(device())
    try:
        with SpatialMode():
            x + pos
    except SpatialShardingError as exc:
        return str(exc)
    except RuntimeError as exc:
        return f"bare error: {exc}"
    return "no error"


def test_plain_tensor_on_misheld_tokens_is_refused(dist_pool):
    for rank, text in enumerate(dist_pool.run(2, add_outcome)):
        held = 8 if rank == 0 else 4
        assert "Tensor.add of a token tensor" in text and "'<model>'" in text, (
            f"rank {rank}: {text}"
        )
        assert f"holds {held} entries of dim 1, but those placements give it 6" in text, text
