"""The ring (``_ring.Ring.run``: forward and backward in one loop) with a rank that holds no
token: ring attention (flash kernel and matmul path, one and two pieces per block, plain
and causal through ``RingMask``) and the ring matmuls of attention written out (scores and
apply), against one device in fp64, every gradient. The other ring tests give every rank
tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spconv_train.parallel._attention_explicit import APPLY, SCORES, ring_matmul
from spconv_train.parallel._ring import ring_attention
from spconv_train.parallel._ring_mask import RingMask
from tests.reference import rel_err, seeded
from tests.test_attention import ring_errors, sdpa_reference

TOL = 1e-12
SIZES = (5, 0, 6)  # tokens per rank: rank 1 holds none


def _mine() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """This rank's global token indices (a fixed permutation cut by ``SIZES``) and every
    rank's."""
    perm = torch.randperm(sum(SIZES), generator=torch.Generator().manual_seed(9))
    starts = [sum(SIZES[:r]) for r in range(len(SIZES))]
    cols = tuple(perm[s : s + n] for s, n in zip(starts, SIZES, strict=True))
    return cols[dist.get_rank()], cols


def _errors(errs: dict, tag: str, fn, ref_fn, inputs, idx: torch.Tensor) -> None:
    """``fn`` on this rank's rows ``idx`` of every input against ``ref_fn`` on the whole
    ones: the relative errors of the output and of every input gradient."""
    whole = [t.detach().clone().requires_grad_() for t in inputs]
    ref = ref_fn(*whole)
    g = seeded(31, *ref.shape, dtype=ref.dtype)
    ref_grads = torch.autograd.grad(ref, whole, g)
    mine = [t.detach()[..., idx, :].clone().requires_grad_() for t in inputs]
    out = fn(*mine)
    got = torch.autograd.grad(out, mine, g[..., idx, :])
    errs[f"{tag} out"] = rel_err(out, ref[..., idx, :])
    for i, (a, b) in enumerate(zip(got, ref_grads, strict=True)):
        errs[f"{tag} grad {i}"] = rel_err(a, b[..., idx, :])


def empty_rank_errors() -> dict[str, float]:
    idx, cols = _mine()
    group, errs = dist.group.WORLD, {}
    for ev in (5, 3):  # the CPU flash kernel (same head size) and the matmul path
        reference = sdpa_reference(sum(SIZES), ev, 0.41)
        qkv = reference[0]
        for m in (1, 2):
            ring_errors(errs, f"ev={ev} m={m}", reference, idx, SIZES, scale=0.41, pieces=m)
            mask = RingMask(cols, idx, torch.float64)

            def causal(q, k, v, m=m, mask=mask):
                return ring_attention(q, k, v, group, SIZES, 0.41, pieces=m, mask=mask)

            def ref(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.41)

            _errors(errs, f"causal ev={ev} m={m}", causal, ref, qkv, idx)
    q, k, v = (seeded(40 + i, 2, sum(SIZES), 4, dtype=torch.float64) for i in range(3))
    p = seeded(43, 2, sum(SIZES), sum(SIZES), dtype=torch.float64)
    n = sum(SIZES)

    def scores(a, t):
        return ring_matmul(SCORES, a, t, group, SIZES, cols, n)

    def apply(a, t):
        # a: this rank's rows of the weights over every key (columns in global order)
        return ring_matmul(APPLY, a, t, group, SIZES, cols, n)

    _errors(errs, "scores", scores, lambda a, t: a @ t.transpose(-2, -1), (q, k), idx)
    _errors(errs, "apply", apply, lambda a, t: a @ t, (p, v), idx)
    return errs


@pytest.mark.parametrize("world", [3])
def test_ring_with_an_empty_rank_matches_one_device(dist_pool, world):
    for rank, errs in enumerate(dist_pool.run(world, empty_rank_errors)):
        bad = {k: e for k, e in errs.items() if not e < TOL}
        assert not bad, (rank, bad)
