"""``torch.compile`` of a parallelized model runs, equals eager (fp64, forward and every
gradient) and compiles each frame once (issue 11 item 5): the spatial layers and handlers
run eagerly with a graph break around each, element-wise ops between them are compiled
(on CPU only when ``TRACE_ELEMENTWISE_ON_CPU``; see ``parallel/_compile.py``)."""

from __future__ import annotations

import copy

import torch
import torch._dynamo as dynamo
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import _compile, parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded


def _step(run, x) -> None:
    run(x).to_local().square().mean().backward()


def compile_compare(world: int, trace_elementwise: bool) -> list[str]:
    """Eager vs compiled (aot_eager) over three steps: outputs and gradients of every
    step equal, and no frame compiled after the first step (no recompiles)."""
    _compile.TRACE_ELEMENTWISE_ON_CPU = trace_elementwise
    try:
        dmesh = mesh(world)
        torch.manual_seed(0)
        eager = parallelize(create_model("unet", num_classes=3, depth=2, base_width=4), dmesh)
        eager = eager.double()
        comp_model = copy.deepcopy(eager)
        compiled = torch.compile(comp_model, backend="aot_eager", dynamic=False)
        failures: list[str] = []
        dynamo.reset()
        dynamo.utils.counters.clear()
        frames_after_first = None
        for step in range(3):
            x = seeded(1 + step, 1, 3, 16, 40, dtype=torch.float64)
            x = distribute_tensor(x, dmesh, [Shard(3)])
            for m in (eager, comp_model):
                m.zero_grad(set_to_none=True)
            _step(eager, x)
            _step(compiled, x)
            frames = dynamo.utils.counters["frames"]["ok"]
            if step == 0:
                frames_after_first = frames
            elif frames != frames_after_first:
                failures.append(f"step {step}: {frames - frames_after_first} frames recompiled")
            check_close(f"step {step} output", compiled(x), eager(x), 1e-12, failures)
            for (name, p), q in zip(comp_model.named_parameters(), eager.parameters(), strict=True):
                check_close(f"step {step} {name} grad", p.grad, q.grad, 1e-12, failures)
        ops = dynamo.utils.counters["stats"]["calls_captured"]
        relus = sum(isinstance(m, torch.nn.ReLU) for m in eager.modules())
        if trace_elementwise and ops < relus:  # each ReLU is a graph between two layers
            failures.append(f"compile captured {ops} ops for {relus} ReLUs: nothing traced")
        return failures
    finally:
        _compile.TRACE_ELEMENTWISE_ON_CPU = False


def test_compiled_parallel_model_equals_eager(dist_pool):
    for trace in (True, False):
        for rank, failures in enumerate(dist_pool.run(2, compile_compare, 2, trace)):
            assert not failures, f"trace_elementwise={trace}, rank {rank}:\n" + "\n".join(failures)
