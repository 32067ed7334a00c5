"""Helpers that compare sharded results with single-device references."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from spconv_train.parallel import parallelize
from tests.dist_harness import device

TOL = 1e-5


def full(t):
    """The global value of a DTensor (a plain tensor is returned as is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(got, want, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) (absolute when both are zero). ``floor``
    keeps a mathematically-zero reference (pure rounding noise) from dividing by ~0."""
    got, want = full(got).detach().double(), full(want).detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return 0.0
    scale = max(want.abs().max().item(), floor)
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def check_close(label: str, got, want, tol: float, failures: list[str], floor: float = 0.0) -> None:
    """Append a readable failure line to ``failures`` if ``got`` is not within ``tol``."""
    try:
        e = rel_err(got, want, floor)
    except AssertionError as exc:
        failures.append(f"{label}: {exc}")
        return
    if not e <= tol:
        failures.append(f"{label}: relative error {e:.3g} > {tol:g}")


def seeded(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    """A reproducible random tensor (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def grad_dtensor(g: torch.Tensor, dmesh, kind: str, placements) -> DTensor:
    """The upstream gradient ``g`` as a DTensor in the requested placement."""
    if kind == "shard":
        return distribute_tensor(g, dmesh, placements)
    if kind == "replicate":
        return distribute_tensor(g, dmesh, [Replicate()] * dmesh.ndim)
    # Partial: rank r holds a share c_r * g with sum(c_r) = 1.
    rank, n = dmesh.get_rank(), dmesh.size()
    share = (rank + 1) / (n * (n + 1) / 2)
    return DTensor.from_local(g * share, dmesh, [Partial()] * dmesh.ndim, run_check=False)


def reference_backward(model, x: torch.Tensor, seed: int, dtype=torch.float64) -> tuple:
    """A copy of ``model`` run on one device on a copy of ``x`` (requiring grad), backward
    with a gradient ``seeded(seed)`` of ``dtype`` on the output's device: ``(copy, input,
    output, gradient)``, what a sharded run of ``model`` must match."""
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    g = seeded(seed, *yr.shape, dtype=dtype).to(yr.device)
    yr.backward(g)
    return ref, xr, yr, g


def compare_module(model, x, dmesh, placements, grad_kind, label, failures, tol=TOL):
    """Run ``model`` on ``x`` on one device and sharded (``parallelize`` on ``dmesh``, input
    distributed with ``placements``), backward with the same seeded upstream gradient given
    in placement ``grad_kind`` ("shard", "replicate" or "partial"); append every mismatch of
    output, input gradient and parameter gradients to ``failures``. Returns the sharded
    model (for further checks, e.g. buffers)."""
    dev = device()  # SPCONV_TEST_DEVICE (tests/dist_harness.py)
    model, x = model.to(dev), x.to(dev)
    ref, xr, yr, g = reference_backward(model, x, 99, torch.float32)

    par = parallelize(copy.deepcopy(model), dmesh)
    xs = distribute_tensor(x.clone(), dmesh, placements).requires_grad_()
    ys = par(xs)
    if not isinstance(ys, DTensor) or tuple(ys.placements) != tuple(placements):
        failures.append(f"{label}: output is not a DTensor with {placements}")
        return par, ref
    ys.backward(grad_dtensor(g, dmesh, grad_kind, placements))
    check_close(f"{label} output", ys, yr, tol, failures)
    check_close(f"{label} input grad", xs.grad, xr.grad, tol, failures)
    for (name, p), (_, pr) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        check_close(f"{label} {name}.grad", p.grad, pr.grad, tol, failures)
    return par, ref


def dropout_off(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout at p = 0: per-strip (per-tile) masks cannot equal one
    device's. Stochastic depth stays: tests draw its masks from the same seed."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model
