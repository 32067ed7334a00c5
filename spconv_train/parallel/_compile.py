"""How the parallel layer meets ``torch.compile`` (the one place that touches Dynamo); the
three modes and why: docs/design.md, "``torch.compile``"; speed: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor

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
    """``fn`` runs eagerly under ``torch.compile`` (a graph break around each call); from
    eager code it is ``fn`` behind one flag check (Dynamo's ``disable`` wrapper would
    switch the frame callback off and on per call; ``eager_from_eager`` suffices there)."""
    disabled = torch._dynamo.disable(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo traces a caller: a graph break here
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return eager_from_eager(call)


def eager_from_eager(fn: F) -> F:
    """Dynamo compiles no frame of ``fn`` or below when eager code calls it (a traced
    caller still inlines it): the dispatch code, compiled per op and shape after a graph
    break, hit the recompile limit with nothing to compile."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    set_code_exec_strategy(fn.__code__, skip)
    return fn


@not_traced
def run_eagerly(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, eagerly under ``torch.compile`` (a graph break)."""
    return fn(*args, **kwargs)


def graph_handler(handler: F) -> F:
    """Mark ``handler`` as graph material under ``trace_dtensor_ops``: only ``to_local`` /
    ``from_local`` around plain local ops (no exchange, collective or cached plan)."""
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
IN_PLACE = frozenset({
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
VIEWS = frozenset({
    Tensor.permute, torch.permute, Tensor.transpose, torch.transpose, Tensor.view,
    Tensor.view_as, Tensor.reshape, torch.reshape, Tensor.reshape_as, Tensor.flatten,
    torch.flatten, Tensor.unflatten, Tensor.squeeze, torch.squeeze, Tensor.unsqueeze,
    torch.unsqueeze, Tensor.expand, Tensor.expand_as, Tensor.narrow, torch.narrow,
    Tensor.movedim, torch.movedim, Tensor.t, Tensor.unbind, torch.unbind, Tensor.split,
    torch.split, Tensor.chunk, torch.chunk, Tensor.detach, Tensor.__getitem__,
    Tensor.contiguous,
})
# fmt: on


def traced_dtensor_op(func: Callable) -> bool:
    """Whether Dynamo may trace ``func`` on a DTensor: only metadata reads."""
    return func in _METADATA or getattr(func, "__name__", "") == "__get__"


def route_through_modes(functions: Iterable[Callable]) -> None:
    """Make Dynamo dispatch ``functions`` to the active ``TorchFunctionMode`` as eager does:
    its list of overridable functions lacks some (``F.hardswish``, ``torch._C._nn``'s)."""
    from torch._dynamo.variables.torch import get_overridable_functions

    get_overridable_functions().update(functions)  # the cached set Dynamo consults
