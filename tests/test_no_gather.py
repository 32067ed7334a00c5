"""No silent gather (issue 9, item 4): an op that would make DTensor gather a width-sharded
activation is refused by default, naming the op and the module; ``allow_gather`` turns it into
a counted warning; ``CommAudit`` (and so ``verify``'s flag) sees DTensor's own collectives."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize, runtime_of
from spconv_train.parallel._errors import GATHER_EVENTS
from spconv_train.parallel._step_meters import CommAudit
from tests.dist_harness import mesh
from tests.reference import rel_err, seeded


class PixelAttention(nn.Module):
    """Attention over all pixels (flatten + matmul), as in smp MAnet's position attention."""

    def forward(self, x):
        b, c, h, w = x.shape
        q = x.flatten(2)
        a = torch.softmax(q.transpose(1, 2) @ q, -1)
        return (q @ a.transpose(1, 2)).reshape(b, c, h, w)


class Gathers(nn.Module):
    def __init__(self, classes: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.attn = PixelAttention()
        self.head = nn.Conv2d(4, classes, 1)

    def forward(self, x):
        f = self.stem(x)
        return self.head(f + self.attn(f))  # residual: the output is width-sharded again


class ExplicitGather(nn.Module):
    """User code that gathers on purpose (``full_tensor``): explicit, so allowed."""

    def forward(self, x):
        return x.full_tensor().mean() + x


def guard_checks() -> dict:
    dmesh = mesh(2)
    x = seeded(1, 1, 3, 4, 10, dtype=torch.float64)
    torch.manual_seed(0)  # the same weights on every rank
    model = Gathers().double()
    out: dict = {}
    try:
        parallelize(copy.deepcopy(model), dmesh)(distribute_tensor(x, dmesh, [Shard(3)]))
    except SpatialShardingError as exc:
        out["refused"] = str(exc)
    before = len(GATHER_EVENTS)
    allowed = parallelize(copy.deepcopy(model), dmesh, allow_gather=True)
    with CommAudit() as audit:
        y = allowed(distribute_tensor(x, dmesh, [Shard(3)]))
    out["events"] = [(e.op, e.module) for e in GATHER_EVENTS[before:]]
    out["stats"] = runtime_of(allowed).stats.gathered_ops
    out["gathers"] = [r.op for r in audit.records if r.kind == "gather"]
    out["err"] = rel_err(y, model(x))
    e = parallelize(ExplicitGather(), dmesh)(distribute_tensor(x, dmesh, [Shard(3)]))
    out["explicit_err"] = rel_err(e, x.mean() + x)
    return out


def test_gathering_model_refused_by_default_allowed_on_request(dist_pool):
    for out in dist_pool.run(2, guard_checks):
        msg = out["refused"]
        assert "aten.bmm" in msg and "'attn'" in msg and "allow_gather=True" in msg, msg
        assert "parallel.allow_gather" in msg
        assert out["events"] and all(m == "attn" for _, m in out["events"]), out["events"]
        assert out["stats"].get("aten.bmm.default", 0) >= 1, out["stats"]
        # the audit now sees DTensor's internal collectives
        assert "all_gather_into_tensor" in out["gathers"], out["gathers"]
        assert out["err"] < 1e-12 and out["explicit_err"] < 1e-12


def verify_gathering_model(allow: bool) -> dict:
    from spconv_train.models.registry import _REGISTRY, register_model
    from tests.test_verify import _verify

    if "test_pixel_attention" not in _REGISTRY:
        register_model("test_pixel_attention")(
            lambda num_classes, in_channels=3: Gathers(num_classes)
        )
    overrides = [
        "model.name=test_pixel_attention",
        "model.num_classes=2",
        "data.height=8",
        "data.width=16",
        "data.num_train=2",
        "data.num_val=1",
        "data.batch_size=1",
        f"parallel.allow_gather={str(allow).lower()}",
        "run_dir=/nonexistent/verify-never-written",
    ]
    try:
        return _verify(overrides, steps=1)
    except SpatialShardingError as exc:
        return {"refused": str(exc)}


def test_verify_flags_a_model_that_gathers(dist_pool):
    refused = dist_pool.run(2, verify_gathering_model, False)[0]
    assert "aten.bmm" in refused.get("refused", ""), refused
    report = dist_pool.run(2, verify_gathering_model, True)[0]
    assert report["verdict"].startswith("FAIL") or "activation-sized" in report["verdict"]
    assert report["activation_sized_collectives"], report["verdict"]
