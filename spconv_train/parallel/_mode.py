"""Route torch calls on width-sharded DTensors to spatial handlers, and ``install()`` them.

Model code calls ``F.interpolate``, ``F.conv2d`` or ``x.mean((2, 3))`` directly (torchvision's
and timm's blocks do): ``SpatialMode`` (a ``TorchFunctionMode``, active while a parallelized
model runs) runs the handler its runtime's registry holds for a call with a DTensor argument,
or raises for a *refused* one (DTensor would gather or be silently wrong, ``docs/halo.md``)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ._compile import (
    IN_PLACE,
    VIEWS,
    eager_from_eager,
    in_dtensor_graphs,
    run_eagerly,
    traced_dtensor_op,
)
from ._errors import add_pointwise_strategies, install_guards, run_dtensor_op
from ._geometry import SpatialShardingError
from ._runtime import DEFAULT_REGISTRY, SpatialRuntime, activate, current_runtime

register_handler = DEFAULT_REGISTRY.register  # the op modules' decorator: every model

_LOCK = threading.Lock()
_INSTALLED = False

#: Ops that DTensor would gather or get wrong on strips (a handler takes precedence).
# fmt: off
_REFUSED = (
    "conv1d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "lp_pool2d",
    "adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_max_pool2d_with_indices",
    "fractional_max_pool2d", "interpolate", "grid_sample", "affine_grid", "batch_norm",
    "group_norm", "instance_norm", "layer_norm", "local_response_norm", "pad",
    "fold", "pixel_shuffle", "pixel_unshuffle", "cross_entropy", "nll_loss", "embedding",
)
# fmt: on
_REASON = (
    "no spatial implementation (it would gather the whole image or mix strips wrongly). Use "
    "a supported layer, register a handler (spconv_train.parallel.extend, "
    "docs/extending.md), or run this part of the model on a gathered tensor explicitly "
    "(x.full_tensor())."
)


def install() -> None:
    """Register every built-in handler, module swap and default refusal, and install
    ``_errors``' patches of DTensor (once, thread-safe). ``parallelize``, ``SpatialMode`` and
    ``extend`` call it first, so a user's handler is never overwritten."""
    global _INSTALLED
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        # every private module: the op modules register on import (no list kept here)
        for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
            if info.name.startswith("_") and not info.name.startswith("__"):
                importlib.import_module(f"{__package__}.{info.name}")
        for name in _REFUSED:  # the distinct F / torch / torch._C._nn functions
            found = [getattr(ns, name, None) for ns in (F, torch, torch._C._nn)]
            fns = {id(fn): fn for fn in found if fn is not None}
            DEFAULT_REGISTRY.refuse(*fns.values(), reason=_REASON)
        install_guards()
        add_pointwise_strategies()
        _INSTALLED = True


#: argument class -> a DTensor, a list or tuple (its items scanned, one level, as torch's
#: argument parsing does) or other; filled as met, so a scan reads a dict, calls nothing
_OTHER, _SEQUENCE, _DTENSOR = 0, 1, 2
_KINDS: dict[type, int] = {DTensor: _DTENSOR, list: _SEQUENCE, tuple: _SEQUENCE}
_KINDS.update(dict.fromkeys((torch.Tensor, torch.nn.Parameter, torch.Size), _OTHER))
_KINDS.update(dict.fromkeys((int, float, bool, str, type(None)), _OTHER))
#: what ``__torch_function__`` receives for a property read (``x.shape``'s ``__get__``)
_METHOD_WRAPPER = type(torch.Tensor.shape.__get__)


def _kind(cls: type) -> int:
    if cls not in _KINDS:
        seq = issubclass(cls, (list, tuple))
        _KINDS[cls] = _DTENSOR if issubclass(cls, DTensor) else _SEQUENCE if seq else _OTHER
    return _KINDS[cls]


def _has_dtensor(args, kwargs) -> bool:
    """Whether a DTensor is among ``args``, ``kwargs`` or the lists and tuples in them."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        cls = a.__class__  # a known class costs no call (the lookup is a subscript)
        kind = _KINDS[cls] if cls in _KINDS else _kind(cls)
        if kind == _DTENSOR:
            return True
        if kind == _SEQUENCE:
            for b in a:
                cls = b.__class__
                if (_KINDS[cls] if cls in _KINDS else _kind(cls)) == _DTENSOR:
                    return True
    return False


class SpatialMode(TorchFunctionMode):
    """Active during a parallelized forward: ``runtime`` current, calls to its registry."""

    #: Trace DTensor ops and element-wise handlers into compiled graphs (``trace_dtensor_ops``,
    #: ``DTensorGraphMode``). A class attribute: Dynamo guards on the mode's type; reading
    #: the runtime's options made it emit a guard it cannot evaluate (torch 2.14.1).
    dtensor_graphs = False

    def __init__(self, runtime: SpatialRuntime | None = None) -> None:
        super().__init__()
        if runtime is None:  # with one, ``parallelize`` installed (a call: one more frame)
            install()
        self.runtime = runtime or current_runtime()

    def __enter__(self):
        self._active = activate(self.runtime)
        self._active.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._active.__exit__(*exc)

    @eager_from_eager  # see _compile.py
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func.__class__ is _METHOD_WRAPPER and func.__name__ == "__get__":
            # a property read (``x.shape``, ``x.requires_grad``): no handler, no graph op
            return func(*args)
        if not kwargs:
            for a in args:  # plain tensors and numbers only: no call (``_has_dtensor``)
                if a.__class__ not in _KINDS or _KINDS[a.__class__] != _OTHER:
                    break
            else:
                return func(*args)
        kwargs = kwargs or {}
        if not _has_dtensor(args, kwargs):  # plain-tensor ops inside layers and handlers
            return func(*args, **kwargs)
        compiling = torch.compiler.is_compiling()
        graphs = compiling and self.dtensor_graphs
        if graphs and func in IN_PLACE:  # eagerly between graphs (see _compile.py)
            return run_eagerly(self.__torch_function__, func, types, args, kwargs)
        entry = self.runtime.registry.lookup(func)
        if entry is not None:
            if entry.handler is not None:
                # eager: no graph break to make (eager_from_eager)
                if not compiling or (graphs and in_dtensor_graphs(entry.handler)):
                    return entry.handler(*args, **kwargs)
                return entry.run(*args, **kwargs)
            raise SpatialShardingError(
                f"{entry.name} is not supported on a width-sharded DTensor: {entry.refused}"
            )
        if compiling and (not graphs or func in VIEWS) and not traced_dtensor_op(func):
            return run_eagerly(func, *args, **kwargs)  # DTensor's own op, outside graphs
        return run_dtensor_op(func, args, kwargs)  # DTensor's rules; errors named (_errors.py)


class DTensorGraphMode(SpatialMode):
    """``SpatialMode`` for the ``trace_dtensor_ops`` option (see ``dtensor_graphs``)."""

    dtensor_graphs = True
