"""Helpers that compare sharded results with single-device references."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full(t):
    """The global value of a DTensor (a plain tensor is returned as is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (absolute when ``want`` is all zeros)."""
    got, want = full(got).detach().double(), full(want).detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def check_close(label: str, got, want, tol: float, failures: list[str]) -> None:
    """Append a readable failure line to ``failures`` if ``got`` is not within ``tol``."""
    try:
        e = rel_err(got, want)
    except AssertionError as exc:
        failures.append(f"{label}: {exc}")
        return
    if not e <= tol:
        failures.append(f"{label}: relative error {e:.3g} > {tol:g}")


def seeded(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    """A reproducible random tensor (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)
