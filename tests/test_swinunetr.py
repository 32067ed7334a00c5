"""MONAI's SwinUNETR in 2-D (Swin window attention, patch merging, shifted windows, a conv
decoder with instance norm) sharded along W at 2 and 3 ranks equals one device in fp64:
output and every parameter gradient, with no activation-sized collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from tests.dist_harness import mesh
from tests.op_check import check_module
from tests.reference import seeded

TOL = 1e-10


def swinunetr_failures(h: int, w: int) -> list[str]:
    from monai.networks.nets import SwinUNETR

    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)  # the same random weights on every rank (the reference's too)
    model = SwinUNETR(
        in_channels=3,
        out_channels=2,
        feature_size=12,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
        window_size=4,
        spatial_dims=2,
        norm_name="instance",
    ).double()
    x = seeded(1, 1, 3, h, w, dtype=torch.float64)
    failures: list[str] = []
    check_module(model, x, dmesh, [Shard(3)], f"SwinUNETR {h}x{w}", failures, TOL)
    return failures


@pytest.mark.parametrize("world, width", [(2, 96), (3, 160)])
def test_swinunetr_2d_matches_single_device(dist_pool, world, width):
    pytest.importorskip("einops")
    pytest.importorskip("monai")
    # W / 32 = 3 and 5 columns at the deepest stage: 2 + 1 and 2 + 2 + 1, uneven
    for rank, failures in enumerate(dist_pool.run(world, swinunetr_failures, 32, width)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


MONAI_YAML = """\
model:
  name: {name}
  num_classes: 2
  kwargs: {kwargs}
data: {{height: 32, width: 96, num_train: 2, num_val: 1}}
schedule: {{warmup_steps: 2}}
run_dir: /nonexistent/verify-never-written
"""
SWINUNETR = (
    "{feature_size: 12, depths: [1, 1, 1, 1], num_heads: [1, 1, 1, 1], window_size: 4, "
    "norm_name: instance}"
)
# 112 / 16 = 7 patch columns: 3 + 2 + 2 at 3 ranks
UNETR = "{img_size: [32, 112], feature_size: 4, hidden_size: 32, mlp_dim: 64, num_heads: 2}"


@pytest.mark.parametrize(
    "name, kwargs, world, overrides",
    [
        ("monai.SwinUNETR", SWINUNETR, 2, []),
        # UNETR at 2 ranks from the library (tests/test_attention_explicit.py); all three
        # transformer models at 2 and 3 ranks: scripts/check_foreign_models.py --yaml
        ("monai.UNETR", UNETR, 3, ["data.width=112"]),
    ],
)
def test_monai_models_verify_from_yaml(dist_pool, tmp_path, name, kwargs, world, overrides):
    pytest.importorskip("einops")
    pytest.importorskip("monai")
    from tests.test_segformer import verify_yaml

    path = tmp_path / "monai.yaml"
    path.write_text(MONAI_YAML.format(name=name, kwargs=kwargs))
    report = dist_pool.run(world, verify_yaml, str(path), overrides, 2, True)[0]
    assert report["passed"], report["verdict"] + "\n" + "\n".join(map(str, report["failures"][:10]))
    assert report["mesh"] == {"dp": 1, "sp": world}
    assert not report["activation_sized_collectives"]
