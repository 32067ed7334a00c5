"""``train_step``: the one step function ``run`` and ``verify`` both execute (single process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spconv_train.train.step import TrainingStopped, train_step
from tests.reference import seeded


def _setup(lr: float = 0.1):
    torch.manual_seed(0)
    model = nn.Conv2d(2, 3, 3, padding=1).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x = seeded(1, 2, 2, 5, 7, dtype=torch.float64)
    t = (seeded(2, 2, 5, 7).abs() * 2).long().clamp(max=2)
    return model, opt, sched, x, t


def _loss(y, t):
    return nn.functional.cross_entropy(y, t)


def test_step_matches_hand_written_step_and_sees_raw_grads():
    model, opt, sched, x, t = _setup()
    ref = nn.Conv2d(2, 3, 3, padding=1).double()
    ref.load_state_dict(model.state_dict())
    _loss(ref(x), t).backward()
    raw = ref.weight.grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1e-3)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad

    seen = {}
    done = train_step(
        model,
        x,
        t,
        _loss,
        opt,
        sched,
        params=list(model.parameters()),
        grad_clip=1e-3,
        step=0,
        after_backward=lambda: seen.update(w=model.weight.grad.clone()),
    )
    assert torch.equal(seen["w"], raw)  # recorded before clipping
    assert done.grad_norm == pytest.approx(float(norm))
    assert done.lr == 0.1 and opt.param_groups[0]["lr"] == 0.05  # scheduler stepped
    assert all(p.grad is None for p in model.parameters())  # cleared
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_non_finite_loss_stops_before_any_update():
    model, opt, sched, x, t = _setup()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(TrainingStopped, match="non-finite loss .* at step 4"):
        train_step(
            model,
            x * float("nan"),
            t,
            _loss,
            opt,
            sched,
            params=list(model.parameters()),
            grad_clip=None,
            step=3,
        )
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
