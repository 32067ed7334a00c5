"""In-place element-wise calls change their input on sharded activations, as on one device.

``F.relu(x, inplace=True)`` called for its side effect (and ``nn.ReLU(inplace=True)``
whose result is dropped) must leave ``x`` changed: a handler that ran it out of place
returned the right value but left ``x`` as it was, and the model went on with the
un-activated map (a silent difference from one device). ReLU6, hardtanh, hardswish and
hardsigmoid in place also need DTensor's backward rule that ``install`` adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.reference import compare_module, seeded

#: every element-wise function with an in-place flag, as a statement-form call
IN_PLACE = {
    "relu": lambda t: F.relu(t, inplace=True),
    "relu6": lambda t: F.relu6(t, inplace=True),
    "hardtanh": lambda t: F.hardtanh(t, -0.7, 0.4, inplace=True),
    "hardswish": lambda t: F.hardswish(t, inplace=True),
    "hardsigmoid": lambda t: F.hardsigmoid(t, inplace=True),
    "silu": lambda t: F.silu(t, inplace=True),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2, inplace=True),
    "leaky_relu positional": lambda t: F.leaky_relu(t, 0.2, True),
    "hardtanh positional": lambda t: F.hardtanh(t, -0.7, 0.4, True),
    "elu": lambda t: F.elu(t, inplace=True),
    "selu": lambda t: F.selu(t, inplace=True),
    "celu": lambda t: F.celu(t, inplace=True),
    "mish": lambda t: F.mish(t, inplace=True),
    "nn.ReLU(inplace=True)": nn.ReLU(inplace=True),
}


class SideEffect(nn.Module):
    """Conv, then an in-place activation whose result is dropped, then a conv of ``y``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x) * 1.5
        IN_PLACE[self.name](y)  # result dropped: y itself must change
        return self.head(y)


def in_place_checks(world: int, names: list[str]) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    torch.manual_seed(0)
    for name in names:
        x = seeded(7, 2, 3, 5, 11, dtype=torch.float64)  # 11 columns: uneven at 2 and 3
        model = SideEffect(name).double()
        compare_module(model, x, dmesh, [Shard(3)], "shard", name, failures)
    return failures


def test_in_place_activations_change_their_input(dist_pool):
    names = list(IN_PLACE)
    for world in (2, 3):  # the functions spread over both world sizes
        for failures in dist_pool.run(world, in_place_checks, world, names[world - 2 :: 2]):
            assert not failures, failures


def dropout_in_place() -> dict:
    dmesh = mesh(2)
    x = distribute_tensor(seeded(3, 2, 4, 3, 9).abs() + 1.0, dmesh, [Shard(3)])
    out = {}
    for name, fn in (("dropout", F.dropout), ("dropout2d", F.dropout2d)):
        with torch.no_grad():
            y = x.clone()
            with SpatialMode():
                torch.manual_seed(5)
                ref = fn(y, 0.5, True)
                torch.manual_seed(5)
                res = fn(y, 0.5, True, inplace=True)
        out[name] = {
            "same_object": res is y,
            "equal": bool(torch.equal(y.to_local(), ref.to_local())),
            "dropped": float((y.to_local() == 0).float().mean()),
        }
    return out


def test_dropout_in_place_changes_its_input(dist_pool):
    for res in dist_pool.run(2, dropout_in_place):
        for name, r in res.items():
            assert r["same_object"] and r["equal"], (name, r)
            assert 0.1 < r["dropped"] < 0.9, (name, r)
