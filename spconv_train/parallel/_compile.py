"""How the parallel layer meets ``torch.compile`` (the one place that touches Dynamo).

Under ``torch.compile`` the local ops between halo exchanges are compiled and every
exchange is a graph break. Dynamo must not trace into the autograd functions that hold an
exchange or a hand-written backward: it breaks at the P2P calls inside them (under
``no_grad`` it inlines their forward, and the resumed half fails with "'NoneType' has no
attribute 'item'"), and where it does get through it differentiates the decomposed
forward instead of running the one-pass backward (spatial BatchNorm: +0.18 s per step of a
U-Net at 256x1024 on CPU). Checked against torch 2.14.1; ``tests/test_compile.py`` and
``tests/test_train_e2e.py::test_compile_changes_nothing`` exercise it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["not_traced"]

F = TypeVar("F", bound=Callable)


def not_traced(fn: F) -> F:
    """``fn`` runs eagerly under ``torch.compile`` (a graph break around each call)."""
    return torch._dynamo.disable(fn)
