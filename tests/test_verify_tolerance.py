"""``verify --dtype config``: tolerances measured against one device's own rounding noise
(issue 8, item 9).

A fixed fp32 ``rtol`` fails correct runs of deep BatchNorm nets (AdamW's first step turns
rounding noise in near-zero gradients into updates of ``lr``). In the training precision a
tensor now also passes when its error is within ``SPREAD_FACTOR`` times the distance of the
one-device run from the same step in float64; a broken halo must still fail.
"""

from __future__ import annotations

import math

import torch

from spconv_train.verify._compare import SPREAD_FACTOR, Check, Collector, floors, resolve_tolerances
from tests.test_verify import _drop_one_halo_column, _failed, verify_cases


def test_spread_criterion():
    tols = resolve_tolerances("fp32")
    check = Check(1, "param", "w", 1e-3, 0.04, 0.04, 1e-4, 0.0)  # rel 2.5e-2 > 1e-4
    assert not check.passed and check.spread == 0.0  # no spread measured: rtol alone
    noisy = Check(1, "param", "w", 1e-3, 0.04, 0.04, 1e-4, 0.0, spread=4e-4)
    assert noisy.passed and math.isclose(noisy.badness, 1e-3 / (SPREAD_FACTOR * 4e-4))
    far = Check(1, "param", "w", 1e-3, 0.04, 0.04, 1e-4, 0.0, spread=1e-3 / SPREAD_FACTOR / 2)
    assert not far.passed and math.isclose(far.badness, 2.0)
    assert noisy.to_dict()["fp64_spread"] == 4e-4 and "fp64_spread" not in check.to_dict()
    # The spread is only known where the reference ran (the reduction takes the maximum),
    # and it is the worst relative noise over the tensors of a kind, times each scale.
    col = Collector(1, tols, floors("fp32"))
    f64 = dict(dtype=torch.float64)
    col.add("grad", "g", torch.tensor([1.0, 2e-3], **f64), torch.tensor([1.0, 0.0], **f64), 3e-4)
    col.add("grad", "h", torch.tensor([4.0, 0.0], **f64), torch.tensor([4.0, 2e-2], **f64))
    col.add("param", "p", torch.tensor([1.0], **f64), torch.tensor([1.0], **f64))
    g, h, p = col.reduce(torch.device("cpu"))
    assert g.scale == 1.0 and h.scale == 4.0
    assert g.spread == 3e-4 and h.spread == 4 * 3e-4 and p.spread == 0.0
    assert g.passed and not g.rel_err <= g.rtol  # 2e-3 <= 10 * 3e-4
    assert not h.passed  # 5e-3 relative: not within 10 * 3e-4 of noise


# The README's false alarm, small: a depth-3 U-Net with BatchNorm, AdamW, fp32, 3 ranks.
DEEP = [
    "model.num_classes=4",
    "model.kwargs={depth: 3, base_width: 8}",
    "data.height=32",
    "data.width=96",
    "data.num_train=4",
    "data.num_val=1",
    "run_dir=/nonexistent/verify-never-written",
]


def verify_config_mode_and_broken_halo(overrides: list[str], steps: int) -> list[dict]:
    """A correct run and a broken-halo run, both in the training precision (fp32)."""
    import spconv_train.parallel._window as window

    correct = verify_cases([(overrides, {"steps": steps, "dtype": "config"})])[0]
    original = window.gather_columns
    window.gather_columns = _drop_one_halo_column(original)
    try:
        broken = verify_cases([(overrides, {"steps": 1, "dtype": "config"})])[0]
    finally:
        window.gather_columns = original
    return [correct, broken]


def test_config_dtype_passes_correct_run_and_fails_broken_halo(dist_pool):
    correct, broken = dist_pool.run(3, verify_config_mode_and_broken_halo, DEEP, 2)[0]
    assert correct["precision"] == "fp32"
    assert correct["passed"], _failed(correct)
    # A fixed rtol would have failed it: some tensors pass only by the measured spread.
    by_spread = [
        c
        for c in correct["checks"]
        if c["max_rel_err"] > c["rtol"] and c["max_abs_err"] > c["atol"]
    ]
    assert by_spread, "expected rounding noise above the fixed fp32 rtol"
    assert all(c["max_abs_err"] <= SPREAD_FACTOR * c["fp64_spread"] for c in by_spread)
    assert any("float64" in n and "spread" in n for n in correct["notes"])
    assert not broken["passed"]
    failed = {(f["step"], f["kind"]) for f in broken["failures"]}
    assert (1, "logits") in failed and (1, "grad") in failed
    worst = broken["failures"][0]
    assert worst["max_abs_err"] > 100 * SPREAD_FACTOR * worst.get("fp64_spread", 0.0)
