"""How the parallel layer meets ``torch.compile`` (the one place that touches Dynamo).

By default the parallelized forward runs eagerly as a whole under ``torch.compile`` (one
graph break, ``_parallelize.py``): what the rules below leave to compile in the built-in,
torchvision and smp models is nothing (no graph at all), while each of their 7-64 graph
breaks costs Dynamo's guard checks on DTensor inputs every step (LR-ASPP at 32x128 on one
CPU rank: +10 % per step, ~0.1 ms per break). With the ``trace_under_compile`` option
Dynamo traces the model's code, and compiled graphs hold plain tensors only; every DTensor
op runs eagerly, between graphs:

- Every spatial layer and spatial handler runs eagerly, with a graph break around it. Their
  exchanges and collectives break the graph anyway, and traced, their Python (cached plans,
  error labels, saved-tensor hooks that compare data pointers) made Dynamo guard on module
  names, sizes and pointers and recompile each layer until its recompile limit (38 s of
  compiling for a depth-3 U-Net, and a fresh compile on every step). Dynamo must not trace
  into the autograd functions holding an exchange or a hand-written backward either: it
  breaks at the P2P calls inside them, and where it got through it differentiated the
  decomposed forward instead of running the one-pass backward (spatial BatchNorm: +0.18 s
  per step of a U-Net at 256x1024 on CPU).
- DTensor's own ops (residual adds, SE-block products, permutes, ``contiguous`` ...) run
  eagerly too (``run_eagerly``, called by ``SpatialMode``). Traced, a graph holds DTensor
  inputs and outputs, and AOTAutograd's handling of them fails in three ways (torch
  2.14.1): the compiled backward dispatches aten backward ops on DTensors that DTensor has
  no strategy for (``hardsigmoid_backward``: MobileNetV3's SE blocks); a gradient arriving
  at a compiled backward is a DTensor where the graph guessed a plain tensor, or has
  another placement ("must implement ``__coerce_same_metadata_as_tangent__``": smp
  encoders); a graph output that is a view of a graph input is replayed with
  ``as_strided``, which DTensor refuses (a ConvNeXt block's channels-last ``permute``).
- Dynamo sends a torch function through the active ``TorchFunctionMode`` only when it is in
  its own list of overridable functions, which lacks some that do dispatch in eager
  (``F.hardsigmoid``, ``F.hardswish``, the ``torch._C._nn`` functions): Dynamo put them in
  the graph on the DTensor, past ``SpatialMode``'s handler. ``route_through_modes`` adds
  every function the registry has an entry for to that list.
- Element-wise handlers (activations on the local strip, ``_pointwise.py``) run eagerly
  too. Between graph breaks an activation would be a graph of its own with nothing to
  fuse; the plain-tensor graph would start after the eager unwrap, a graph break inside
  the handler that Dynamo (``nested_graph_breaks`` off) moves out to the caller's frame,
  so the op ran eagerly anyway; and on CPU inductor's code for its backward mask is far
  slower than eager on AVX2 machines (torch 2.14.1: a ``bool`` store from a float vector
  mask becomes two 32-step scalar loops per 8 elements; ``torch.compile(lambda t: t > 0)``
  on 1M floats takes 15.6 ms vs 0.6 ms eager, without this project involved). See
  docs/benchmarks.md.

What is compiled is the model's plain-tensor code (the loss, code on ``to_local()``
strips). Checked against torch 2.14.1; ``tests/test_compile.py``,
``tests/test_compile_models.py`` and ``tests/test_train_e2e.py::test_compile_changes_nothing``
exercise it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "eager_from_eager",
    "not_traced",
    "route_through_modes",
    "run_eagerly",
    "traced_dtensor_op",
]

F = TypeVar("F", bound=Callable)

# Reading a DTensor's metadata creates no graph op; breaking the graph there would only
# multiply graphs (a property getter arrives as ``<property>.__get__``).
# fmt: off
_METADATA = frozenset({
    Tensor.size, Tensor.dim, Tensor.ndimension, Tensor.stride, Tensor.numel, Tensor.nelement,
    Tensor.element_size, Tensor.is_contiguous, Tensor.is_floating_point, Tensor.is_complex,
    Tensor.get_device,
})
# fmt: on


def not_traced(fn: F) -> F:
    """``fn`` runs eagerly under ``torch.compile`` (a graph break around each call)."""
    return torch._dynamo.disable(fn)


def eager_from_eager(fn: F) -> F:
    """Dynamo compiles no frame of ``fn``, nor of what it calls, when eager code calls
    ``fn``; where Dynamo traces a caller of ``fn`` it still inlines ``fn``. For the dispatch
    code (``SpatialMode.__torch_function__``): called from eager code, after a graph break
    at the op, it has nothing to compile, and compiled per op and shape it hit the
    recompile limit."""
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    set_code_exec_strategy(fn.__code__, skip)
    return fn


@not_traced
def run_eagerly(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, eagerly under ``torch.compile`` (a graph break)."""
    return fn(*args, **kwargs)


def traced_dtensor_op(func: Callable) -> bool:
    """Whether Dynamo may trace ``func`` on a DTensor: only metadata reads."""
    return func in _METADATA or getattr(func, "__name__", "") == "__get__"


def route_through_modes(functions: Iterable[Callable]) -> None:
    """Make Dynamo dispatch calls of ``functions`` to the active ``TorchFunctionMode`` (as
    eager does) instead of putting them in the graph unseen (see module doc)."""
    from torch._dynamo.variables.torch import get_overridable_functions

    get_overridable_functions().update(functions)  # the cached set Dynamo consults
