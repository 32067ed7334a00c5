"""Ring attention with key / value blocks travelling in pieces (``_ring.py``): exact
in fp64 against one-device SDPA for every piece count, uneven blocks and pieces with no
tokens; and the peak of live bytes per rank below the whole-block ring's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spconv_train.parallel._ring import auto_pieces, ring_attention
from spconv_train.parallel._step_meters import PeakBytes
from tests.reference import seeded
from tests.test_attention import ring_errors, sdpa_reference

TOL = 1e-12
# tokens per rank: uneven, and one block (2 tokens) with fewer tokens than m = 3 pieces
SIZES = {2: (4, 7), 3: (5, 2, 6)}


def chunked_errors() -> dict[str, float]:
    """The ring op with m in {1, 2, 3} pieces per block, on a random subset of tokens per
    rank, against ``F.scaled_dot_product_attention`` on one device: output and q / k / v
    gradients, for the flash kernel (same head sizes) and the matmul path."""
    rank = dist.get_rank()
    sizes = SIZES[dist.get_world_size()]
    total = sum(sizes)
    start = sum(sizes[:rank])
    idx = torch.randperm(total, generator=torch.Generator().manual_seed(7))
    idx = idx[start : start + sizes[rank]]
    errs = {}
    for ev in (5, 3):
        reference = sdpa_reference(total, ev, 0.41)
        for m in (1, 2, 3):
            ring_errors(errs, f"ev={ev} m={m}", reference, idx, sizes, scale=0.41, pieces=m)
    return errs


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_ring_matches_sdpa(dist_pool, world):
    for rank, errs in enumerate(dist_pool.run(world, chunked_errors)):
        assert max(errs.values()) < TOL, (rank, errs)


def peak_bytes(tokens: int, pieces: tuple[int, ...]) -> dict[int | str, int]:
    """Peak live bytes of this rank over a forward + backward of the ring (fp32, 4 heads of
    16, ``tokens`` per rank) per m, and of one-device SDPA over all the tokens, counted by
    the benchmark's dispatch-mode meter."""
    world = dist.get_world_size()
    peaks = {}
    for m in (*pieces, "one process"):
        with PeakBytes() as meter:
            n = tokens * world if m == "one process" else tokens
            q, k, v = (seeded(i, 1, 4, n, 16).requires_grad_() for i in range(3))
            if m == "one process":
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                out = ring_attention(q, k, v, dist.group.WORLD, (tokens,) * world, pieces=m)
            out.backward(torch.ones_like(out))
            del q, k, v, out
        peaks[m] = meter.peak
    return peaks


def test_chunked_ring_peak_below_whole_blocks(dist_pool):
    # 256 tokens per rank: the automatic choice cuts each block in 4 pieces of 64
    assert auto_pieces((256, 256)) == 4
    unit = 4 * 256 * 16 * 4  # bytes of one rank's q (or k, v, out, ...)
    for peaks in dist_pool.run(2, peak_bytes, 256, (1, 4, 8)):
        # own q, k, v, out, dout, dq, dk, dv: 8 units (one process: twice that and its
        # kernel's 2 more); whole blocks add the block in hand, its gradient accumulator and
        # its gradients, and the kernel's query gradient, 5 units while dk, dv are not home
        # yet; in m pieces 1 + 8 / m units (the query gradient, four pieces' pairs) on top
        assert peaks["one process"] >= 18 * unit, peaks
        assert peaks[1] >= 13 * unit, peaks
        assert peaks[4] <= 11.1 * unit, peaks
        assert peaks[8] <= 10.1 * unit, peaks
        assert peaks[8] <= 0.6 * peaks["one process"], peaks
