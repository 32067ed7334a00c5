"""``training.compile: true`` from a YAML config through ``verify`` (issue 26): the compiled
sharded run of LR-ASPP (MobileNetV3) and smp Unet-resnet18 equals the eager one-device
reference in float64 (``aot_eager``), every step, with no frame compiled twice. ``run``
compiles the same way (``train/loop.py``; ``tests/test_train_e2e.py::
test_compile_changes_nothing`` trains the U-Net compiled to eager's weights)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch.distributed as dist

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
}
COMPILE = """\
training: {compile: true, compile_backend: aot_eager}
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
        path.write_text(CONFIGS[name] + COMPILE)
    dist.barrier()
    cfg = load_config(path, [])
    dynamo.reset()
    dynamo.utils.counters.clear()
    report = run_verify(cfg, steps=2, console=Console(file=io.StringIO(), width=150))
    out = report.to_dict()
    out["frames"] = dict(dynamo.utils.counters["frames"])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_compiled(dist_pool, tmp_path, name):
    report = dist_pool.run(2, verify_compiled, str(tmp_path), name)[0]
    assert report["passed"], [c for c in report.get("checks", []) if not c.get("passed", True)][:5]
    assert any("compiled (training.compile" in n for n in report["notes"]), report["notes"]
    assert report["frames"].get("ok", 0) > 0, report["frames"]  # it did compile
