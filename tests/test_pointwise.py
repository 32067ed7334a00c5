"""Element-wise activations, dropout, Linear heads and width-replicated tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import parallelize
from tests.dist_harness import mesh
from tests.reference import compare_module, seeded


class Activations(nn.Module):
    """Every routed activation, in-place flags included."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a = F.hardswish(y.clone(), inplace=True) + F.hardsigmoid(y) + F.relu6(y) + F.silu(y)
        b = F.gelu(a) + F.leaky_relu(a.clone(), 0.1, True) + F.elu(a) + F.mish(a)
        c = F.relu(b.clone(), True) + b
        return F.softplus(c) + F.hardtanh(c, -0.5, 0.5) + F.selu(c) + F.logsigmoid(c)


class PooledHead(nn.Module):
    """DeepLab-style pooled branch: global pool -> 1x1 conv -> BN -> upsample back, plus a
    Linear classifier on the pooled features (width-replicated tensors)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.proj = nn.Conv2d(6, 6, 1, bias=False)  # a bias before BN has zero gradient
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        f = self.conv(x)
        p = F.relu(self.bn(self.proj(self.pool(f))))
        up = F.interpolate(p, size=f.shape[-2:], mode="bilinear", align_corners=False)
        logits = self.fc(torch.flatten(p, 1))
        return f + up + 0.1 * logits[:, :1].reshape(-1, 1, 1, 1)


def pointwise_checks(shape: tuple[int, ...]) -> list[str]:
    dmesh = mesh(shape)
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    failures: list[str] = []
    torch.manual_seed(0)
    for label, model in (("activations", Activations()), ("pooled head", PooledHead())):
        for kind in ("shard", "replicate"):
            x = seeded(3, 4, 3, 6, 23)
            # fp32: a bias gradient sums every pixel's term, in an order that depends on the
            # strips (the split convolution adds interior and edge columns separately).
            compare_module(model, x, dmesh, placements, kind, f"{label} {kind}", failures, tol=3e-5)
    return failures


def test_activations_and_width_replicated_branches(dist_pool):
    for shape in ((1,), (3,)):
        world = shape[0]
        assert not dist_pool.run(world, pointwise_checks, shape)[0]
    for failures in dist_pool.run(4, pointwise_checks, (2, 2)):
        assert not failures, failures


def dropout_checks() -> dict:
    dmesh = mesh(2)
    model = parallelize(nn.Sequential(nn.Dropout2d(0.5), nn.Dropout(0.3)), dmesh).train()
    x = distribute_tensor(seeded(1, 2, 16, 3, 10).abs() + 1.0, dmesh, [Shard(3)])
    torch.manual_seed(42)
    y = model[0](x).to_local()
    z = model(x).to_local()
    after = torch.rand(3)  # the global RNG must be in step on every rank
    channel_kept = (y[:, :, 0, 0] != 0).tolist()  # the same channels on every strip
    return {"kept": channel_kept, "after": after.tolist(), "z_zero": float((z == 0).float().mean())}


def test_dropout_keeps_ranks_in_step(dist_pool):
    r0, r1 = dist_pool.run(2, dropout_checks)
    assert r0["kept"] == r1["kept"]
    assert r0["after"] == r1["after"]
    assert 0.3 < r0["z_zero"] < 0.9  # both dropouts really dropped something


def test_inplace_flag_position():
    """The element-wise handlers find ``inplace`` by position without binding the signature."""
    from spconv_train.parallel._pointwise import _inplace_at

    assert (_inplace_at(F.relu), _inplace_at(F.leaky_relu), _inplace_at(F.hardtanh)) == (0, 1, 2)
    assert _inplace_at(torch.relu) is None and _inplace_at(F.gelu) is None
