"""Attention over pixel tokens on H x W tiles and on rows (issue 23): a map split over two
mesh dims flattens to a token dim split twice (``_tokens.py``: nested layouts), and the
attention ops run their ring over both mesh dims' ranks (``_token_ring.py``). fp64 against
one device (output, every parameter gradient), uneven token counts, ring traffic and no
activation gather: a user-written transformer block (``nn.MultiheadAttention``, SDPA,
spatial-reduction attention, a position embedding), attention written out as matmuls and
einsums, and smp Segformer on ``mit_b0``, at 2 x 2 tiles (4 ranks) and rows (2 ranks on a
``(2, 1)`` mesh). Swin's windows on tiles: ``tests/test_swin_tiles.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from spconv_train.models import create_model
from spconv_train.parallel import parallelize
from spconv_train.parallel._step_meters import CommAudit
from tests.meshes import mesh_and_placements
from tests.reference import check_close, dropout_off, seeded
from tests.test_attention import TokenBlock
from tests.test_attention_explicit import ExplicitBlock
from tests.test_segformer import CASES

TOL = 1e-9
NAMES = ("sp_h", "sp_w")


def _compare(model, x, dmesh, placements, label, failures, seed=None, floor_frac=0.0):
    """``model`` on one device against a ``parallelize``d copy: output, every parameter
    gradient (relative to the largest times ``floor_frac``: mathematically zero ones are
    rounding noise), ring traffic, no activation-sized gather. ``seed``: drawn before both
    forwards (MiT's stochastic depth draws the same masks). The one-device run is rank 0's
    alone (the outputs are maps of 2 channels: the same upstream gradient everywhere)."""
    g = seeded(5, x.shape[0], 2, *x.shape[2:], dtype=x.dtype)
    first = dist.get_rank() == 0
    if first:
        ref = copy.deepcopy(model)
        if seed is not None:
            torch.manual_seed(seed)
        yr = ref(x)
        yr.backward(g)
    par = parallelize(model, dmesh)
    xs, gs = distribute_tensor(x, dmesh, placements), distribute_tensor(g, dmesh, placements)
    if seed is not None:
        torch.manual_seed(seed)
    with CommAudit() as audit:
        y = par(xs)
        y.backward(gs)
    y = y.full_tensor()
    if first:
        check_close(f"{label} output", y, yr, TOL, failures)
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        floor = floor_frac * max(float(t.abs().max()) for t in grads)
        for (n, p), pr in zip(par.named_parameters(), ref.parameters(), strict=True):
            check_close(f"{label} {n}.grad", p.grad, pr.grad, TOL, failures, floor)
    shapes = {tuple(p.shape) for p in par.parameters()}
    moved = audit.activation_sized(max(1, xs.to_local().numel() // 8), shapes)
    failures += [f"{label}: gathered activation {r.op} {r.shape}" for r in moved[:3]]
    if audit.summary().get("p2p", {}).get("count", 0) == 0:
        failures.append(f"{label}: no point-to-point (ring) traffic recorded")


def _segformer(label: str) -> nn.Module:
    name, kwargs = CASES[label]
    torch.manual_seed(0)  # the same weights on every rank
    model = create_model(name, num_classes=2, encoder_name="mit_b0", **kwargs).double().train()
    dropout_off(model)
    return model


def tile_checks(shape: tuple[int, int], seg: tuple[int, int, int]) -> list[str]:
    dmesh, placements = mesh_and_placements(shape, NAMES)
    failures: list[str] = []
    where = f"mesh {shape}"
    # 5 x 7 pixels: rows 3 + 2, columns 4 + 3; the spatial-reduction keys (2 x 3) 1 + 1, 2 + 1
    x = seeded(1, 2, 3, 5, 7, dtype=torch.float64)
    torch.manual_seed(0)
    _compare(TokenBlock(5, 7).double(), x, dmesh, placements, f"{where} block", failures)
    torch.manual_seed(0)
    model = ExplicitBlock().double()
    _compare(model, x, dmesh, placements, f"{where} explicit", failures, floor_frac=1e-4)
    n, h, w = seg  # a stage-4 map of 2 or 3 tokens per split dim: uneven at every stage
    x = seeded(1, n, 3, h, w, dtype=torch.float64)
    model = _segformer("Segformer")
    _compare(model, x, dmesh, placements, f"{where} Segformer", failures, 7, 1e-4)
    return failures


@pytest.mark.parametrize(
    "world, shape, seg",
    [
        (4, (2, 2), (1, 64, 96)),  # 2 x 2 tiles
        (2, (2, 1), (1, 96, 64)),  # rows: H split, W whole
    ],
)
def test_attention_on_tiles_and_rows_matches_one_device(dist_pool, world, shape, seg):
    for rank, failures in enumerate(dist_pool.run(world, tile_checks, shape, seg)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:10])
