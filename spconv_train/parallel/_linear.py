"""``F.linear`` on a DTensor whose last dimension is not sharded.

Classification heads run a ``Linear`` on globally pooled features (``Replicate`` on the sp
dimension, possibly ``Shard(0)`` on dp); token heads (smp Segformer) run it on
``x.flatten(2).transpose(1, 2)`` of a width-sharded map, whose pixels are split over the sp
ranks as a ``_StridedShard``. DTensor refuses to mix its DTensor input with the plain
parameters, so the plain op runs on the local tensor (rows are independent) and the weight
gradient is summed over every mesh dimension whose placement splits the rows
(``sharding_mesh_dims``: ``Shard`` and ``_StridedShard`` alike).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._mode import register_handler
from ._sharding import SpatialLayout, leave, sharded_dim, sharding_mesh_dims


@register_handler(F.linear)  # torch._C._nn.linear is the same object
def _functional_linear(input, weight, bias=None):
    if not isinstance(input, DTensor) or isinstance(weight, DTensor):
        return F.linear(input, weight, bias)  # DTensor parameters: DTensor's own rules
    last = input.ndim - 1
    for p in input.placements:
        if sharded_dim(p) in (last, -1):
            raise SpatialShardingError(
                f"F.linear on a DTensor sharded on its last dimension {input.placements} would "
                f"mix columns of different ranks; pool or reduce the width first."
            )
        if p.is_partial():
            raise SpatialShardingError(
                f"F.linear on a Partial DTensor {input.placements}: redistribute it first."
            )
    mesh, placements = input.device_mesh, tuple(input.placements)
    # Every mesh dimension that splits rows of the input (Shard or _StridedShard) holds a
    # partial sum of the weight gradient.
    groups = tuple(mesh.get_group(i) for i in sharding_mesh_dims(placements))
    out = F.linear(input.to_local(), sum_grad_over(weight, groups), sum_grad_over(bias, groups))
    layout = SpatialLayout(mesh, placements, 0)
    return leave(out, layout, (*input.shape[:-1], out.shape[-1]))
