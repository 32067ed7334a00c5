"""``parallelize(model, mesh)``: a single-device model run sharded, its code unchanged.

Every supported module becomes its spatial subclass *in place* (parameters, buffers, hooks
and ``state_dict`` keys untouched), unsupported ones are refused with every path listed
*before* anything changes, and the forward runs under ``SpatialMode``: model code calls
``F.conv2d`` or ``x.mean((2, 3))`` directly (torchvision's and timm's blocks do), and the
mode runs the handler the model's registry holds for a call with a DTensor argument, or
raises for a *refused* one (DTensor would gather or be silently wrong, ``docs/halo.md``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ._compile import (
    IN_PLACE,
    VIEWS,
    eager_from_eager,
    in_dtensor_graphs,
    not_traced,
    run_eagerly,
    traced_dtensor_op,
)
from ._dims import GRID_MESH_DIMS, SP
from ._errors import (
    _SPATIAL_MESHES,
    active_guard,
    add_pointwise_strategies,
    gather_guard,
    install_guards,
    module_label,
    run_dtensor_op,
)
from ._geometry import SpatialShardingError
from ._replicas import broadcast_model_state
from ._runtime import DEFAULT_REGISTRY, SpatialOptions, SpatialRuntime, activate, current_runtime

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
    "no spatial implementation (it would gather the whole image or mix strips wrongly). Use a "
    "supported layer, register a handler (spconv_train.parallel.extend, docs/extending.md), or "
    "run this part of the model on a gathered tensor explicitly (x.full_tensor())."
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
#: properties that are a transpose: routed as ``transpose(-2, -1)`` so its handlers run (DTensor's
#: own rule for ``t.mT`` drops prefix tokens); a complex ``mH`` (a conjugate too) stays DTensor's
_TRANSPOSE_PROPERTIES = (torch.Tensor.mT, torch.Tensor.mH)


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
            # a property read (``x.shape``, ``x.requires_grad``): no handler but the transposes
            x = args[0]
            transposes = func.__self__ in _TRANSPOSE_PROPERTIES
            if transposes and isinstance(x, DTensor) and not x.is_complex():
                return self.__torch_function__(torch.Tensor.transpose, types, (x, -2, -1))
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
                for name in kwargs:  # a tensor by keyword (a loop: no call for others)
                    if name in entry.tensor_params:
                        args, kwargs = entry.positional(args, kwargs)
                        break
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


_SPATIAL_MODULES: dict[type[nn.Module], type[nn.Module]] = {}
_REFUSED_MODULES: dict[type[nn.Module], str] = {
    nn.ConvTranspose1d: "1-D transposed convolution is not supported",
    nn.Fold: "fold sums overlapping windows across the columns of several ranks",
    nn.LocalResponseNorm: "no spatial implementation",
}
#: ``"module.QualName"`` of a class not imported here -> the mixin that makes it spatial
_SPATIAL_MIXINS: dict[str, type] = {}


def register_spatial_module(base: type[nn.Module] | str) -> Callable[[type], type]:
    """Class decorator: ``parallelize`` turns every module of exactly type ``base`` into the
    decorated subclass in place (which must add no parameter or buffer), over a built-in
    swap. ``base`` may be a qualified name (``"timm.models.edgenext.PositionalEncodingFourier"``)
    of a class not imported: the decorated class is then a mixin put in front of it."""

    def deco(cls: type) -> type:
        if isinstance(base, str):
            _SPATIAL_MIXINS[base] = cls
            return cls
        if not issubclass(cls, base):
            raise TypeError(f"{cls.__name__} must subclass {base.__name__}")
        # eager under torch.compile: its exchanges break the graph anyway (docs/design.md)
        cls.forward = not_traced(cls.forward)
        _SPATIAL_MODULES[base] = cls
        _REFUSED_MODULES.pop(base, None)
        return cls

    return deco


def spatial_module(base: type[nn.Module], fn: Callable, *attrs: str, module: str) -> type:
    """``Spatial<base>``, registered: ``fn(x, *attributes, what=label)`` on a DTensor input
    (``base``'s forward on a plain one), for layers whose sharded form is a function of
    their attributes (pools, resizes, group norm); ``module``: the caller's ``__name__``."""

    def forward(self, x):
        if not isinstance(x, DTensor):
            return base.forward(self, x)
        return fn(x, *(getattr(self, a) for a in attrs), what=module_label(self))

    name = f"Spatial{base.__name__}"
    doc = f"``nn.{base.__name__}`` that runs sharded on a DTensor input (any layout)."
    ns = {"forward": forward, "__doc__": doc, "__module__": module, "__qualname__": name}
    return register_spatial_module(base)(type(name, (base,), ns))


def refuse_module(base: type[nn.Module], reason: str) -> None:
    """Make ``parallelize`` refuse models holding a module of exactly type ``base`` (its
    path and ``reason`` named)."""
    if base not in _SPATIAL_MODULES:
        _REFUSED_MODULES[base] = reason


class _SpatialRoot:
    """The parallelized root's forward: under ``SpatialMode`` and the gather guard, eagerly
    under ``torch.compile`` unless traced. The two contexts are one opaque object (Dynamo
    graph-breaks on it): two nested ``with`` blocks in a traced frame hit its
    "len(block_stack) == 1" assertion at a graph break inside them (torch 2.14)."""

    def forward(self, *args, **kwargs):
        opts = self.spatial_runtime.options
        traced = opts.trace_under_compile or opts.trace_dtensor_ops
        if torch.compiler.is_compiling() and not traced:
            return run_eagerly(self.forward, *args, **kwargs)  # see SpatialOptions
        with _SpatialContext(self.spatial_runtime):
            return super().forward(*args, **kwargs)


class _SpatialContext:
    def __init__(self, runtime: SpatialRuntime) -> None:
        mode = (DTensorGraphMode if runtime.options.trace_dtensor_ops else SpatialMode)(runtime)
        self.contexts, self.runtime = (mode, gather_guard(runtime.options.allow_gather)), runtime

    def __enter__(self) -> None:
        self.runtime.last_image = None  # a layout from the last forward is no guide
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def parallelize(model: nn.Module, mesh: DeviceMesh, **options) -> nn.Module:
    """Make ``model`` run sharded over the spatial dims of ``mesh`` (``sp``, or ``sp_h`` /
    ``sp_w`` ...): swaps supported layers in place and returns the same model, with a new
    ``SpatialRuntime`` attached (``runtime_of(model)``). Fed a DTensor ``Shard(3)``
    (``[Shard(0), Shard(3)]`` on a ``(dp, sp)`` mesh), its output and, after ``backward``,
    every rank's parameter gradients equal one device's. ``options``: ``SpatialOptions``
    fields (``sync_state``, default True, first sets every rank's state to mesh rank 0's).
    Raises ``SpatialShardingError`` naming every module that cannot run sharded, before
    changing anything; ``TypeError`` for an unknown option."""
    known = {f.name for f in dataclasses.fields(SpatialOptions)}
    if unknown := sorted(set(options) - known):  # a typo raises: no silent default
        raise TypeError(f"parallelize: unknown option(s) {unknown}; valid: {sorted(known)}")
    opts = SpatialOptions(**options)
    install()  # the built-in handlers and module swaps (idempotent)
    names = mesh.mesh_dim_names or ()  # several dims: ``sp``, or two or three grid dims
    if mesh.ndim > 1 and SP not in names and sum(n in names for n in GRID_MESH_DIMS) < 2:
        raise SpatialShardingError(
            f"parallelize: a {mesh.ndim}-D mesh needs mesh_dim_names with an 'sp' dimension "
            f"(e.g. ('dp', 'sp')), or 'sp_h' and 'sp_w' for H x W tiles (two or three of 'sp_d', "
            f"'sp_h', 'sp_w' for volumes), got {mesh.mesh_dim_names}"
        )
    _SPATIAL_MESHES[mesh] = opts.allow_gather  # implicit moves on it guarded outside the forward
    problems = [
        f"  {path or '<root>'} ({type(m).__name__}): {_REFUSED_MODULES[type(m)]}"
        for path, m in model.named_modules()
        if type(m) in _REFUSED_MODULES
    ]
    if problems:
        raise SpatialShardingError(
            "parallelize: these modules cannot run on a width-sharded image:\n"
            + "\n".join(problems)
            + "\nReplace them in the model, or keep them out of the sharded part."
        )
    if opts.sync_state:
        broadcast_model_state(model, mesh)
    for path, module in model.named_modules():
        kind = type(module)
        mixin = _SPATIAL_MIXINS.get(f"{kind.__module__}.{kind.__qualname__}")
        if mixin is not None and kind not in _SPATIAL_MODULES:
            cls = type(f"Spatial{kind.__name__}", (mixin, kind), {"__module__": __name__})
            register_spatial_module(kind)(cls)
        if kind in _SPATIAL_MODULES:
            module.__class__ = _SPATIAL_MODULES[kind]
            module.spatial_name = path or type(model).__name__
    if not isinstance(model, _SpatialRoot):
        root = type(model)
        model.__class__ = type(f"Spatial{root.__name__}", (_SpatialRoot, root), {})
    model.spatial_mesh = mesh
    model.spatial_runtime = SpatialRuntime(mesh, opts)
    for path, module in model.named_modules():  # hooks: the guard names an op's module
        if not getattr(module, "_spatial_tracked", False):
            name = path or type(model).__name__
            module.register_forward_pre_hook(functools.partial(_enter, name))
            module.register_forward_hook(_leave)
            module._spatial_tracked = True
    return model


def _enter(path: str, module, args) -> None:
    if (guard := active_guard()) is not None:
        guard.modules.append(path)


def _leave(module, args, output) -> None:
    guard = active_guard()
    if guard is not None and guard.modules:
        guard.modules.pop()
