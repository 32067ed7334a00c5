"""Host work per training step of a parallelized model, counted without clocks.

Counted on the second step of a small parallelized U-Net (the first one builds the plans and
labels): the process-group lookups of ``DeviceMesh`` (cached per mesh dim, ``mesh_axis``),
the ``DTensorSpec`` constructions (none: the layers' wrapping reuses cached specs),
the registry lookups of ``SpatialMode`` (only for calls with a DTensor argument, not for
property reads: the many plain-tensor calls inside spatial layers pass straight through),
the Python function calls (``cProfile``) and the aten ops of the step (no permute views
around the window exchanges of strips). The loss matches the plain model's. The aten ops
of one sharded batch-norm step are bounded too (its statistics are most of a step's extra
ops), its output and running statistics checked against the plain layer's.
"""

from __future__ import annotations

import collections
import copy
import cProfile
import pstats

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._mode import SpatialMode, _has_dtensor
from spconv_train.parallel._runtime import HandlerRegistry
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
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    reference = float(cross_entropy(plain(x), t).detach())
    return {
        **counts,
        "permute": aten.ops["aten.permute.default"],
        "aten": sum(aten.ops.values()),
        "python_calls": pstats.Stats(profile).total_calls,
        "loss": first,
        "reference": reference,
    }


#: upper bounds on the second step at 2 ranks (forward + backward): aten ops (875 on
#: 2026-11-27; 881 with an unused ``to_local`` per in-place activation, 1037 with a permute
#: pair around every window exchange along the width, 1007 with the batch norm's statistics
#: in (1, C) shapes and one op per running statistic), of which permutes (those of the split
#: halo conv's edge windows), and the Python function calls (``cProfile``: 11 551; 11 919
#: with ``DTensor.__init__`` per crossing and a signature bind per activation, 17 607 with a
#: registry lookup and a generator per torch call in ``SpatialMode``)
ATEN_BOUND, PERMUTE_BOUND, PYTHON_CALLS_BOUND = 880, 11, 11700


def test_second_step_host_work(dist_pool):
    counts = dist_pool.run(2, _step_counts, 2)
    for rank, c in enumerate(counts):
        assert c["loss"] == pytest.approx(c["reference"], rel=1e-12), rank
        # the mesh's groups and ranks are read once per mesh dim, not per layer and call
        assert c.get("get_group", 0) == 0 and c.get("get_local_rank", 0) == 0, (rank, c)
        # registry lookups (a parent's included) only for calls with a DTensor argument
        assert c["plain_calls"] > c["dtensor_calls"] > 0, (rank, c)
        # ... and not for property reads (``x.shape`` on a DTensor: most of those calls)
        assert 4 * c.get("lookup", 0) <= c["dtensor_calls"], (rank, c)
        assert c["python_calls"] <= PYTHON_CALLS_BOUND, (rank, c)
        # strips exchange along the last dim: no permute views around the windows
        assert c["permute"] <= PERMUTE_BOUND and c["aten"] <= ATEN_BOUND, (rank, c)
        # the spatial layers wrap and unwrap through cached specs (_dims.wrap_local): no
        # DTensorSpec is built in the second step (50 with DTensor.from_local / to_local)
        assert c.get("specs", 0) == 0, (rank, c)


def _norm_counts(world: int) -> dict:
    """Aten ops of the second training step of one parallelized ``BatchNorm2d`` (forward,
    backward, running statistics) and of the plain layer; their outputs and gradients."""
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm2d(8).double()
    dmesh = mesh(world)
    model = parallelize(copy.deepcopy(plain), dmesh)
    x = torch.randn(2, 8, 6, 12, dtype=torch.float64)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    counts = {}
    for name, m, inp in (("plain", plain, x), ("sharded", model, xs)):
        for _ in range(2):  # the second step counted
            with _AtenCount() as aten:
                out = m(inp)
                (out * out).sum().backward()
        counts[name] = sum(aten.ops.values())
    full = model(xs).full_tensor()
    counts["close"] = torch.allclose(full, plain(x), rtol=1e-12, atol=1e-12) and all(
        torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(model.buffers(), plain.buffers(), strict=True)
    )
    return counts


#: aten ops of one sharded ``BatchNorm2d`` step at 2 ranks (61 on 2026-11-27: the moments,
#: the merge, the fused kernels and the running statistics; 79 with the statistics reshaped
#: around every kernel call and one update per running statistic); the plain layer: 13
NORM_ATEN_BOUND = 64


def test_batch_norm_step_aten_ops(dist_pool):
    for rank, c in enumerate(dist_pool.run(2, _norm_counts, 2)):
        assert c["close"], (rank, c)
        assert c["sharded"] <= NORM_ATEN_BOUND, (rank, c)


def _scan_cases(world: int) -> list[str]:
    """``_has_dtensor`` on the argument shapes torch functions take (failures listed)."""
    dmesh = mesh(world)
    d = distribute_tensor(torch.randn(2, 4 * world), dmesh, [Shard(1)])
    t = torch.randn(2)
    pair = collections.namedtuple("pair", "a b")

    class Items(list):
        pass

    cases = [
        ((t, 1.0, None, "x", torch.Size([2])), {}, False),
        ((torch.nn.Parameter(t), object()), {}, False),
        ((d,), {}, True),
        ((t,), {"other": d}, True),
        (([t, d],), {}, True),
        (((t, d),), {}, True),
        ((pair(t, d),), {}, True),  # a tuple subclass: its items are scanned too
        ((pair(t, t),), {}, False),
        ((Items([d]),), {}, True),
    ]
    return [f"{a} {k}" for _ in range(2) for a, k, want in cases if _has_dtensor(a, k) != want]


def test_argument_scan_finds_dtensors(dist_pool):
    """The mode's class-based scan (each class classified once) finds a DTensor as an
    argument, a keyword argument or an item of a list, tuple or their subclasses."""
    assert dist_pool.run(1, _scan_cases, 1) == [[]]
