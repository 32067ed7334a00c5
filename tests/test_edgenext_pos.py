"""timm EdgeNeXt's Fourier positional encoding sharded (``parallel/_token_reduce.py``): each
rank builds its own block of the encoding and projects it locally, in fp64 against one
device, output and every parameter gradient, with no activation-sized collective:

- EdgeNeXt's split transposed-attention block with the encoding (``use_pos_emb``; built for
  the whole image, a plain activation-sized tensor with a gradient, it is refused), on
  uneven strips;
- the encoding times a conv's output on H x W tiles or rows (uneven) and with a
  data-parallel batch split besides the strips.
"""

from __future__ import annotations

import pytest
import torch
from timm.models.edgenext import PositionalEncodingFourier, SplitTransposeBlock
from torch import nn
from torch.distributed.tensor import Shard

from spconv_train.parallel._token_reduce import TIMM_CLASS, fourier_block
from tests.dist_harness import mesh
from tests.meshes import mesh_and_placements
from tests.op_check import check_model_audited, check_strip_model
from tests.reference import seeded

TOL = 1e-10


class _ConvPos(nn.Module):
    """A conv, plus the positional encoding of its output's size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.pos = PositionalEncodingFourier(hidden_dim=4, dim=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, _, h, w = y.shape
        return y * self.pos((b, h, w))


def _block() -> nn.Module:
    torch.manual_seed(0)
    block = SplitTransposeBlock(4, num_scales=2, num_heads=2, ls_init_value=0.5)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), block)


def pos_checks(world: int) -> list[str]:
    width = 5 * world + 2  # uneven strips
    x = seeded(1, 2, 3, 6, width, dtype=torch.float64)
    failures: list[str] = []

    def gy(shape):
        return seeded(5, *shape, dtype=torch.float64)

    model = _block().double().train()
    for f in check_strip_model(model, x, gy, mesh(world), world, traffic=None, tol=TOL):
        failures.append(f"block on strips: {f}")
    rows = seeded(2, 2, 3, 3 * world + 1, 5, dtype=torch.float64)  # uneven rows
    if world == 2:  # H x W tiles (2 x 1), and a data-parallel batch split besides strips
        tiles = mesh_and_placements((2, 1), ("sp_h", "sp_w"))
        layouts = [("tiles", *tiles, rows), ("dp", mesh((2, 1)), [Shard(0), Shard(3)], x)]
    else:  # rows on the strips' mesh (a tile layout too)
        layouts = [("rows", mesh(world), [Shard(2)], rows)]
    for label, dmesh, placements, image in layouts:
        failures += check_model_audited(
            _ConvPos().double(), image, gy, dmesh, placements, traffic=None, tol=TOL,
            label=f"{label}: ",
        )  # fmt: skip
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_edgenext_positional_encoding_sharded(dist_pool, world):
    res = dist_pool.run(world, pos_checks, world)
    assert res == [[]] * world, "\n".join(res[0] or res[-1])


def test_block_matches_timm():
    """The block of rows and columns equals the slice of timm's whole encoding, bitwise
    (before the projection: an identity 1 x 1 conv in fp64), and the class name matches."""
    pos = PositionalEncodingFourier(hidden_dim=6, dim=12).double()
    assert f"{type(pos).__module__}.{type(pos).__qualname__}" == TIMM_CLASS
    with torch.no_grad():
        pos.token_projection.weight.copy_(torch.eye(12, dtype=torch.float64)[:, :, None, None])
        pos.token_projection.bias.zero_()
        whole = pos((1, 7, 13))[0]
    got = fourier_block(6, pos.temperature, pos.scale, (7, 13), slice(2, 5), slice(4, 13))
    assert torch.equal(got.double(), whole[:, 2:5, 4:13])
