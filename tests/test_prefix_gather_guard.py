"""A plain tensor the model computed with a gradient at the token grid's size (a position
table interpolated from a parameter) joined to width-sharded tokens on the prefix-token
paths of ``parallel/_token_prefix.py``: its gradient would be all-reduced at full size in
the backward (a gather). Concatenated along the channels to tokens behind a class token,
or put in front of the tokens as grid-long prefix tokens, it is refused naming the module
and the op, and with ``allow_gather`` it runs exact (fp64, 2 ranks, uneven strips) with the
gather counted. A class token computed from parameters (``cls + pos[:, :1]``) stays allowed
and exact: its gradient sum is a class token's size."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize, runtime_of
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

TOL = 1e-10


class Join(nn.Module):
    """Pixel tokens and ``pos`` (computed, ``(N, L, C)``) joined by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.cls = how, nn.Parameter(torch.randn(1, 1, 4))

    def forward(self, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cls = self.cls.expand(t.shape[0], -1, -1)
        if self.how == "channels":  # tokens behind a class token, the table beside them
            t = torch.cat([cls, t], 1)
            return torch.cat([t, torch.cat([cls * 0, pos], 1)], -1)[:, 1:]
        if self.how == "front":  # the table as prefix tokens
            return torch.cat([pos, t], 1)[:, pos.shape[1] :]
        # a class token computed from parameters (its gradient sum is a token's size)
        return torch.cat([cls + pos[:, :1], t], 1)[:, 1:]


class Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 4, 1)
        self.pos = nn.Parameter(torch.randn(1, 4, 2, 3))
        self.join = Join(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        t = self.proj(x).flatten(2).transpose(1, 2)
        pos = F.interpolate(self.pos, size=(h, w), mode="bilinear").flatten(2).transpose(1, 2)
        out = self.join(t, pos.expand(n, -1, -1))
        return out.transpose(1, 2).reshape(n, -1, h, w)


def _exact(how: str, x: torch.Tensor, allow: bool) -> tuple[list[str], int]:
    """Failures against one device and the gathers counted."""
    torch.manual_seed(0)
    model = Model(how).double()
    par = parallelize(copy.deepcopy(model), mesh(2), allow_gather=allow)
    ref = model(x)
    gy = seeded(2, *ref.shape, dtype=torch.float64)
    ref.backward(gy)
    y = par(distribute_tensor(x, mesh(2), [Shard(3)]))
    y.backward(distribute_tensor(gy, mesh(2), [Shard(3)]))
    failures: list[str] = []
    check_close(f"{how}: output", y, ref, TOL, failures)
    for (name, p), pr in zip(par.named_parameters(), model.parameters(), strict=True):
        if p.grad is not None or pr.grad is not None:  # "front" leaves the class token unused
            check_close(f"{how}: grad {name}", p.grad, pr.grad, TOL, failures)
    return failures, runtime_of(par).stats.gathers


def guard_checks() -> dict:
    x = seeded(1, 2, 3, 4, 9, dtype=torch.float64)  # 9 columns: uneven strips
    out: dict = {"refusals": {}, "failures": [], "gathers": {}}
    for how in ("channels", "front"):
        torch.manual_seed(0)
        try:
            parallelize(Model(how).double(), mesh(2))(distribute_tensor(x, mesh(2), [Shard(3)]))
            out["refusals"][how] = "not refused"
        except SpatialShardingError as exc:
            out["refusals"][how] = str(exc)
        failures, out["gathers"][how] = _exact(how, x, allow=True)
        out["failures"] += failures
    failures, out["gathers"]["class token"] = _exact("class token", x, allow=False)
    out["failures"] += failures
    return out


def test_computed_plain_on_prefix_paths_refused_or_counted(dist_pool):
    for res in dist_pool.run(2, guard_checks):
        assert res["failures"] == [], res["failures"]
        for how, msg in res["refusals"].items():
            for part in ("module 'join'", "(torch.cat)", "plain tensor", "allow_gather=True"):
                assert part in msg, (how, msg)
        assert "prefix tokens" in res["refusals"]["front"], res["refusals"]["front"]
        assert res["gathers"] == {"channels": 1, "front": 1, "class token": 0}, res["gathers"]
