"""How the parallel layer meets ``torch.compile`` (the one place that touches Dynamo).

Under ``torch.compile`` every spatial layer and every spatial handler runs eagerly, with a
graph break around it, and only what lies between them (element-wise ops on the local
strips, DTensor's own element-wise ops) is compiled:

- Their exchanges and collectives break the graph anyway, and traced, their Python (cached
  plans, error labels, saved-tensor hooks that compare data pointers) made Dynamo guard on
  module names, sizes and pointers and recompile each layer until its recompile limit
  (38 s of compiling for a depth-3 U-Net, and a fresh compile on every step).
- Dynamo must not trace into the autograd functions holding an exchange or a hand-written
  backward: it breaks at the P2P calls inside them (under ``no_grad`` it inlined their
  forward, and the resumed half failed with "'NoneType' has no attribute 'item'"), and
  where it got through it differentiated the decomposed forward instead of running the
  one-pass backward (spatial BatchNorm: +0.18 s per step of a U-Net at 256x1024 on CPU).
- On CPU, element-wise handlers run eagerly too (``TRACE_ELEMENTWISE_ON_CPU``): between
  graph breaks an activation is a graph of its own with nothing to fuse, and inductor's
  CPU code for its backward mask is far slower than eager on AVX2 machines (torch 2.14.1:
  a ``bool`` store from a float vector mask becomes two 32-step scalar loops per 8
  elements; ``torch.compile(lambda t: t > 0)`` on 1M floats takes 15.6 ms vs 0.6 ms eager,
  without this project involved). See docs/benchmarks.md.

Checked against torch 2.14.1; ``tests/test_compile.py`` and
``tests/test_train_e2e.py::test_compile_changes_nothing`` exercise it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["not_traced", "run_elementwise", "TRACE_ELEMENTWISE_ON_CPU"]

F = TypeVar("F", bound=Callable)

#: Whether ``torch.compile`` traces element-wise handlers on CPU tensors (see module doc).
TRACE_ELEMENTWISE_ON_CPU = False


def not_traced(fn: F) -> F:
    """``fn`` runs eagerly under ``torch.compile`` (a graph break around each call)."""
    return torch._dynamo.disable(fn)


@not_traced
def _eager(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def run_elementwise(fn: Callable, local: Tensor, *args, **kwargs):
    """``fn(local, *args, **kwargs)``, an element-wise op on a local strip: traced by
    ``torch.compile``, except on CPU unless ``TRACE_ELEMENTWISE_ON_CPU``."""
    if (
        torch.compiler.is_compiling()
        and local.device.type == "cpu"
        and not TRACE_ELEMENTWISE_ON_CPU
    ):
        return _eager(fn, local, *args, **kwargs)
    return fn(local, *args, **kwargs)
