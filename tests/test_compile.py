"""``torch.compile`` of a parallelized U-Net runs, equals eager (fp64, forward and every
gradient) over three steps and compiles each frame once (issue 11 item 5), with the
``trace_dtensor_ops`` option: its ReLUs, made out of place, (DTensor in, DTensor out) are
compiled graphs (issue 26), every spatial layer a graph break. The default (the
parallelized forward runs eagerly as a whole) and ``trace_under_compile`` are tested per
model family in ``tests/test_compile_models.py``; see ``parallel/_compile.py``."""

from __future__ import annotations

import copy

import torch
import torch._dynamo as dynamo
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded


def _step(run, x) -> None:
    run(x).to_local().square().mean().backward()


def compile_compare(world: int) -> list[str]:
    """Eager vs compiled (aot_eager) over three steps: outputs and gradients of every
    step equal, graphs compiled, and no frame compiled after the first step (no
    recompiles)."""
    dmesh = mesh(world)
    torch.manual_seed(0)
    model = create_model("unet", num_classes=3, depth=2, base_width=4)
    for m in model.modules():  # in-place activations run eagerly in this mode (_compile.py);
        if isinstance(m, torch.nn.ReLU):  # out of place they are the compiled graphs
            m.inplace = False
    eager = parallelize(model, dmesh, trace_dtensor_ops=True).double()
    comp_model = copy.deepcopy(eager)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(comp_model, backend=backend, dynamic=False)
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
    if not graphs:  # the ReLUs between the spatial layers
        failures.append("no graph compiled")
    return failures


def test_compiled_parallel_model_equals_eager(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, compile_compare, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
