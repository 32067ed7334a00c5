"""``training.compile: true`` from a YAML config through ``verify`` (issue 26): the compiled
sharded run of LR-ASPP (MobileNetV3) and smp Unet-resnet18 (``compile_mode: default``) and
of the U-Net with ``compile_mode: dtensor_graphs`` equals the eager one-device reference in
float64 (``aot_eager``), every step, with no frame compiled twice. ``run`` compiles the
same way (``train/loop.py``;
``tests/test_train_e2e.py::test_activation_checkpointing_and_compile_change_nothing``
trains the U-Net compiled to eager's weights). ``training.compile_mode`` is validated when
the config loads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch.distributed as dist

from spconv_train.config import ConfigError, load_config

# data sizes: smp's encoders need widths divisible by 2 ** encoder_depth
CONFIGS = {
    "lraspp": """\
model: {name: lraspp_mobilenet_v3_large, num_classes: 3}
data: {height: 16, width: 160, num_train: 2, num_val: 1}
""",
    "smp_unet": """\
model:
  name: smp.Unet
  num_classes: 3
  kwargs: {encoder_name: resnet18, encoder_weights: null, encoder_depth: 3,
           decoder_channels: [16, 8, 4]}
data: {height: 16, width: 64, num_train: 2, num_val: 1}
""",
    "unet": """\
model: {name: unet, num_classes: 3, kwargs: {depth: 2, base_width: 4}}
data: {height: 16, width: 37, num_train: 2, num_val: 1}
""",
}
#: ``training.compile_mode`` per config (the default where not named)
MODES = {"unet": "dtensor_graphs"}
COMPILE = """\
training: {{compile: true, compile_backend: aot_eager, compile_mode: {mode}}}
run_dir: /nonexistent/verify-never-written
"""


def verify_compiled(root: str, name: str) -> dict:
    """``run_verify`` of the YAML config ``name`` with compile on; report and Dynamo's
    frame counts of the first and later steps."""
    import torch._dynamo as dynamo
    from rich.console import Console

    from spconv_train.config import load_config
    from spconv_train.verify import run_verify

    path = Path(root) / f"{name}.yaml"
    if dist.get_rank() == 0:
        path.write_text(CONFIGS[name] + COMPILE.format(mode=MODES.get(name, "default")))
    dist.barrier()
    cfg = load_config(path, [])
    dynamo.reset()
    dynamo.utils.counters.clear()
    report = run_verify(cfg, steps=2, console=Console(file=io.StringIO(), width=150))
    out = report.to_dict()
    out["frames"] = dict(dynamo.utils.counters["frames"])
    out["graph_breaks"] = sum(dynamo.utils.counters["graph_break"].values())
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_compiled(dist_pool, tmp_path, name):
    report = dist_pool.run(2, verify_compiled, str(tmp_path), name)[0]
    assert report["passed"], [c for c in report.get("checks", []) if not c.get("passed", True)][:5]
    assert any("compiled (training.compile" in n for n in report["notes"]), report["notes"]
    assert report["frames"].get("ok", 0) > 0, report["frames"]  # it did compile
    # the default mode is one graph break around the parallelized forward; dtensor_graphs
    # traces the model's code, breaking at each spatial layer
    if MODES.get(name, "default") == "default":
        assert report["graph_breaks"] == 1, report["graph_breaks"]
    else:
        assert report["graph_breaks"] > 1, report["graph_breaks"]


@pytest.mark.parametrize(
    "training,message",
    [
        ("{compile: true, compile_mode: dtensor}", "expected one of 'default', 'trace', "),
        ("{compile_mode: dtensor_graphs}", "training.compile is false; set training.compile"),
    ],
)
def test_compile_mode_checked(tmp_path, training, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"training: {training}\n")
    with pytest.raises(ConfigError, match="training.compile_mode") as err:
        load_config(path, [])
    assert message in str(err.value), err.value
