"""No silent gather outside the forward either: a loss or a metric computed with DTensor's
own ops on a parallelized model's sharded output (``F.cross_entropy(y, t)``, ``y.mean()``
on uneven strips) would make DTensor all-gather the image on every rank; it is refused
naming the op, or with ``allow_gather=True`` logged and counted, exact. Explicit gathers and
meshes no model was parallelized on are left alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit, SpatialShardingError, gloo_threads_idle, parallelize
from spconv_train.parallel._errors import GATHER_EVENTS
from tests.dist_harness import mesh
from tests.reference import seeded


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)).double()


def outside_checks(world: int) -> dict:
    dmesh = mesh(world)
    x = seeded(1, 2, 3, 5, 4 * world + 3, dtype=torch.float64)  # uneven strips
    t = torch.randint(0, 4, (2, 5, x.shape[3]), generator=torch.Generator().manual_seed(2))
    ref = _model()(x)
    want = (F.cross_entropy(ref, t).item(), ref.mean().item())
    out: dict = {"refused": []}
    strict = parallelize(_model(), dmesh)
    y = strict(distribute_tensor(x, dmesh, [Shard(3)]))
    ts = distribute_tensor(t, dmesh, [Shard(2)])
    for name, fn in (("cross_entropy", lambda: F.cross_entropy(y, ts)), ("mean", y.mean)):
        try:
            fn()
            out["refused"].append(f"{name}: not refused")
        except SpatialShardingError as exc:
            out["refused"].append(str(exc))
    out["explicit"] = (y.full_tensor() - ref).abs().max().item()  # explicit: allowed
    before = len(GATHER_EVENTS)
    lenient = parallelize(_model(), dmesh, allow_gather=True)
    y = lenient(distribute_tensor(x, dmesh, [Shard(3)]))
    with CommAudit() as audit:
        got = (F.cross_entropy(y, ts).full_tensor().item(), y.mean().full_tensor().item())
    out["err"] = max(abs(a - b) for a, b in zip(got, want, strict=True))
    out["events"] = [(e.op, e.module) for e in GATHER_EVENTS[before:]]
    out["gathers"] = [r.op for r in audit.records if r.kind == "gather"]
    # a mesh no model was parallelized on: DTensor's own behaviour, untouched
    with gloo_threads_idle():
        other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
    z = distribute_tensor(x, other, [Shard(3)])
    out["other_err"] = abs(z.mean().full_tensor().item() - x.mean().item())
    return out


def test_gathers_outside_the_forward_refused_or_counted(dist_pool):
    for out in dist_pool.run(2, outside_checks, 2):
        ce, mean = out["refused"]
        assert "nll_loss2d_forward" in ce and "outside the parallelized model" in ce, ce
        assert "allow_gather=True" in ce and "to_local()" in ce, ce
        assert "outside the parallelized model" in mean, mean
        assert out["explicit"] < 1e-12
        assert out["err"] < 1e-12, out["err"]
        assert out["events"] and all(m == "<outside the forward>" for _, m in out["events"])
        assert "all_gather_into_tensor" in out["gathers"], out["gathers"]
        assert out["other_err"] < 1e-12
