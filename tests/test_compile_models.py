"""``torch.compile`` of a parallelized model, per model family (issue 26): the built-in
U-Net, torchvision LR-ASPP (MobileNetV3: SE blocks with hardsigmoid/hardswish), smp Unet
on resnet18 (residual adds) and a ConvNeXt-style user block (depthwise 7x7, channels-last
LayerNorm through ``permute``, GELU MLP, transposed-conv head), at 2 ranks, fp64,
``aot_eager``, in the three modes of ``spconv_train/parallel/_compile.py``:
``trace_under_compile`` (Dynamo traces the model's code, graphs of plain tensors only),
``trace_dtensor_ops`` (DTensor ops and element-wise handlers compiled too, graphs with
DTensor inputs; the U-Net's case is ``tests/test_compile.py``) and the default (the
parallelized forward runs eagerly as a whole):

- the compiled forward and every parameter gradient equal eager's over two steps;
- with ``trace_under_compile`` every graph handed to the compiler holds plain tensors only;
  with ``trace_dtensor_ops`` there are graphs and each has DTensor inputs;
- the second step compiles no frame (no recompiles), and the graph breaks stay within the
  counts measured with torch 2.14.1, so a regression in either shows here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.models import create_model, list_models
from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, dropout_off, seeded

# Input shape per model, sharded over its last dimension (W); odd widths give uneven strips
# at 2 ranks (smp's encoders need widths divisible by 2 ** depth, so its strips are even).
# The registry models' widths are the narrowest whose strips hold the deepest layer's halo
# (DeepLabV3's ASPP: dilation 36 at 1/8 or 1/16 resolution); batch 2 for the BatchNorm
# after ASPP's 1 x 1 pooling.
SHAPES = {
    "unet": (2, 3, 16, 37),
    "lraspp_mobilenet_v3_large": (2, 3, 16, 191),
    "smp_unet": (2, 3, 16, 72),
    "convnext": (2, 3, 8, 31),
    "deeplabv3_mobilenet_v3_large": (2, 3, 16, 1201),
    "unet3d": (2, 1, 4, 8, 21),
}
#: registry models built smaller than their defaults (the compile path is the same)
KWARGS = {"unet3d": {"in_channels": 1, "depth": 2, "base_width": 4}}
# (graph breaks, frames compiled) of the first step with ``trace_under_compile``, measured
# with torch 2.14.1 at these sizes: a change in how Dynamo meets the spatial layer (a new
# break per op, a frame compiled per shape) shows as more. smp Unet runs with
# ``trace_dtensor_ops`` instead (``test_dtensor_graphs_equal_eager``): its residual blocks
# are the case that mode changes.
MAX_BREAKS_FRAMES = {"unet": (7, 21), "lraspp_mobilenet_v3_large": (64, 80), "convnext": (12, 26)}


class ConvNeXtStyle(nn.Module):
    """A user model in the ConvNeXt style: stem, a block with a depthwise 7x7 conv,
    channels-last LayerNorm and GELU MLP (via ``permute``), residual add, a strided
    down-sampling conv and a transposed-conv head."""

    def __init__(self, channels: int = 4, num_classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * channels, channels)
        self.down = nn.Conv2d(channels, channels, 2, stride=2)
        self.head = nn.ConvTranspose2d(channels, num_classes, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        x = x + y.permute(0, 3, 1, 2)
        return self.head(self.down(x))


def build(name: str) -> nn.Module:
    """The model in fp64 with dropout off (per-strip masks cannot equal eager's)."""
    torch.manual_seed(0)
    if name == "unet":
        model = create_model("unet", num_classes=3, depth=2, base_width=4)
    elif name in list_models():
        model = create_model(name, num_classes=3, **KWARGS.get(name, {}))
    elif name == "smp_unet":
        model = create_model(
            "smp.Unet",
            num_classes=3,
            encoder_name="resnet18",
            encoder_weights=None,
            encoder_depth=3,
            decoder_channels=(16, 8, 4),
        )
    else:
        model = ConvNeXtStyle()
    dropout_off(model)
    return model.double()


class RecordingBackend:
    """``aot_eager``, recording whether a graph handed to it has a DTensor input."""

    def __init__(self) -> None:
        self.graphs = 0
        self.dtensor_graphs: list[str] = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        kinds = [type(t).__name__ for t in example_inputs if isinstance(t, DTensor)]
        if kinds:
            self.dtensor_graphs.append(f"graph {self.graphs}: {len(kinds)} DTensor inputs")
        return dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _step(run, x) -> DTensor:
    out = run(x)
    out.to_local().square().mean().backward()
    return out.detach()


#: ``parallelize`` options per mode of ``compile_case``
MODES = {
    "default": {},
    "trace": {"trace_under_compile": True},
    "dtensor": {"trace_dtensor_ops": True},
}


def compile_case(name: str, mode: str = "trace", steps: int = 2) -> dict:
    """Eager vs compiled over ``steps`` steps (new input each step); what Dynamo did.
    ``mode``: a key of ``MODES``; graphs with DTensor inputs fail the case unless it is
    ``"dtensor"``."""
    dmesh = mesh(2)
    eager = parallelize(build(name), dmesh, **MODES[mode])
    comp_model = copy.deepcopy(eager)
    backend = RecordingBackend()
    compiled = torch.compile(comp_model, backend=backend, dynamic=False)
    dynamo.reset()
    dynamo.utils.counters.clear()
    failures: list[str] = []
    shape = SHAPES[name]
    frames_first = 0
    for step in range(steps):
        x = seeded(1 + step, *shape, dtype=torch.float64)
        x = distribute_tensor(x, dmesh, [Shard(len(shape) - 1)])
        for m in (eager, comp_model):
            m.zero_grad(set_to_none=True)
        want = _step(eager, x)
        check_close(f"step {step} output", _step(compiled, x), want, 1e-12, failures)
        if step == 0:
            frames_first = dynamo.utils.counters["frames"]["ok"]
        for (pname, p), q in zip(comp_model.named_parameters(), eager.parameters(), strict=True):
            if p.grad is None or q.grad is None:  # smp at depth 3: the deeper stages unused
                if (p.grad is None) != (q.grad is None):
                    failures.append(f"step {step} {pname} grad: None on one side only")
                continue
            check_close(f"step {step} {pname} grad", p.grad, q.grad, 1e-10, failures)
    counters = dynamo.utils.counters
    return {
        "failures": failures + (backend.dtensor_graphs if mode != "dtensor" else []),
        "graphs": backend.graphs,
        "dtensor_graphs": len(backend.dtensor_graphs),
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames_first": frames_first,
        "frames_later": counters["frames"]["ok"] - frames_first,
    }


@pytest.mark.parametrize("name", list(MAX_BREAKS_FRAMES))
def test_compiled_equals_eager(dist_pool, name):
    for rank, res in enumerate(dist_pool.run(2, compile_case, name)):
        assert not res["failures"], f"{name}, rank {rank}:\n" + "\n".join(res["failures"])
        assert res["frames_later"] == 0, f"{name}: {res['frames_later']} frames recompiled"
        breaks, frames = MAX_BREAKS_FRAMES[name]
        got = (res["graph_breaks"], res["frames_first"])
        assert got[0] <= breaks and got[1] <= frames, (
            f"{name}: {got[0]} graph breaks, {got[1]} frames compiled (measured: at most "
            f"{breaks}, {frames}); see spconv_train/parallel/_compile.py"
        )


#: every registry model and the ConvNeXt-style block; LR-ASPP and smp.* compile in this
#: mode from YAML (tests/test_compile_config.py), monai.* are sharded in their own tests.
#: The ResNet-50 models are left out (12 of the test's 20 s): in this mode the frame
#: compiled is the root forward, the same for every model, and their torchvision wrapper
#: runs here in deeplabv3_mobilenet_v3_large (suite time)
SKIPPED = ("smp.", "monai.", "lraspp", "deeplabv3_resnet50", "fcn_resnet50")
DEFAULT_MODE = [n for n in list_models() if not n.startswith(SKIPPED)] + ["convnext"]
#: one step for the torchvision backbones (suite time): in the default mode the frame
#: compiled, and so what could recompile, is the root forward, the same for every model
#: and seen at two steps on the others
ONE_STEP = ("deeplabv3_mobilenet_v3_large",)


def compile_default(names: list[str]) -> dict[str, dict]:
    """``compile_case`` in the default mode for each of ``names``, in one worker call."""
    return {n: compile_case(n, "default", 1 if n in ONE_STEP else 2) for n in names}


def test_default_runs_parallelized_forward_eagerly(dist_pool):
    """Without ``trace_under_compile`` the parallelized forward is one graph break: every
    registry model compiled equals eager, nothing traced inside it, nothing recompiled."""
    missing = [n for n in DEFAULT_MODE if n not in SHAPES]
    assert not missing, f"add an input shape for {missing} to SHAPES in {__file__}"
    for rank, results in enumerate(dist_pool.run(2, compile_default, DEFAULT_MODE)):
        for name, res in results.items():
            assert not res["failures"], f"{name}, rank {rank}:\n" + "\n".join(res["failures"])
            assert res["frames_later"] == 0, f"{name}: {res['frames_later']} frames recompiled"
            assert res["graph_breaks"] == 1 and res["frames_first"] <= 4, (name, res)


# (graph breaks, frames compiled, graphs) of the first step with ``trace_dtensor_ops``,
# torch 2.14.1. smp's ResNet runs its in-place ReLUs and ``out += identity`` eagerly, in
# place (parallel/_compile.py), so it compiles no graph: exact, and no recompile.
MAX_BREAKS_FRAMES_DTENSOR = {"smp_unet": (36, 58, 0), "convnext": (12, 27, 2)}


# the U-Net: tests/test_compile.py; LR-ASPP is exact too but compiles one frame again in
# its second step (docs/benchmarks.md, torch.compile)
@pytest.mark.parametrize("name", list(MAX_BREAKS_FRAMES_DTENSOR))
def test_dtensor_graphs_equal_eager(dist_pool, name):
    """``trace_dtensor_ops``: DTensor ops and element-wise handlers are compiled (graphs
    with DTensor inputs: the ConvNeXt block's GELU and residual add, its ``permute`` views
    eager between graphs; smp's in-place ReLUs and residual adds eager, in place),
    forward and every gradient equal eager, nothing recompiled."""
    for rank, res in enumerate(dist_pool.run(2, compile_case, name, "dtensor")):
        assert not res["failures"], f"{name}, rank {rank}:\n" + "\n".join(res["failures"])
        assert res["frames_later"] == 0, f"{name}: {res['frames_later']} frames recompiled"
        breaks, frames, graphs = MAX_BREAKS_FRAMES_DTENSOR[name]
        assert res["dtensor_graphs"] >= graphs and res["graphs"] == res["dtensor_graphs"], res
        assert res["graph_breaks"] <= breaks and res["frames_first"] <= frames, res
