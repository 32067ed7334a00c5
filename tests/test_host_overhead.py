"""Host work per training step of a parallelized model, counted without clocks.

Counted on the second step of a small parallelized U-Net (the first one builds the plans and
labels): the process-group lookups of ``DeviceMesh`` (cached per mesh dim, ``mesh_axis``),
the ``DTensorSpec`` constructions (none: the layers' wrapping reuses cached specs),
the registry lookups of ``SpatialMode`` (only for calls with a DTensor argument: the many
plain-tensor calls inside spatial layers pass straight through) and the aten ops of the
step (no permute views around the window exchanges of strips). The loss matches the plain
model's.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._mode import SpatialMode, _has_dtensor
from spconv_train.parallel._registry import HandlerRegistry
from spconv_train.train import cross_entropy
from tests.dist_harness import mesh


class _AtenCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _counting(undo: list, owner, name: str, counter: collections.Counter, key: str) -> None:
    """Wrap ``owner.name`` to count its calls in ``counter[key]`` (``undo`` restores it)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        counter[key] += 1
        return original(*args, **kwargs)

    undo.append((owner, name, original))
    setattr(owner, name, wrapper)


def _step_counts(world: int) -> dict:
    torch.manual_seed(0)
    plain = create_model("unet", num_classes=3, depth=2, base_width=4).double()
    dmesh = mesh(world)
    model = parallelize(copy.deepcopy(plain), dmesh)
    x = torch.randn(1, 3, 16, 32, dtype=torch.float64)
    t = torch.randint(0, 3, (1, 16, 32))
    xs, ts = distribute_tensor(x, dmesh, [Shard(3)]), distribute_tensor(t, dmesh, [Shard(2)])

    def step() -> float:
        loss = cross_entropy(model(xs), ts)
        loss.backward()
        loss = loss.detach()
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    first = step()
    counts: collections.Counter = collections.Counter()
    undo: list = []
    _counting(undo, DeviceMesh, "get_group", counts, "get_group")
    _counting(undo, DeviceMesh, "get_local_rank", counts, "get_local_rank")
    _counting(undo, HandlerRegistry, "lookup", counts, "lookup")
    _counting(undo, DTensorSpec, "__post_init__", counts, "specs")
    original_tf = SpatialMode.__torch_function__

    def torch_function(self, func, types, args=(), kwargs=None):
        counts["dtensor_calls" if _has_dtensor(args, kwargs or {}) else "plain_calls"] += 1
        return original_tf(self, func, types, args, kwargs)

    undo.append((SpatialMode, "__torch_function__", original_tf))
    SpatialMode.__torch_function__ = torch_function
    try:
        with _AtenCount() as aten:
            step()
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    reference = float(cross_entropy(plain(x), t).detach())
    return {
        **counts,
        "permute": aten.ops["aten.permute.default"],
        "aten": sum(aten.ops.values()),
        "loss": first,
        "reference": reference,
    }


#: upper bounds on the second step at 2 ranks (forward + backward): aten ops (1037 with a
#: permute pair around every window exchange along the width), of which permutes (those of
#: the split halo conv's edge windows)
ATEN_BOUND, PERMUTE_BOUND = 1030, 11


def test_second_step_host_work(dist_pool):
    counts = dist_pool.run(2, _step_counts, 2)
    for rank, c in enumerate(counts):
        assert c["loss"] == pytest.approx(c["reference"], rel=1e-12), rank
        # the mesh's groups and ranks are read once per mesh dim, not per layer and call
        assert c.get("get_group", 0) == 0 and c.get("get_local_rank", 0) == 0, (rank, c)
        # registry lookups (a parent's included) only for calls with a DTensor argument
        assert c["plain_calls"] > c["dtensor_calls"] > 0, (rank, c)
        assert c.get("lookup", 0) <= 2 * c["dtensor_calls"], (rank, c)
        # strips exchange along the last dim: no permute views around the windows
        assert c["permute"] <= PERMUTE_BOUND and c["aten"] <= ATEN_BOUND, (rank, c)
        # the spatial layers wrap and unwrap through cached specs (_dtensor_wrap.py): no
        # DTensorSpec is built in the second step (50 with DTensor.from_local / to_local)
        assert c.get("specs", 0) == 0, (rank, c)
