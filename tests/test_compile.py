"""``torch.compile`` of a parallelized model runs, equals eager (fp64, forward and every
gradient) and really compiles: Dynamo traces the spatial forward, the halo exchanges are
graph breaks and the local ops between them become graphs (issue 11 item 5)."""

from __future__ import annotations

import copy

import torch
import torch._dynamo as dynamo
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded


def compile_compare(world: int) -> list[str]:
    dmesh = mesh(world)
    torch.manual_seed(0)
    eager = parallelize(create_model("unet", num_classes=3, depth=2, base_width=4), dmesh)
    eager = eager.double()
    comp_model = copy.deepcopy(eager)
    compiled = torch.compile(comp_model, backend="aot_eager")
    x = distribute_tensor(seeded(1, 1, 3, 16, 40, dtype=torch.float64), dmesh, [Shard(3)])
    failures: list[str] = []
    dynamo.reset()
    dynamo.utils.counters.clear()
    for run in (eager, compiled):
        run(x).to_local().square().mean().backward()
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    ops = dynamo.utils.counters["stats"]["calls_captured"]
    if graphs < 2 or ops < 50:  # a graph break around the whole forward compiles nothing
        failures.append(f"compile captured {graphs} graphs / {ops} ops: nothing compiled")
    check_close("output", compiled(x), eager(x), 1e-12, failures)
    for (name, p), q in zip(comp_model.named_parameters(), eager.parameters(), strict=True):
        check_close(f"{name} grad", p.grad, q.grad, 1e-12, failures)
    return failures


def test_compiled_parallel_model_equals_eager(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, compile_compare, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
