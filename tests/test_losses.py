"""Losses and metrics on width-sharded logits against the single-device computation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from spconv_train.parallel import parallelize
from spconv_train.train import (
    ConfusionMatrix,
    ce_dice_loss,
    cross_entropy,
    dice_loss,
    dice_loss_reference,
    focal_loss,
    focal_loss_reference,
    local_target,
    metrics_from_confusion,
    shard_like,
    tversky_loss,
    tversky_loss_reference,
)
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

K, H, TOL = 5, 3, 1e-5
WEIGHT = torch.tensor([0.5, 2.0, 1.0, 0.25, 1.5])


def make_target(seed: int, n: int, w: int, ignore: int = 255, frac: float = 0.2) -> torch.Tensor:
    """Seeded labels in [0, K) with a fraction ``frac`` of ``ignore`` pixels."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, K, (n, H, w), generator=g)
    return t.masked_fill(torch.rand(n, H, w, generator=g) < frac, ignore)


def _ce_ref(x, t, **kw):
    return F.cross_entropy(x, t, ignore_index=kw.get("ignore_index", 255), **_ce_kw(kw))


def _ce_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k in ("weight", "label_smoothing")}


def _dice_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k in ("ignore_index", "smooth", "include_background")}


# (name, sharded loss, reference loss, keyword arguments, ignore label)
CASES = [
    ("ce", cross_entropy, _ce_ref, {}),
    ("ce weight", cross_entropy, _ce_ref, {"weight": WEIGHT}),
    ("ce smoothing", cross_entropy, _ce_ref, {"label_smoothing": 0.1}),
    ("ce weight+smoothing", cross_entropy, _ce_ref, {"weight": WEIGHT, "label_smoothing": 0.2}),
    ("ce ignore=-100", cross_entropy, _ce_ref, {"ignore_index": -100}),
    ("dice", dice_loss, dice_loss_reference, {}),
    (
        "dice no-bg smooth",
        dice_loss,
        dice_loss_reference,
        {"include_background": False, "smooth": 0.5},
    ),
    (
        "ce+dice",
        lambda x, t, **kw: ce_dice_loss(x, t, dice_weight=0.7, **kw),
        lambda x, t, **kw: _ce_ref(x, t, **kw) + 0.7 * dice_loss_reference(x, t, **_dice_kw(kw)),
        {"weight": WEIGHT, "label_smoothing": 0.1},
    ),
    ("focal", focal_loss, focal_loss_reference, {}),
    ("focal weight gamma=1.5", focal_loss, focal_loss_reference, {"weight": WEIGHT, "gamma": 1.5}),
    ("tversky", tversky_loss, tversky_loss_reference, {}),
    (
        "tversky no-bg",
        tversky_loss,
        tversky_loss_reference,
        {"alpha": 0.7, "beta": 0.2, "smooth": 0.5, "include_background": False},
    ),
]


def _dist(t, dmesh, placements):
    """``distribute_tensor`` without communication (every rank holds the same full tensor)."""
    return distribute_tensor(t, dmesh, placements, src_data_rank=None)


def _layout(shape):
    dmesh = mesh(shape)
    if dmesh.ndim == 1:
        return dmesh, [Shard(3)], [Shard(2)]
    return dmesh, [Shard(0), Shard(3)], [Shard(0), Shard(2)]


def _target_form(form: int, t, xs, dmesh, tgt_pl):
    """The five accepted ways to pass the target."""
    if form == 0:
        return _dist(t, dmesh, tgt_pl).to_local()  # this rank's strip
    if form == 1:
        return t  # the full target
    if form == 2:
        return _dist(t, dmesh, tgt_pl)
    if form == 3:
        return _dist(t, dmesh, [Replicate()] * dmesh.ndim)  # redistributed
    return shard_like(_dist(t, dmesh, tgt_pl).to_local(), xs)


def loss_grid(shape) -> tuple[list[str], list[float]]:
    """Every loss case, at several uneven widths: value and logits gradient vs one device."""
    dmesh, pl, tgt_pl = _layout(shape)
    failures: list[str] = []
    values: list[float] = []
    sp = dmesh.size(dmesh.ndim - 1)
    # Uneven strips; 5 columns on 4 ranks give strips of 2, 2, 1 and 0 columns.
    for width in {1: [6], 2: [9, 7], 3: [13, 7], 4: [17, 5]}[sp]:
        for i, (name, fn, ref_fn, kw) in enumerate(CASES):
            label = f"{name} W={width} form={i % 5}"
            ignore = kw.get("ignore_index", 255)
            x = seeded(10 * width + i, 3, K, H, width) * 2
            t = make_target(10 * width + i, 3, width, ignore)
            xr = x.clone().requires_grad_()
            want = ref_fn(xr, t, **kw)
            want.backward()
            xs = _dist(x, dmesh, pl).requires_grad_()
            got = fn(xs, _target_form(i % 5, t, xs, dmesh, tgt_pl), **kw)
            got.backward()
            values.append(got.item())
            check_close(f"{label} loss", got, want, TOL, failures)
            want_grad = _dist(xr.grad, dmesh, pl).to_local()
            if want_grad.numel():  # (an empty strip has nothing to compare)
                check_close(f"{label} logits grad", xs.grad.to_local(), want_grad, TOL, failures)
    if dmesh.ndim == 2:  # batch replicated over "dp": sums over "sp" only
        _, fn, ref_fn, kw = next(c for c in CASES if c[0] == "ce+dice")
        x, t = seeded(5, 3, K, H, 7), make_target(5, 3, 7)
        xr = x.clone().requires_grad_()
        want = ref_fn(xr, t, **kw)
        want.backward()
        xs = _dist(x, dmesh, [Replicate(), Shard(3)]).requires_grad_()
        got = fn(xs, t, **kw)
        got.backward()
        check_close("replicated dp loss", got, want, TOL, failures)
        want_grad = _dist(xr.grad, dmesh, [Replicate(), Shard(3)]).to_local()
        check_close("replicated dp grad", xs.grad.to_local(), want_grad, TOL, failures)
    # Every pixel ignored: zero loss and zero gradient (torch's mean gives nan).
    xs = _dist(seeded(1, 2, K, H, 9), dmesh, pl).requires_grad_()
    loss = cross_entropy(xs, torch.full((2, H, 9), 255))
    loss.backward()
    if not (loss.item() == 0.0 and xs.grad.to_local().abs().sum() == 0):
        failures.append(f"all ignored: loss {loss.item()}, grad not zero")
    return failures, values


def model_grid(shape) -> list[str]:
    """A parallelized two-layer conv net + CE + Dice: parameter grads equal one device."""
    dmesh, pl, tgt_pl = _layout(shape)
    failures: list[str] = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, K, 3, padding=1))
    w = 5 * dmesh.size(dmesh.ndim - 1) + 2
    x, t = seeded(7, 3, 3, H, w), make_target(7, 3, w)
    kw = {"weight": WEIGHT, "label_smoothing": 0.05, "include_background": False}
    ref = copy.deepcopy(model)
    want = ce_dice_loss(ref(x), t, **kw)  # plain tensors: the single-device path
    want_ref = _ce_ref(ref(x), t, **kw) + dice_loss_reference(ref(x), t, include_background=False)
    check_close("model loss (plain path vs reference)", want, want_ref, TOL, failures)
    want.backward()
    par = parallelize(copy.deepcopy(model), dmesh)
    xs = _dist(x, dmesh, pl)
    got = ce_dice_loss(par(xs), _dist(t, dmesh, tgt_pl).to_local(), **kw)
    got.backward()
    check_close("model loss", got, want, TOL, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"model {name}.grad", p.grad, pr.grad, TOL, failures)
    return failures


def _confusion_reference(pred, t, k, ignore=255) -> torch.Tensor:
    valid = t != ignore
    m = torch.zeros(k, k, dtype=torch.int64)
    for i in range(k):
        for j in range(k):
            m[i, j] = ((t == i) & (pred == j) & valid).sum()
    return m


def metrics_grid(shape) -> list[str]:
    """Confusion matrix over two batches (logits, then labels), exact vs one device."""
    dmesh, pl, tgt_pl = _layout(shape)
    failures: list[str] = []
    k = K + 1  # class K: never a target and never predicted -> nan IoU, left out of mIoU
    sp = dmesh.size(dmesh.ndim - 1)
    batches = []
    for b, w in enumerate((3 * sp + 2, 2 * sp + 1)):
        x = torch.cat([seeded(20 + b, 3, K, H, w), torch.full((3, 1, H, w), -50.0)], 1)
        t = make_target(20 + b, 3, w).masked_fill(make_target(30 + b, 3, w) == 4, 255)
        batches.append((x, t))  # class 4 is rare in the targets
    cm, cm_plain = ConfusionMatrix(k), ConfusionMatrix(k)
    want = torch.zeros(k, k, dtype=torch.int64)
    for b, (x, t) in enumerate(batches):
        want += _confusion_reference(x.argmax(1), t, k)
        xs = _dist(x, dmesh, pl)
        if b == 0:
            cm.update(xs, _dist(t, dmesh, tgt_pl).to_local())
        else:
            cm.update(shard_like(x.argmax(1), xs), _dist(t, dmesh, tgt_pl))
        cm_plain.update(xs.to_local(), local_target(t, xs))
    got, got_plain = cm.reduce(), cm_plain.reduce(dmesh)
    if not (torch.equal(got, want) and torch.equal(got_plain, want)):
        failures.append(f"confusion matrix differs:\n{got}\n{got_plain}\nwant\n{want}")
    m, ref = cm.metrics(), _metrics_reference(batches, k)
    for key, value in ref.items():
        got_v = m[key] if isinstance(m[key], list) else [m[key]]
        same = [
            a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got_v, value, strict=True)
        ]
        if not all(same) or len(same) != len(value):
            failures.append(f"metric {key}: {got_v} != {value}")
    return failures


def _metrics_reference(batches, k) -> dict[str, list[float]]:
    """Per-class metrics straight from the full tensors, with the means as 1-lists."""
    pred = torch.cat([x.argmax(1).flatten() for x, _ in batches])
    t = torch.cat([t.flatten() for _, t in batches])
    pred, t = pred[t != 255], t[t != 255]
    iou, dice, acc = [], [], []
    for c in range(k):
        tp, in_t, in_p = (
            int(((t == c) & (pred == c)).sum()),
            int((t == c).sum()),
            int((pred == c).sum()),
        )
        union = int(((t == c) | (pred == c)).sum())
        iou.append(tp / union if union else math.nan)
        dice.append(2 * tp / (in_t + in_p) if in_t + in_p else math.nan)
        acc.append(tp / in_t if in_t else math.nan)
    out = {"iou": iou, "dice": dice, "class_accuracy": acc}
    return out | {"pixel_accuracy": [float((t == pred).sum()) / t.numel()]}


def errors(world: int) -> list[str]:
    """Bad labels or a misfit strip on ONE rank make every rank raise together."""
    dmesh, pl, tgt_pl = _layout(world)
    xs = _dist(seeded(3, 2, K, H, 3 * world + 1), dmesh, pl).requires_grad_()
    strip = _dist(make_target(3, 2, 3 * world + 1), dmesh, tgt_pl).to_local()
    last = dmesh.get_local_rank(0) == world - 1
    bad = strip.clone()
    if last:
        bad[0, 0, 0] = K  # a label out of range, only on the last rank
    misfit = strip[..., :-1] if last else strip
    messages = []
    for fn in (cross_entropy, dice_loss):
        for tgt, expected in ((bad, "outside"), (misfit, "strip")):
            with pytest.raises(ValueError, match=expected) as info:
                fn(xs, tgt)
            messages.append(str(info.value))
    cm = ConfusionMatrix(K)
    cm.update(xs, bad)
    with pytest.raises(ValueError, match="outside"):
        cm.reduce()
    return messages


@pytest.mark.parametrize("shape", [1, 2, 3, 4, (2, 2)])
def test_losses_and_metrics_match_single_device(dist_pool, shape):
    world = shape if isinstance(shape, int) else shape[0] * shape[1]
    results = dist_pool.run(world, _all_checks, shape)
    failures = [
        f for r, (fails, _) in enumerate(results) for f in (f"rank {r}: {x}" for x in fails)
    ]
    assert not failures, "\n".join(failures)
    values = [v for _, v in results]
    assert all(v == values[0] for v in values), "loss values differ between ranks"


def _all_checks(shape) -> tuple[list[str], list[float]]:
    failures, values = loss_grid(shape)
    return failures + model_grid(shape) + metrics_grid(shape), values


def test_errors_raise_on_every_rank(dist_pool):
    messages = dist_pool.run(3, errors, 3)
    assert "another rank" in messages[0][1] and "is neither" in messages[2][1]


# ------------------------------------------------------------------ single process


def test_plain_tensors_are_the_torch_losses():
    for i, (name, fn, ref_fn, kw) in enumerate(CASES):
        x = seeded(i, 2, K, H, 6)
        t = make_target(i, 2, 6, kw.get("ignore_index", 255)).to(
            torch.uint8 if i == 0 else torch.int64
        )
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref_fn(xr, t.long(), **kw).backward()
        fn(xp, t, **kw).backward()
        torch.testing.assert_close(xp.grad, xr.grad, msg=name)


def test_dice_reference_known_values():
    t = torch.tensor([[[0, 1, 1, 255]]])
    perfect = F.one_hot(t.clamp(max=1), 2).permute(0, 3, 1, 2).float() * 100
    assert dice_loss_reference(perfect, t, smooth=0.0).item() == pytest.approx(0.0, abs=1e-6)
    # Uniform probabilities, smooth 1: class 0: (2*0.5 + 1) / (1.5 + 1 + 1),
    # class 1: (2*1 + 1) / (1.5 + 2 + 1).
    want = 1 - (2 / 3.5 + 3 / 4.5) / 2
    assert dice_loss_reference(torch.zeros(1, 2, 1, 4), t).item() == pytest.approx(want)
    assert dice_loss(torch.zeros(1, 2, 1, 4), t).item() == pytest.approx(want)


def test_metrics_known_values():
    m = metrics_from_confusion(torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]]))
    assert m["pixel_accuracy"] == 5 / 6 and m["pixels"] == 6
    assert m["iou"][:2] == [3 / 4, 2 / 3] and math.isnan(m["iou"][2])
    assert m["miou"] == pytest.approx((3 / 4 + 2 / 3) / 2)
    assert m["dice"][:2] == [6 / 7, 4 / 5] and m["class_accuracy"][:2] == [3 / 4, 1.0]
    cm = ConfusionMatrix(3)
    cm.update(torch.tensor([[[0, 1, 2, 0]]]), torch.tensor([[[0, 1, 255, 1]]]))
    assert cm.compute()["pixels"] == 3 and cm.total.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]


def test_target_checks():
    x = seeded(0, 2, K, H, 4)
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(x, torch.zeros(2, H, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer class-index"):
        dice_loss(x, torch.zeros(2, H, 4))
    with pytest.raises(ValueError, match="outside"):
        cross_entropy(x, torch.full((2, H, 4), K))
