"""Review tests of the second cut of the reduction / pointwise / gradient-reduction modules:
variance, standard deviation and extremes over the tokens in every call form (correction 0
and 1, ``unbiased``, keepdim, dims as int / tuple / negative) on strips, 2x2 tiles and
dp x sp with ranks holding 0 or 1 token, softmax over the tokens with ``dtype`` by position
and keyword, the same behind prefix tokens refused; a NaN on a later rank kept by amax /
amin / softmax (gloo's MAX dropped it); in-place dropout with p = 1, p = 0 and training off
with its gradient; reductions with ``out=`` written or refused, never silently left
unwritten; one bucket per parameter on dp x sp (each with a further group)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, _small_sum, parallelize, runtime_of
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import check_close, seeded


def _no_failures(dist_pool, world: int, fn, *args) -> None:
    for failures in dist_pool.run(world, fn, *args):
        assert not failures, "\n".join(failures)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(2).transpose(1, 2)


#: variances over the tokens of ``(N, L, C)`` (the token dim 1 / -2), every call form
VARIANCES = {
    "var(1)": lambda t: t.var(1),
    "var(1, unbiased=False)": lambda t: t.var(1, unbiased=False),
    "torch.var(t, 1, False, True)": lambda t: torch.var(t, 1, False, True),
    "torch.var(t, -2, keepdim, correction=0)": lambda t: torch.var(
        t, -2, keepdim=True, correction=0
    ),
    "var((1,), correction=1)": lambda t: t.var((1,), correction=1),
    "var([1, -1], correction=0, keepdim)": lambda t: t.var(dim=[1, -1], correction=0, keepdim=True),
    "var((0, 1))": lambda t: t.var((0, 1)),
    "var(False)": lambda t: t.var(False),
    "torch.var(unbiased=False)": lambda t: torch.var(t, unbiased=False),
    "std(1)": lambda t: t.std(1),
    "std(-2, correction=0)": lambda t: t.std(-2, correction=0),
    "torch.std(t, (1,), True, True)": lambda t: torch.std(t, (1,), True, True),
    "std((1, 2), unbiased=False, keepdim)": lambda t: t.std((1, 2), unbiased=False, keepdim=True),
    "std()": lambda t: t.std(),
}

#: extremes over the tokens, ties on different ranks (the gradient spread over them, as torch)
EXTREMES = {
    "amax(1)": lambda t: t.amax(1),
    "torch.amin(t, (1,), True)": lambda t: torch.amin(t, (1,), True),
    "torch.amax(t, (), True)": lambda t: torch.amax(t, (), True),
    "amin(dim=(-2, 0))": lambda t: t.amin(dim=(-2, 0)),
}

#: softmax / log_softmax over the tokens, ``dtype`` by position and by keyword
SOFTMAXES = {
    "torch.softmax(t, 1, f64) of f32": lambda t: torch.softmax(t.float(), 1, torch.float64),
    "t.softmax(-2, f64) of f32": lambda t: t.float().softmax(-2, torch.float64),
    "t.softmax(dim=1, dtype=f64)": lambda t: t.softmax(dim=1, dtype=torch.float64),
    "F.softmax(t, 1, 3, f64) of f32": lambda t: F.softmax(t.float(), 1, 3, torch.float64),
    "F.softmax(t, dim=-2, dtype=f64) of f32": lambda t: F.softmax(
        t.float(), dim=-2, dtype=torch.float64
    ),
    "torch.log_softmax(t, 1, f64) of f32": lambda t: torch.log_softmax(t.float(), 1, torch.float64),
    "t.log_softmax(-2, dtype=f64)": lambda t: t.log_softmax(-2, dtype=torch.float64),
    "F.log_softmax(t, 1, dtype=f64) of f32": lambda t: F.log_softmax(
        t.float(), 1, dtype=torch.float64
    ),
    "F.log_softmax(t, -2)": lambda t: F.log_softmax(t, -2),
}


def _token_op(fn):
    """``fn`` on the tokens of a map; a token-shaped result back as the map (the harness
    shards a map's gradient, not an uneven token split's)."""

    def run(m: torch.Tensor) -> torch.Tensor:
        y = fn(_tokens(m))
        return (
            y.transpose(1, 2).unflatten(2, m.shape[2:])
            if y.shape[1:2] == (math.prod(m.shape[2:]),)
            else y
        )

    return run


def token_variance_checks(world: int) -> list[str]:
    """Every form against one device (fp64, shard and replicate gradients, no gather) on
    4 strips, 2x2 tiles and dp 2 x sp 2 of maps whose ranks hold many, 1 or 0 tokens."""
    failures: list[str] = []
    tiles = mesh((2, world // 2), ("sp_h", "sp_w"))
    layouts = {
        "strips": (mesh((world,)), [Shard(3)]),
        "tiles": (tiles, [Shard(2), Shard(3)]),
        "dp x sp": (mesh((2, world // 2)), [Shard(0), Shard(3)]),
    }
    # 5 x 7: uneven; 2 x 3: strips hold 2, 2, 2, 0 tokens, tiles 2, 1, 2, 1; 2 x 1: a
    # column on two ranks only (strips 2, 0, 0, 0 tokens, tiles 1, 0, 1, 0)
    maps = [(5, 7), (2, 3), (2, 1)]
    for (where, (dmesh, placements)), (h, w) in itertools.product(layouts.items(), maps):
        x = seeded(h * 10 + w, 2, 3, h, w, dtype=torch.float64)
        if w > 1:  # ties on different ranks: the first and last token, the other corners
            x[:, :, 0, 0] = x[:, :, -1, -1] = x.max() + 1.0
            x[:, :, -1, 0] = x[:, :, 0, -1] = x.min() - 1.0
        # the 2 x 1 map's tokens do not reshape back to a map on tiles (its W is split to 0)
        ops = {**VARIANCES, **EXTREMES}
        ops |= {} if (where, w) == ("tiles", 1) else SOFTMAXES
        for (label, fn), grad in itertools.product(ops.items(), ("shard", "replicate")):
            what = f"{label} {where} {h}x{w} {grad}"
            check_fn(_token_op(fn), x, dmesh, placements, what, failures, grad=grad)
    return failures


def test_token_variances_and_softmaxes_exact_without_gather(dist_pool):
    _no_failures(dist_pool, 4, token_variance_checks, 4)


def _behind_prefix(fn):
    def run(m: torch.Tensor) -> torch.Tensor:
        t = _tokens(m)
        front = torch.linspace(-1, 1, 2 * m.shape[1], dtype=m.dtype).view(1, 2, -1)
        return fn(torch.cat([front.expand(m.shape[0], -1, -1), t], 1))

    return run


def _refusal(call, want: str) -> str | None:
    """None when ``call()`` is refused by name (``want`` in the message), else why not."""
    try:
        with SpatialMode():
            call()
    except SpatialShardingError as exc:
        return None if want in str(exc) else str(exc)
    return "not refused"


def prefix_token_checks() -> list[str]:
    """Over the tokens behind prefix tokens: refused by name (never gathered or wrong)."""
    x = distribute_tensor(seeded(5, 2, 3, 4, 5, dtype=torch.float64), mesh((2,)), [Shard(3)])
    whole = ("var(False)", "torch.var(unbiased=False)", "std()", "var((0, 1))")
    ops = {k: f for k, f in {**VARIANCES, **SOFTMAXES}.items() if k not in whole}
    whys = {k: _refusal(lambda f=f: _behind_prefix(f)(x), "prefix") for k, f in ops.items()}
    return [f"{k} behind a prefix: {why}" for k, why in whys.items() if why]


def test_token_reductions_behind_prefix_refused(dist_pool):
    _no_failures(dist_pool, 2, prefix_token_checks)


#: extremes of a map with a NaN on the last rank only: gloo's MAX / MIN all-reduce dropped
#: it (rank 0 got the largest number, one device NaN)
NAN_EXTREMES = {
    "amax w": lambda t: t.amax(3),
    "amax w of the row": lambda t: t[1:, 2:, 1:2].amax(3),
    "tokens amin of the row": lambda t: _tokens(t[1:, 2:, 1:2]).amin(1),
    "torch.amin(t, (2, 3), True)": lambda t: torch.amin(t, (2, 3), True),
    "amax all": lambda t: t.amax(),
    "tokens amin": lambda t: _tokens(t).amin(1),
    "softmax w": lambda t: t.softmax(-1),
    "max all": lambda t: t.max(),
    "torch.min all": lambda t: torch.min(t),
    "adaptive max pool to 1": lambda t: F.adaptive_max_pool2d(t, 1),
    # torch's index of a NaN window: the last NaN in row-major order
    "adaptive max pool indices": lambda t: F.adaptive_max_pool2d(t, 1, True)[1].double(),
}


def nan_extreme_checks() -> list[str]:
    dmesh, failures = mesh((2,)), []
    x = seeded(9, 2, 3, 4, 6, dtype=torch.float64)
    x[1, 2, 1, 5] = float("nan")  # on rank 1 only
    two = x.clone()
    two[0, 1, 3, 0] = two[0, 1, 0, 4] = float("nan")  # one window, a NaN on each rank
    ties = (seeded(9, 2, 3, 4, 6, dtype=torch.float64) * 2).round()  # maxima on both ranks
    for label, fn in (("x.max()", lambda t: t.max()), ("torch.min(x)", torch.min)):
        check_fn(fn, ties, dmesh, [Shard(3)], f"{label} gradient over ties", failures)
    cases = [
        (f"{label}{tag}", fn, t)
        for tag, t in (("", x), (", two NaNs", two))
        for label, fn in NAN_EXTREMES.items()
    ]
    for label, fn, x in cases:
        xs = distribute_tensor(x, dmesh, [Shard(3)])
        with SpatialMode():
            y = fn(xs)
        got, want = y.full_tensor(), fn(x)
        if (
            got.shape != want.shape
            or not torch.equal(got.isnan(), want.isnan())
            or not torch.allclose(got.nan_to_num(), want.nan_to_num())
        ):
            failures.append(
                f"{label}: NaN at {got.isnan().nonzero().tolist()}, one device at "
                f"{want.isnan().nonzero().tolist()}"
            )
    return failures


def test_extremes_keep_a_nan_of_a_later_rank(dist_pool):
    _no_failures(dist_pool, 2, nan_extreme_checks)


def _in_place(fn):
    """``fn`` applied in place to a copy of the map (its result dropped); the copy."""

    def run(m: torch.Tensor) -> torch.Tensor:
        y = m * 1.0
        fn(y)
        return y

    return run


#: deterministic dropouts in place: the input itself changed (p = 1) or left (p = 0,
#: training off), with its gradient, as on one device (tests/test_review_core.py: values)
DROPOUTS_IN_PLACE = {
    "F.dropout p=1": lambda y: F.dropout(y, 1.0, True, True),
    "F.dropout2d p=1": lambda y: F.dropout2d(y, 1.0, inplace=True),
    "nn.Dropout(1.0, inplace=True)": nn.Dropout(1.0, inplace=True),
    "F.dropout p=0": lambda y: F.dropout(y, 0.0, inplace=True),
    "F.dropout eval": lambda y: F.dropout(y, 0.5, False, True),
}


def dropout_in_place_checks() -> list[str]:
    dmesh, failures = mesh((2,)), []
    x = seeded(6, 2, 3, 4, 5, dtype=torch.float64)
    for label, fn in DROPOUTS_IN_PLACE.items():
        check_fn(_in_place(fn), x, dmesh, [Shard(3)], label, failures)
        y = distribute_tensor(x, dmesh, [Shard(3)])
        with SpatialMode():
            if fn(y) is not y and not isinstance(fn, nn.Module):
                failures.append(f"{label}: not its input returned")
    return failures


def test_dropout_in_place_gradients(dist_pool):
    _no_failures(dist_pool, 2, dropout_in_place_checks)


#: reductions with ``out=`` beyond the refused sum / mean / amax / amin / var / std
OUT_CALLS = {
    "torch.prod": lambda t, o: torch.prod(t, 3, out=o),
    "torch.logsumexp": lambda t, o: torch.logsumexp(t, 3, out=o),
    "torch.nansum": lambda t, o: torch.nansum(t, 3, out=o),
    "torch.nanmean": lambda t, o: torch.nanmean(t, 3, out=o),
    "torch.norm": lambda t, o: torch.norm(t, 2, 3, out=o),
    "torch.linalg.vector_norm": lambda t, o: torch.linalg.vector_norm(t, 2, 3, out=o),
    "torch.cumsum": lambda t, o: torch.cumsum(t, 3, out=o),
    "torch.cumprod": lambda t, o: torch.cumprod(t, 3, out=o),
    "torch.argmax": lambda t, o: torch.argmax(t, 3, out=o),
    "torch.amax": lambda t, o: torch.amax(t, 3, out=o),
    "torch.sum": lambda t, o: torch.sum(t, 3, out=o),
}
#: ``(values, indices)`` outputs
OUT_PAIRS = {
    "torch.max": lambda t, o: torch.max(t, 3, out=o),
    "torch.min": lambda t, o: torch.min(t, 3, out=o),
    "torch.median": lambda t, o: torch.median(t, 3, out=o),
}


def _out_like(want: torch.Tensor, dmesh, dtensor: bool):
    o = torch.full_like(want, 7)
    return distribute_tensor(o, dmesh, [Shard(2)] if o.ndim > 3 else [Shard(0)]) if dtensor else o


def out_checks() -> list[str]:
    """Each call with a plain and a DTensor ``out`` on a width-sharded input: refused, or
    ``out`` holds one device's result; never ``out`` silently unwritten or wrong."""
    dmesh, failures = mesh((2,)), []
    x = seeded(8, 2, 3, 4, 6, dtype=torch.float64)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    calls = {**OUT_CALLS, **{k: (lambda t, o, f=f: f(t, tuple(o))) for k, f in OUT_PAIRS.items()}}
    for (label, call), dtensor in itertools.product(calls.items(), (False, True)):
        if label in OUT_PAIRS:
            v, i = OUT_PAIRS[label](x, None)
            want = [v, i]
        else:
            want = [call(x, None)]
        outs = [_out_like(w, dmesh, dtensor) for w in want]
        kind = "DTensor out" if dtensor else "plain out"
        try:
            with SpatialMode():
                call(xs, outs if label in OUT_PAIRS else outs[0])
        except (SpatialShardingError, RuntimeError):
            continue  # loud: refused by name, or DTensor's own error (cumsum, plain out)
        for o, w in zip(outs, want, strict=True):
            got = o.full_tensor() if isinstance(o, DTensor) else o
            if got.shape != w.shape or not torch.allclose(got.double(), w.double()):
                failures.append(f"{label} {kind}: out not written with the result")
    return failures


def test_reductions_with_out_written_or_refused(dist_pool):
    _no_failures(dist_pool, 2, out_checks)


class _PooledNet(nn.Module):
    """``tests/test_grad_reduce._Net`` and a linear head on its global mean: parameters
    summed over (dp, sp) and the head's over dp alone, in buckets of their own."""

    def __init__(self) -> None:
        super().__init__()
        from tests.test_grad_reduce import _randomized

        self.body = _randomized(0)
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x, use_extra=True)
        return y * self.head(y.mean((2, 3))).sum(1).view(-1, 1, 1, 1)


def one_bucket_per_parameter(exchange_bytes: int | None) -> list:
    """dp 2 x sp 2 in fp64, every parameter its own bucket (each summed over dp, then the
    further group sp, bucket after bucket; by exchange, or gloo's all-reduce with
    ``exchange_bytes`` 0) and two backwards accumulated: one device's gradients, the same
    bits on every rank (tests/test_grad_reduce.py has one bucket per group)."""
    saved = _small_sum.EXCHANGE_SUM_BYTES  # a pool worker's: restored below
    _small_sum.EXCHANGE_SUM_BYTES = saved if exchange_bytes is None else exchange_bytes
    try:
        return _bucket_grads()
    finally:
        _small_sum.EXCHANGE_SUM_BYTES = saved


def _bucket_grads() -> list:
    dmesh, failures = mesh((2, 2)), []
    ref = _PooledNet().double()
    par = parallelize(copy.deepcopy(ref), dmesh)
    runtime_of(par).grad_reducer.bucket_bytes = 1
    for step in range(2):
        x = seeded(20 + step, 4, 3, 6, 11, dtype=torch.float64)
        ref(x).square().sum().backward()
        par(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])).square().sum().backward()
    for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            failures.append(
                f"{name}: gradient {p.grad is not None}, one device {q.grad is not None}"
            )
        elif q.grad is not None:
            check_close(f"{name} grad", p.grad, q.grad, 1e-10, failures)
    return failures + [[p.grad.tolist() for p in par.parameters() if p.grad is not None]]


@pytest.mark.parametrize("exchange_bytes", [None, 0], ids=["exchange", "all_reduce"])
def test_many_buckets_with_a_further_group_match_one_device(dist_pool, exchange_bytes):
    results = dist_pool.run(4, one_bucket_per_parameter, exchange_bytes)
    assert all(r[-1] == results[0][-1] for r in results), "ranks disagree on the gradients"
    for r in results:
        assert not r[:-1], "\n".join(r[:-1])
