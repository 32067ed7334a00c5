"""Review tests of the issue-22 refactor of the dispatch, reductions and dropout: call forms
the other tests do not run, each against one device in fp64 on uneven strips (2 ranks,
width 7). Reductions with ``keepdim`` and no dim on DTensors the handlers leave to DTensor
(``Partial``, the ``_StridedShard`` of a flatten); ``softmax`` / ``log_softmax`` with the
dtype passed by position (``torch.softmax(x, dim, dtype)``, ``x.softmax(dim, dtype)``);
dropout in eval mode, with p = 0 and p = 1, and refusing a p outside [0, 1] as torch does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import device, mesh
from tests.reference import check_close, full, seeded

TOL = 1e-12


def _input(dtype=torch.float64) -> torch.Tensor:
    x = seeded(7, 2, 3, 4, 7, dtype=torch.float64)
    x[0, 0, 1, 3] = x[0, 0, 1, 4] = x.abs().max() + 1.0  # a tie across the strip boundary
    return x.to(device(), dtype)


def _compare(label: str, got, want, failures: list[str], tol: float = TOL) -> None:
    got = full(got) if isinstance(got, DTensor) else got
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(
            f"{label}: {tuple(got.shape)} {got.dtype}, one device {tuple(want.shape)} {want.dtype}"
        )
        return
    check_close(label, got, want, tol, failures)


#: reductions over every dim with keepdim, on DTensors the handlers hand back to DTensor
FALLBACKS = {
    "amax(keepdim=True)": lambda t: t.amax(keepdim=True),
    "amin(None, True)": lambda t: t.amin(None, True),
    "torch.amax(t, keepdim=True)": lambda t: torch.amax(t, keepdim=True),
    "sum(None, True)": lambda t: t.sum(None, True),
    "torch.mean(t, None, True)": lambda t: torch.mean(t, None, True),
    "amax((), True)": lambda t: t.amax((), True),
    "amax()": lambda t: t.amax(),
}


def fallback_checks() -> list[str]:
    dmesh, failures = mesh(2), []
    x = _input()
    # a Partial DTensor: each rank holds half of the value
    p = DTensor.from_local(x / 2, dmesh, [Partial()], run_check=False)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    for label, fn in FALLBACKS.items():
        with SpatialMode():
            got_p = fn(p)
            got_flat = fn(xs.flatten(2))  # a _StridedShard of the flattened H x W
        _compare(f"Partial {label}", got_p, fn(x), failures)
        _compare(f"flatten(2) {label}", got_flat, fn(x.flatten(2)), failures)
    return failures


def test_reductions_keepdim_without_dim_on_dtensor_fallbacks(dist_pool):
    for failures in dist_pool.run(2, fallback_checks):
        assert not failures, failures


#: softmax and log_softmax of an fp32 input in fp64, the dtype passed by position or name,
#: along the sharded W, along C and along H (not sharded)
SOFTMAXES = {
    "torch.softmax(t, 3, f64)": lambda t: torch.softmax(t, 3, torch.float64),
    "t.softmax(-1, f64)": lambda t: t.softmax(-1, torch.float64),
    "t.log_softmax(3, f64)": lambda t: t.log_softmax(3, torch.float64),
    "torch.log_softmax(t, 1, f64)": lambda t: torch.log_softmax(t, 1, torch.float64),
    "t.softmax(2, dtype=f64)": lambda t: t.softmax(2, dtype=torch.float64),
    "F.log_softmax(t, -1, dtype=f64)": lambda t: F.log_softmax(t, -1, dtype=torch.float64),
}


def softmax_checks() -> list[str]:
    dmesh, failures = mesh(2), []
    x = _input(torch.float32)
    for label, fn in SOFTMAXES.items():
        xr = x.clone().requires_grad_()
        want = fn(xr)
        g = seeded(3, *want.shape, dtype=torch.float64).to(device())
        want.backward(g)
        xs = distribute_tensor(x, dmesh, [Shard(3)]).requires_grad_()
        with SpatialMode():
            got = fn(xs)
        _compare(label, got, want, failures)
        if isinstance(got, DTensor) and got.dtype == want.dtype:
            got.backward(distribute_tensor(g, dmesh, got.placements))
            # fp32 gradients: the sharded and torch's formula round apart in the last bit
            check_close(f"{label} input grad", full(xs.grad), xr.grad, 1e-6, failures)
    return failures


def test_softmax_dtype_by_position_as_on_one_device(dist_pool):
    for failures in dist_pool.run(2, softmax_checks):
        assert not failures, failures


#: deterministic dropouts: exact against one device
DROPOUTS = {
    "F.dropout eval": lambda t: F.dropout(t, 0.5, training=False),
    "F.dropout p=0": lambda t: F.dropout(t, 0.0),
    "F.dropout p=1": lambda t: F.dropout(t, 1.0),
    "torch.dropout p=1": lambda t: torch.dropout(t, 1.0, True),
    "torch.dropout eval": lambda t: torch.dropout(t, 0.3, False),
    "F.dropout2d eval": lambda t: F.dropout2d(t, 0.5, False),
    "F.dropout2d p=1": lambda t: F.dropout2d(t, 1.0),
    "nn.Dropout eval": lambda t: torch.nn.Dropout(0.5).eval()(t),
    "F.dropout p=1 in place": lambda t: F.dropout(t * 1.0, 1.0, True, True),
}
#: probabilities torch refuses
BAD_P = {
    "F.dropout p=1.5": lambda t: F.dropout(t, 1.5),
    "F.dropout2d p=-0.1": lambda t: F.dropout2d(t, -0.1),
    "torch.dropout p=2 eval": lambda t: torch.dropout(t, 2.0, False),
}


def dropout_checks() -> list[str]:
    dmesh, failures = mesh(2), []
    x = _input()
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    for label, fn in DROPOUTS.items():
        with SpatialMode():
            got = fn(xs)
        _compare(label, got, fn(x), failures)
    for label, fn in BAD_P.items():
        want = "dropout probability has to be between 0 and 1"
        for t in (x, xs):
            try:
                with SpatialMode():
                    fn(t)
            except (ValueError, RuntimeError) as exc:
                if want not in str(exc):
                    failures.append(f"{label}: {exc!r}")
            else:
                failures.append(f"{label}: no error on {type(t).__name__}")
    return failures


def test_dropout_eval_p0_p1_and_bad_p_as_on_one_device(dist_pool):
    for failures in dist_pool.run(2, dropout_checks):
        assert not failures, failures
