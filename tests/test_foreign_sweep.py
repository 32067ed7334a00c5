"""Regressions found by ``scripts/sweep_foreign_models.py`` (docs/models.md), on timm
blocks width-sharded in fp64 on uneven strips:

- ConvNeXt-V2's global response norm ends in ``torch.addcmul(bias, weight, x * x_n)`` with
  plain parameters: that was refused ("DTensor has no local rule for it"); now it matches;

and on EdgeNeXt's split transposed-attention block:

- cross-covariance attention multiplies the channel x channel map ``q @ k.T`` (a sum over
  the sharded tokens: a ``Partial`` DTensor) by a plain parameter: that was a bare DTensor
  error ("got mixed torch.Tensor and DTensor"); now it matches one device;
- a Fourier positional encoding built for the whole image (a plain tensor of the
  activation's size computed with a gradient: timm's module under another class name, which
  ``parallel/_token_reduce.py`` does not build per strip) had its gradient all-reduced at full
  size in the backward (a silent gather); now refused naming the module and the op, and
  exact (counted) with ``allow_gather`` (timm's own class: ``tests/test_edgenext_pos.py``);

and on TinyViT's block (windows padded to whole ``ws x ws``, window attention with a bias
table), at 3 ranks with fewer windows than ranks (one rank holds none):

- ``qkv.view(B, N, heads, -1).split(...)`` on the batch of windows (a ``_StridedShard``)
  was refused (DTensor's ``split_with_sizes`` rule replicates it when uneven); now local;
- ``F.scaled_dot_product_attention`` on the rank without windows left its mask's gradient
  sum over the ranks out, and the other ranks hung in it; now every rank joins.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from timm.layers.grn import GlobalResponseNorm
from timm.models.edgenext import PositionalEncodingFourier, SplitTransposeBlock
from timm.models.tiny_vit import TinyVitBlock
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from scripts.sweep_foreign_models import two_width_check
from spconv_train.parallel import SpatialShardingError, parallelize, runtime_of
from spconv_train.parallel._step_meters import CommRecord, grows_with_image
from tests.dist_harness import mesh
from tests.op_check import check_strip_model
from tests.reference import check_close, seeded

TOL = 1e-10


class _WholeImagePos(PositionalEncodingFourier):
    """timm's encoding under another name: built for the whole image on every rank."""


def _block(pos_emb: bool) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    block = SplitTransposeBlock(
        4, num_scales=2, num_heads=2, use_pos_emb=pos_emb, ls_init_value=0.5
    )
    if pos_emb:
        block.pos_embd.__class__ = _WholeImagePos
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), block).double()


def _grn() -> nn.Module:
    torch.manual_seed(0)
    grn = GlobalResponseNorm(4, channels_last=False)
    nn.init.normal_(grn.weight)
    nn.init.normal_(grn.bias)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), grn).double()


class _TinyVit(nn.Module):
    """A conv, then TinyViT's block on the channels-last map (3 x 3 windows, 2 heads)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.block = TinyVitBlock(4, num_heads=2, window_size=3, mlp_ratio=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Planted(nn.Module):
    """A conv whose sharded forward also all-reduces a zero tensor of its output's global
    shape: a planted activation-sized collective (the values are untouched)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if isinstance(y, DTensor):
            dist.all_reduce(torch.zeros(y.shape, dtype=y.dtype))
        return y


def _two_widths(world: int) -> list[str]:
    """The sweep's two-width audit (``scripts/sweep_foreign_models.py``): TinyViT's block on
    a 4 x 5 map (padded to 2 x 2 windows, fewer than 3 ranks) is exact and its bias table's
    gradient, all-reduced at ``(heads, 9, 9)`` whatever the width, is no gather; the planted
    all-reduce of an activation's shape still is, at both widths."""
    failures = two_width_check(_TinyVit, 4, 5, 5 + world, world)
    planted = two_width_check(_Planted, 4, 5, 5 + world, world)
    wider = 5 + world  # the wider run's own gather (a new shape: it grew) is reported too
    want = [f"at width {wider}: gathered activation: allreduce_ (2, 4, 4, {wider})"]
    if planted != [*want, "gathered activation: allreduce_ (2, 4, 4, 5)"]:
        failures.append(f"planted gather: {planted}")
    return failures


def _allowed_gather(world: int, x: torch.Tensor, gy: torch.Tensor) -> list[str]:
    """The positional-encoding block with ``allow_gather``: exact, and the gather counted."""
    model = _block(True)
    par = parallelize(copy.deepcopy(model), mesh(world), allow_gather=True)
    ref = model(x)
    ref.backward(gy)
    xs, gs = (distribute_tensor(t, mesh(world), [Shard(3)]) for t in (x, gy))
    y = par(xs)
    y.backward(gs)
    failures: list[str] = []
    check_close("allowed: output", y, ref, TOL, failures)
    for (name, p), pr in zip(par.named_parameters(), model.parameters(), strict=True):
        check_close(f"allowed: grad {name}", p.grad, pr.grad, TOL, failures)
    if runtime_of(par).stats.gathers == 0:
        failures.append("allowed: the gather was not counted")
    return failures


def sweep_checks(world: int) -> list[str]:
    width = 5 * world + 2  # uneven strips
    x = seeded(1, 2, 3, 6, width, dtype=torch.float64)
    gy = seeded(5, 2, 4, 6, width, dtype=torch.float64)
    failures = []
    for model in (_grn(), _block(False)):
        failures += check_strip_model(model, x, gy, mesh(world), world, traffic=None, tol=TOL)
    try:
        parallelize(_block(True), mesh(world))(distribute_tensor(x, mesh(world), [Shard(3)]))
        failures.append("positional encoding: not refused")
    except SpatialShardingError as exc:
        msg = str(exc)
        for part in ("'1'", "Tensor.add", "plain tensor", "allow_gather=True"):
            if part not in msg:
                failures.append(f"refusal does not name {part}: {msg}")
    return failures + _allowed_gather(world, x, gy) + _two_widths(world)


@pytest.mark.parametrize("world", [2, 3])
def test_timm_blocks_sharded(dist_pool, world):
    res = dist_pool.run(world, sweep_checks, world)
    assert res == [[]] * world, "\n".join(res[0] or res[-1])


def test_grows_with_image():
    """Only the flagged collectives the wider run did not repeat (op, shape, as often)."""

    def rec(op: str, *shape: int) -> CommRecord:
        return CommRecord(op, "reduce", 0, shape)

    attn, bias, act = rec("all_reduce", 2, 3, 8, 8), rec("allreduce_", 4, 9, 9), rec("x", 2, 9)
    wider = [attn, attn, bias, rec("x", 2, 11), rec("all_gather", 2, 9)]
    assert grows_with_image([attn, attn, bias, act], wider) == [act]
    assert grows_with_image([bias, bias], wider) == [bias, bias]  # ran once at the wider size
