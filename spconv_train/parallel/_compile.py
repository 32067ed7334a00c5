"""How the parallel layer meets ``torch.compile`` (the one place that touches Dynamo).

Three modes, chosen by ``parallelize`` options (``SpatialOptions``; from YAML,
``training.compile_mode: default | trace | dtensor_graphs``, ``train/model_setup.py``):

1. Default: the parallelized forward runs eagerly as a whole under ``torch.compile`` (one
   graph break, ``_parallelize.py``); nothing inside it is compiled.
2. ``trace_under_compile``: Dynamo traces the model's code; compiled graphs hold plain
   tensors only and every DTensor op runs eagerly, between graphs (``run_eagerly``, called
   by ``SpatialMode``). What is compiled is plain-tensor model code (the loss, code on
   ``to_local()`` blocks); the built-in, torchvision and smp models have none.
3. ``trace_dtensor_ops`` (opt-in): as 2, but DTensor's own ops (residual adds, products)
   and the element-wise handlers (``graph_handler``: ``to_local``, the plain op,
   ``from_local``) are traced into graphs with DTensor inputs and outputs
   (``DTensorGraphMode``). Exact on the U-Net, smp Unet and a ConvNeXt-style block at 2
   ranks (fp64, ``tests/test_compile.py``, ``tests/test_compile_models.py``; LR-ASPP is
   exact too but compiles one frame again in its second step, docs/benchmarks.md), with
   torch 2.14.1, once two AOTAutograd failures are kept out of the graphs:

   - ``a += b`` on a DTensor graph input (Dynamo hands it over as ``Tensor.add_``) is an
     input mutation whose joint graph fails ("aten.add.Tensor got mixed torch.Tensor and
     DTensor"): in-place ops on DTensors run eagerly between graphs (``mutates_input``),
     in place (running them out of place would drop the update of ``x.add_(y)`` called
     for its side effect);
   - a graph output that views a DTensor input (a ``permute``) is regenerated outside the
     graph and its backward calls ``as_strided`` on a DTensor ("as_strided not supported
     with DTensor"): DTensor views run eagerly between graphs (``returns_view``).

   The other failures seen with DTensor graphs (``hardsigmoid_backward`` without a sharding
   strategy, tangents "must implement ``__coerce_same_metadata_as_tangent__``") do not
   occur once the element-wise functions go through their handlers (the plain op on the
   local tensor) and the residual adds run eagerly.

In every mode:

- Spatial layers and the other handlers run eagerly, a graph break around each: their
  exchanges break the graph anyway, and traced, their Python (cached plans, labels,
  saved-tensor hooks comparing data pointers) made Dynamo guard on names, sizes and
  pointers and recompile every layer; through their autograd functions Dynamo would
  differentiate the decomposed forward instead of running the one-pass backward.
- Dynamo sends a function through the active ``TorchFunctionMode`` only when it is in its
  list of overridable functions, which lacks some that dispatch in eager (``F.hardsigmoid``,
  ``F.hardswish``, the ``torch._C._nn`` functions); ``route_through_modes`` adds every
  function the registry has an entry for.

Why mode 3 is not the default: between two spatial layers the U-Net has one ReLU and a
ResNet block an add and a ReLU, nothing for inductor to fuse, and on CPU inductor's
kernels that store a ReLU's ``bool`` backward mask ran 30-60x slower than eager on the
machine measured (docs/benchmarks.md, ``torch.compile``). ``tests/test_compile.py``,
``tests/test_compile_models.py`` and
``tests/test_train_e2e.py::test_activation_checkpointing_and_compile_change_nothing``
exercise the modes.

Why spatial layers are not opaque nodes of one whole-model graph (a design measured and
not kept, 2026-11-27, 2-core Intel Xeon, torch 2.14.1 CPU): one generic custom op per layer
call (its local inputs re-wrapped as DTensors, the eager layer run inside with its autograd
tape kept under a handle, a backward op running ``torch.autograd.grad`` through the tape)
compiled the whole U-Net into one graph, exact in fp64 and with inductor in fp32 at 2
ranks, but stepped 1.04-1.27x slower than eager (1 and 2 ranks, 1x3x64x256 and 1x3x128x512):
each region pays the eager layer's Python plus its own (custom-op dispatch, re-wrapping,
the tape, a nested autograd engine run, per-use parameter-gradient sums, since the bucketed
reducer cannot span nested backwards), and the only code inductor gains on between layers
is a ReLU. Dynamo also hit ``RecursionError`` tracing smp's ResNet and torchvision's
MobileNetV3 encoders that way. Faster than eager needs per-family custom ops whose impls
call the layers' plain-tensor forward and backward bodies directly (no DTensor, no nested
engine inside), with the parameter gradients leaving through ``AccumulateGrad`` as in eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "eager_from_eager",
    "graph_handler",
    "in_dtensor_graphs",
    "mutates_input",
    "returns_view",
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
    """``fn`` runs eagerly under ``torch.compile`` (a graph break around each call).

    Called from eager code it is ``fn`` itself behind one flag check: Dynamo's
    ``disable`` wrapper switches the frame callback off and on around every call, which
    the spatial layers' forwards would pay per call and step; ``eager_from_eager`` already
    keeps Dynamo from compiling any frame below an eager call."""
    disabled = torch._dynamo.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo traces a caller: a graph break here
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return eager_from_eager(call)


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


def graph_handler(handler: F) -> F:
    """Mark ``handler`` as graph material under the ``trace_dtensor_ops`` option: its only
    DTensor work is ``to_local`` / ``from_local`` around plain local ops (no exchange, no
    collective, no cached plan), so Dynamo may inline it into a graph with DTensor inputs."""
    # an attribute, not a set: Dynamo cannot guard a set lookup of an object it reached
    # through the mode stack (NameError in its guard code, torch 2.14.1)
    handler.in_dtensor_graphs = True
    return handler


def in_dtensor_graphs(handler: Callable) -> bool:
    """Whether ``handler`` is traced under ``trace_dtensor_ops`` (``graph_handler``)."""
    return getattr(handler, "in_dtensor_graphs", False)


# ``a += b`` on a DTensor graph input is an input mutation AOTAutograd cannot
# differentiate through a later ``to_local`` (torch 2.14.1: "aten.add.Tensor got mixed
# torch.Tensor and DTensor" while tracing the joint graph; the residual blocks of
# torchvision's and smp's ResNets). Dynamo hands ``a += b`` to the mode as ``Tensor.add_``.
# Under ``trace_dtensor_ops`` such ops run eagerly, in place, between graphs.
# fmt: off
_IN_PLACE = frozenset({
    Tensor.__iadd__, Tensor.__isub__, Tensor.__imul__, Tensor.__itruediv__, Tensor.add_,
    Tensor.sub_, Tensor.mul_, Tensor.div_,
})
# fmt: on


# A graph whose output is a view of its DTensor input has AOTAutograd regenerate the view
# outside the graph, and the backward of that view calls ``as_strided`` on a DTensor,
# which DTensor refuses (torch 2.14.1: "as_strided not supported with DTensor", the
# ConvNeXt block's ``permute``). A view costs nothing eagerly, so under
# ``trace_dtensor_ops`` DTensor views run eagerly, between graphs.
# fmt: off
_VIEWS = frozenset({
    Tensor.permute, torch.permute, Tensor.transpose, torch.transpose, Tensor.view,
    Tensor.view_as, Tensor.reshape, torch.reshape, Tensor.reshape_as, Tensor.flatten,
    torch.flatten, Tensor.unflatten, Tensor.squeeze, torch.squeeze, Tensor.unsqueeze,
    torch.unsqueeze, Tensor.expand, Tensor.expand_as, Tensor.narrow, torch.narrow,
    Tensor.movedim, torch.movedim, Tensor.t, Tensor.unbind, torch.unbind, Tensor.split,
    torch.split, Tensor.chunk, torch.chunk, Tensor.detach, Tensor.__getitem__,
    Tensor.contiguous,
})
# fmt: on


def returns_view(func: Callable) -> bool:
    """Whether ``func`` may return a view of its input (run eagerly in DTensor graphs)."""
    return func in _VIEWS


def mutates_input(func: Callable) -> bool:
    """Whether ``func`` is an in-place arithmetic op (run eagerly in DTensor graphs)."""
    return func in _IN_PLACE


def traced_dtensor_op(func: Callable) -> bool:
    """Whether Dynamo may trace ``func`` on a DTensor: only metadata reads."""
    return func in _METADATA or getattr(func, "__name__", "") == "__get__"


def route_through_modes(functions: Iterable[Callable]) -> None:
    """Make Dynamo dispatch calls of ``functions`` to the active ``TorchFunctionMode`` (as
    eager does) instead of putting them in the graph unseen (see module doc)."""
    from torch._dynamo.variables.torch import get_overridable_functions

    get_overridable_functions().update(functions)  # the cached set Dynamo consults
