"""``training.compile``'s default mode adds next to no host work to a step, counted without clocks.

In the default mode the parallelized forward runs eagerly under ``torch.compile`` with one
graph break around it (``parallel/_compile.py``), so a compiled step may cost only Dynamo's
frame entry more than the eager one: counted here after a first step of a small U-Net at
2 ranks with uneven strips, compiled against eager with the same weights, the Python calls
(``cProfile``) and aten ops of one step, and Dynamo's graph count; outputs and gradients
equal bit for bit. (docs/benchmarks.md, ``torch.compile``: the counts of the four models.)
"""

from __future__ import annotations

import copy
import cProfile
import pstats

import torch
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.train import cross_entropy
from tests.dist_harness import mesh
from tests.test_host_overhead import _AtenCount

#: Python calls a compiled step may add (measured: 45-134 for the four models of
#: docs/benchmarks.md at 1-2 ranks, against 10,400-51,700 per step)
EXTRA_CALLS = 300


def _counts(world: int) -> dict:
    import torch._dynamo as dynamo

    dynamo.reset()  # the worker's earlier compiles (other tests) stay out of the count
    torch.manual_seed(0)
    dmesh = mesh(world)
    eager = parallelize(create_model("unet", num_classes=3, depth=2, base_width=4), dmesh)
    compiled = torch.compile(copy.deepcopy(eager), dynamic=False)
    x = torch.randn(1, 3, 16, 37)  # uneven strips
    t = torch.randint(0, 3, (1, 16, 37))
    xs, ts = distribute_tensor(x, dmesh, [Shard(3)]), distribute_tensor(t, dmesh, [Shard(2)])
    out: dict = {}
    dynamo.utils.counters.clear()
    for name, model in (("eager", eager), ("compiled", compiled)):

        def step(model=model):
            y = model(xs)
            cross_entropy(y, ts).backward()
            return y.to_local().detach()

        step()
        calls = []
        for _ in range(2):  # the fewer of two steps: a one-off cache fill is not host work
            profile = cProfile.Profile()
            profile.enable()
            y = step()
            profile.disable()
            calls.append(pstats.Stats(profile).total_calls)
        with _AtenCount() as aten:
            step()
        grads = [p.grad.clone() for p in model.parameters()]
        out[name] = (min(calls), sum(aten.ops.values()), y, grads)
    out["graphs"] = dynamo.utils.counters["stats"]["unique_graphs"]
    return out


def test_compiled_default_mode_adds_no_host_work(dist_pool):
    for r in dist_pool.run(2, _counts, 2):
        (calls_e, aten_e, y_e, g_e), (calls_c, aten_c, y_c, g_c) = r["eager"], r["compiled"]
        assert r["graphs"] == 0  # nothing of the parallelized model is compiled
        assert aten_c == aten_e
        assert calls_c < calls_e + EXTRA_CALLS, (calls_e, calls_c)
        assert torch.equal(y_c, y_e)
        for a, b in zip(g_c, g_e, strict=True):
            assert torch.equal(a, b)
