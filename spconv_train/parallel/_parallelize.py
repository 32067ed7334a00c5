"""``parallelize(model, mesh)``: a single-device model run sharded, its code unchanged.

Every supported module becomes its spatial subclass *in place* (parameters, buffers, hooks
and ``state_dict`` keys untouched), unsupported ones are refused with every path listed
*before* anything changes, and the forward runs under ``SpatialMode`` with the model's
``SpatialRuntime`` (functional calls in model code are handled too)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._compile import not_traced, run_eagerly
from ._dims import GRID_MESH_DIMS, SP
from ._errors import _SPATIAL_MESHES, active_guard, gather_guard, module_label
from ._geometry import SpatialShardingError
from ._mode import DTensorGraphMode, SpatialMode, install
from ._replicas import broadcast_model_state
from ._runtime import SpatialOptions, SpatialRuntime

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
    install()  # the built-in handlers and module swaps (explicit, idempotent: _mode.py)
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
