"""smp models on the Mix Transformer encoder ``mit_b0`` (SegFormer's, issue 23) run
width-sharded: spatial-reduction attention written as explicit matmuls runs on the ring
(``_attention_explicit.py``). In fp64 and train mode on uneven strips they equal one device
(output, every parameter gradient, buffers) with ring traffic and no activation gather;
from YAML, ``verify`` passes at 2 and 3 ranks, and three training steps of two independent
runs (sharded, one device) stay equal."""

from __future__ import annotations

import pytest
import torch

from spconv_train.models import create_model
from tests.dist_harness import mesh
from tests.op_check import check_strip_model
from tests.reference import dropout_off, seeded

TOL = 1e-9
CASES = {
    "Segformer": ("smp.Segformer", {"decoder_segmentation_channels": 16}),
    "Unet": ("smp.Unet", {"decoder_channels": (16, 8, 8, 8, 8)}),
    "FPN": ("smp.FPN", {"decoder_pyramid_channels": 16, "decoder_segmentation_channels": 32}),
}


def mit_checks(
    world: int, width: int, labels: tuple[str, ...], encoder: str = "mit_b0", batch: int = 1
) -> list[str]:
    dmesh = mesh(world)
    failures: list[str] = []
    x = seeded(1, batch, 3, 32, width, dtype=torch.float64)
    for label in labels:
        name, kwargs = CASES[label]
        torch.manual_seed(0)  # the same weights on every rank
        model = create_model(name, num_classes=2, encoder_name=encoder, **kwargs)
        model = model.double().train()
        dropout_off(model)
        g = seeded(5, batch, 2, 32, width, dtype=torch.float64)
        # MiT's stochastic depth draws per-sample masks: the same draw (seed)
        failures += check_strip_model(
            model,
            x,
            g,
            dmesh,
            world,
            buffers=True,
            tol=TOL,
            label=f"{label} {encoder} @{world} w={width}: ",
        )
    return failures


@pytest.mark.parametrize(
    "world, width, labels",
    [
        # W / 32 = 3 tokens at the last stage: strips 2 + 1; 5: 2 + 2 + 1 (every stage and
        # every spatial-reduction conv splits unevenly; smp needs H, W divisible by 32, and
        # every rank at least one column of the W / 32 stage)
        (2, 96, ("Segformer", "Unet", "FPN")),
        (3, 160, ("Segformer",)),
    ],
)
def test_mit_b0_models_match_one_device(dist_pool, world, width, labels):
    for failures in dist_pool.run(world, mit_checks, world, width, labels):
        assert not failures, failures


SEGFORMER_YAML = """\
model:
  name: smp.Segformer
  num_classes: 3
  kwargs: {encoder_name: mit_b0, decoder_segmentation_channels: 16}
data: {height: 32, width: 96, num_train: 2, num_val: 1}
schedule: {warmup_steps: 2}
run_dir: /nonexistent/verify-never-written
"""


def verify_yaml(path: str, overrides: list[str], steps: int, resync: bool) -> dict:
    """``run_verify`` (``spconv-train verify``) on the config at ``path`` + ``overrides``."""
    import io

    from rich.console import Console

    from spconv_train.config import load_config
    from spconv_train.verify import run_verify

    cfg = load_config(path, overrides)
    console = Console(file=io.StringIO(), width=150)
    return run_verify(cfg, console=console, steps=steps, resync=resync).to_dict()


@pytest.mark.parametrize(
    "world, overrides, steps, resync",
    [
        (2, [], 3, False),  # three steps of two independent runs: a training equality
        (3, ["data.width=160"], 1, True),
    ],
)
def test_segformer_mit_b0_verify_from_yaml(dist_pool, tmp_path, world, overrides, steps, resync):
    path = tmp_path / "segformer.yaml"
    path.write_text(SEGFORMER_YAML)
    report = dist_pool.run(world, verify_yaml, str(path), overrides, steps, resync)[0]
    assert report["passed"], report["verdict"] + "\n" + "\n".join(map(str, report["failures"][:10]))
    assert report["mesh"] == {"dp": 1, "sp": world}
    assert len({c["step"] for c in report["checks"]}) == steps
    for step in report["comms"]:
        comms = step["max_per_rank"]
        assert comms["p2p"]["count"] > 0 and "gather" not in comms
    assert not report["activation_sized_collectives"]
    assert any("stochastic depth" in n for n in report["notes"])
