"""MONAI's UNETR in 3-D (``spatial_dims=3``) on a volume split along W and along H
equals one device in fp64: output, input gradient and every parameter gradient, with no
activation gathered (the attention's keys travel point to point). SwinUNETR in 3-D split
along H and along D: ``tests/test_swin_tiles.py``; larger volumes, other splits and
SwinUNETR split along W: ``scripts/check_foreign_models.py --transformers``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._step_meters import CommAudit
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

pytest.importorskip("einops")  # MONAI's SABlock needs it
pytest.importorskip("monai")
TOL = 1e-10


def monai_3d(kind: str, shape: tuple[int, int, int]) -> nn.Module:
    """A tiny 3-D UNETR (a ViT on 16^3 patches) or SwinUNETR (windows of 4^3), one input
    channel, two classes, built by the model registry as ``model.name: monai.<kind>`` with
    ``spatial_dims: 3`` in a config builds it."""
    if kind == "UNETR":
        kwargs = {"img_size": shape, "feature_size": 4, "hidden_size": 24, "mlp_dim": 32,
                  "num_heads": 2}  # fmt: skip
    else:
        kwargs = {"feature_size": 12, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1),
                  "window_size": 4}  # fmt: skip
    return create_model(
        f"monai.{kind}", num_classes=2, in_channels=1, spatial_dims=3, norm_name="instance",
        **kwargs,
    )  # fmt: skip


def volume_failures(kind: str, shape: tuple[int, int, int], dim: int) -> list[str]:
    """One device against ``parallelize`` with the volume split along tensor dim ``dim``."""
    dmesh = mesh(dist.get_world_size())
    torch.manual_seed(0)  # the same weights on every rank
    model = monai_3d(kind, shape).double()
    par = parallelize(copy.deepcopy(model), dmesh)
    x = seeded(1, 1, 1, *shape, dtype=torch.float64).requires_grad_()
    ref = model(x)
    gy = seeded(2, *ref.shape, dtype=torch.float64)
    ref.backward(gy)
    xs = distribute_tensor(x.detach(), dmesh, [Shard(dim)]).requires_grad_()
    with CommAudit() as audit:
        y = par(xs)
    gys = distribute_tensor(gy, dmesh, [Shard(dim)])
    with audit:
        y.backward(gys)
    where = f"{kind} {shape} Shard({dim})"
    failures: list[str] = []
    check_close(f"{where} output", y, ref, TOL, failures)
    check_close(f"{where} input grad", xs.grad, x.grad, TOL, failures)
    # mathematically zero gradients (a bias before a norm) are rounding noise: compare
    # relative to the largest gradient of the model
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
    got = dict(par.named_parameters())
    for name, g in grads.items():
        check_close(f"{where} {name}.grad", got[name].grad, g, TOL, failures, floor)
    shapes = {tuple(p.shape) for p in model.parameters()}
    big = audit.activation_sized(max(1, xs.to_local().numel() // 4), shapes)
    # the tokens are far smaller than the volume (one per 16^3 voxels): a gather of any
    # size may be theirs (parameters move as "param" records, the ring point to point)
    moved = [r for r in audit.records if r.kind == "gather" or r in big]
    failures += [f"{where}: gathered activation {r.op} {r.shape}" for r in moved]
    return failures


@pytest.mark.parametrize(
    "shape, dim",
    [
        # 3 patches along W: 2 + 1; the patch grid 1 x 1 x 3 makes the tokens a plain Shard
        # (no _StridedShard) that the view back to a volume must keep on W
        ((16, 16, 48), 4),
        # along H, the middle of the flattened 2 x 3 x 2 patch grid, rows 2 + 1: the flatten
        # re-chunks to even chunks of every H' x W' run and the view back to whole rows
        ((32, 48, 32), 3),
    ],
)
def test_unetr_3d_matches_single_device(dist_pool, shape, dim):
    for rank, failures in enumerate(dist_pool.run(2, volume_failures, "UNETR", shape, dim)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
