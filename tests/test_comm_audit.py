"""CommAudit sees halo traffic, reductions and gathers (guards the dispatcher op names)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit, parallelize
from tests.dist_harness import mesh
from tests.reference import seeded


def audit_conv_step() -> dict:
    dmesh = mesh(2)
    model = parallelize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), dmesh)
    x = distribute_tensor(seeded(0, 1, 3, 8, 20), dmesh, [Shard(3)]).requires_grad_()
    with CommAudit() as audit:
        y = model(x)
        y.to_local().sum().backward()
    summary = audit.summary()
    shapes = {tuple(p.shape) for p in model.parameters()}
    flagged_step = audit.activation_sized(40, shapes)
    with CommAudit() as gather_audit:
        y.detach().full_tensor()
    return {
        "summary": summary,
        "flagged_step": flagged_step,
        "flagged_gather": gather_audit.activation_sized(40, shapes),
    }


def test_comm_audit_counts_halo_and_flags_gathers(dist_pool):
    for res in dist_pool.run(2, audit_conv_step):
        # one halo exchange forward and one backward: at least one send and one receive each
        assert res["summary"]["p2p"]["count"] >= 4, res
        assert res["summary"]["reduce"]["count"] == 1  # weight and bias: one bucket
        assert "gather" not in res["summary"]
        assert res["flagged_step"] == []
        assert [r.kind for r in res["flagged_gather"]] == ["gather"]
        assert res["flagged_gather"][0].numel >= 4 * 8 * 10
