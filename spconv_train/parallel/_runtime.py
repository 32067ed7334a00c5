"""The options, statistics and handler registry of one parallelized model (``runtime_of``),
*current* during its forward (outside one, a process-wide default). A backward runs after
the forward returned: code accounting work there captures the runtime in the forward."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._compile import not_traced, route_through_modes
from ._grad_reduce import GradReducer

#: bumped by every ``register`` / ``refuse`` of any registry: ``lookup``'s resolved entries
#: (a child's include its parent's) are kept while it stays the same
_GENERATION = [0]
_MAX_RESOLVED = 4096  # functions resolved per registry (what the cache keeps alive)


@dataclass(frozen=True)
class Entry:
    """What the registry holds for one function: a handler, or a refusal reason."""

    name: str
    handler: Callable | None = None
    refused: str | None = None
    #: what ``SpatialMode`` calls under ``torch.compile``: the handler when ``traced``,
    #: otherwise the handler run eagerly (exchanges, collectives: no graph material)
    run: Callable | None = field(default=None, compare=False, repr=False)
    #: the builtin function's parameters that torch takes by position or keyword, in order,
    #: and those of them a tensor can be passed to (``positional``)
    params: tuple[str, ...] = field(default=(), compare=False, repr=False)
    tensor_params: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def positional(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with the tensors passed by keyword in the places torch
        takes them by position moved there (``torch.matmul(input=a, other=b)`` -> ``(a,
        b)``, ``x.matmul(other=b)`` -> ``(x, b)``), up to the first parameter not passed or
        not a tensor (or a list / tuple, ``torch.cat(tensors=...)``): handlers take tensors by
        position, their other arguments by torch's keywords."""
        params, n = self.params, len(args)
        if n >= len(params) or params[n] not in kwargs:
            return args, kwargs
        kwargs, moved = dict(kwargs), list(args)
        for name in params[n:]:
            if not isinstance(kwargs.get(name), (torch.Tensor, list, tuple)):
                break
            moved.append(kwargs.pop(name))
        return tuple(moved), kwargs


@functools.cache
def _overrides() -> dict:
    return torch.overrides.get_testing_overrides()


def positional_params(fn: Callable) -> dict:
    """``Entry``'s ``params`` and ``tensor_params`` of a builtin torch function or Tensor
    method (a Python one, ``F.interpolate``, hands its tensor on by position): the names
    ``torch.overrides`` lists (``out`` left out), those aten's schemas type as tensors."""
    if isinstance(fn, types.FunctionType):
        return {}
    try:  # a torch internal (aten's schemas), checked on torch 2.14.1: without it, no move
        sig = inspect.signature(_overrides().get(fn, fn))
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{fn.__name__}")
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = tuple(p.name for p in sig.parameters.values() if p.kind in kinds and p.name != "out")
    args = (a for s in schemas for a in s.arguments if not a.kwarg_only)
    tensors = {a.name for a in args if "Tensor" in str(a.type)}
    tensors = frozenset(tensors | ({"input"} if "self" in tensors else set()))
    return {"params": params, "tensor_params": tensors} if tensors else {}


def function_name(fn: Callable) -> str:
    """A readable name for a torch function or Tensor method (``F.pad``, ``Tensor.mean``)."""
    qual = getattr(fn, "__qualname__", "") or ""
    name = getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if module.endswith("nn.functional"):
        return f"F.{name}"
    if module.startswith("torch._C._nn"):
        return f"torch._C._nn.{name}"
    return f"torch.{name}" if module.startswith("torch") or not module else f"{module}.{name}"


class HandlerRegistry:
    """Function object -> ``Entry``; lookups fall back to ``parent``. Keyed by the object
    model code calls: ``F.conv2d``, ``torch.batch_norm`` (another object than
    ``F.batch_norm``, another signature), ``torch._C._nn.adaptive_max_pool2d`` (always a
    pair), or an unbound Tensor method (``torch.Tensor.mean``, for ``x.mean()``)."""

    def __init__(self, parent: HandlerRegistry | None = None) -> None:
        self.parent = parent
        self._entries: dict[int, tuple[Callable, Entry]] = {}
        #: ``fn -> (fn, entry or None)`` as ``lookup`` resolved it, at ``_generation``
        self._resolved: dict = {}
        self._generation = -1

    def __deepcopy__(self, memo) -> HandlerRegistry:
        new = HandlerRegistry(self.parent)  # a deep-copied model's own entries, same parent
        new._entries = dict(self._entries)  # its own resolved entries, built on use
        return new

    def register(
        self, *functions: Callable, traced: bool = False
    ) -> Callable[[Callable], Callable]:
        """Decorator: while a parallelized model runs, a call of any of ``functions`` (the
        function objects: ``F.pad``, ``torch.batch_norm``, ``torch.Tensor.mean``) with a
        DTensor among its arguments runs the handler instead, with the same arguments; it
        returns what the function returns. ``extend.register_handler``: for every model, over
        a built-in handler; ``runtime.registry.register``: one model. Under ``torch.compile``
        it runs eagerly (a graph break) unless ``traced=True`` (Dynamo inlines it: no DTensor
        op, exchange, collective or cached plan, Dynamo would guard on its state)."""
        if not functions or not all(callable(f) for f in functions):
            raise TypeError("register_handler takes the torch functions themselves, e.g. F.pad")

        route_through_modes(functions)

        def deco(handler: Callable) -> Callable:
            self._put(functions, handler=handler, run=handler if traced else not_traced(handler))
            return handler

        return deco

    def refuse(self, *functions: Callable, reason: str) -> None:
        """Make ``functions`` raise ``SpatialShardingError`` (with ``reason``) on sharded
        DTensors; a function that has a handler keeps it."""
        route_through_modes(functions)
        self._put([fn for fn in functions if self.handler(fn) is None], refused=reason)

    def _put(self, functions, **fields) -> None:
        for fn in functions:  # the function object kept alive with its id: never reused
            entry = Entry(function_name(fn), **positional_params(fn), **fields)
            self._entries[id(fn)] = (fn, entry)
        _GENERATION[0] += 1

    def lookup(self, fn: Callable) -> Entry | None:
        """The entry for ``fn`` here or in a parent (``None``: none), resolved once until a
        registry changes; not under ``torch.compile`` (Dynamo would guard on the cache)."""
        if torch.compiler.is_compiling():
            return self._find(fn)
        if self._generation != _GENERATION[0]:
            self._resolved, self._generation = {}, _GENERATION[0]
        try:
            hit = self._resolved.get(fn)
        except TypeError:  # an unhashable callable
            return self._find(fn)
        if hit is not None and hit[0] is fn:
            return hit[1]
        entry = self._find(fn)
        if len(self._resolved) < _MAX_RESOLVED:
            self._resolved[fn] = (fn, entry)
        return entry

    def _find(self, fn: Callable) -> Entry | None:
        found = self._entries.get(id(fn))
        if found is not None:
            return found[1]
        return self.parent._find(fn) if self.parent is not None else None

    def handler(self, fn: Callable) -> Callable | None:
        """The handler registered for ``fn`` (``None`` if it is refused or unknown)."""
        entry = self.lookup(fn)
        return entry.handler if entry is not None else None

    def functions(self) -> list[Callable]:
        """Every function with an entry, this registry's and its parents'."""
        mine = [fn for fn, _ in self._entries.values()]
        theirs = self.parent.functions() if self.parent is not None else []
        return mine + [fn for fn in theirs if id(fn) not in self._entries]


#: The registry every op module registers into at import (``register_handler``).
DEFAULT_REGISTRY = HandlerRegistry()


@dataclass(frozen=True)
class SpatialOptions:
    """Behaviour switches of a runtime (``parallelize`` keyword arguments)."""

    #: Save conv / max-pool windows as a strip reference + halo columns, rebuilt in the
    #: backward: activation memory per rank one device's / N (docs/design.md, "Saving
    #: windows by reference").
    save_windows_by_reference: bool = True
    #: Let an op move a whole sharded activation (counted, logged) instead of raising.
    allow_gather: bool = False
    #: Zero-padded convs: the interior in place, thin halo windows for the edges, the
    #: exchange overlapped with the interior (``_halo_conv.py``).
    split_halo_conv: bool = True
    #: Broadcast mesh rank 0's parameters and buffers when parallelizing (as DDP does).
    #: False: the caller guarantees identical state (a checkpoint loaded on every rank).
    sync_state: bool = True
    #: Under ``torch.compile``, let Dynamo trace the model's plain-tensor code between
    #: spatial layers; False: the forward runs eagerly as a whole (docs/design.md,
    #: "torch.compile"; its cost: docs/benchmarks.md).
    trace_under_compile: bool = False
    #: Also trace DTensor's own ops and the element-wise handlers (``_compile.py``).
    trace_dtensor_ops: bool = False


@dataclass
class SpatialStats:
    """Since the last ``reset``: halo exchanges (both passes) and the gathers let through."""

    #: seconds blocked on the halo exchange (read ``halo_seconds``)
    _halo_seconds: float = 0.0
    halo_bytes: int = 0
    halo_messages: int = 0
    gathers: int = 0
    #: op name -> count of let-through gathers
    gathered_ops: dict[str, int] = field(default_factory=dict)
    #: (start, end) CUDA events of exchanges not yet settled into ``halo_seconds``
    _pending: list = field(default_factory=list, repr=False)

    @property
    def halo_seconds(self) -> float:
        """Seconds the halo exchange kept this rank waiting (CUDA: between events, as host
        timers would only measure NCCL's enqueue)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self._halo_seconds += sum(s.elapsed_time(e) for s, e in self._pending) / 1e3
            self._pending = []
        return self._halo_seconds

    @halo_seconds.setter
    def halo_seconds(self, value: float) -> None:
        self._pending, self._halo_seconds = [], float(value)

    def reset(self) -> None:
        """Zero every counter."""
        self.restore(SpatialStats())

    def snapshot(self) -> SpatialStats:
        """A copy (to read counters, then ``restore`` them after excluded work)."""
        _ = self.halo_seconds  # settle pending CUDA events first
        return dataclasses.replace(self, gathered_ops=dict(self.gathered_ops), _pending=[])

    def restore(self, saved: SpatialStats) -> None:
        """Set every counter back to ``saved``'s values."""
        fresh = {"gathered_ops": dict(saved.gathered_ops), "_pending": list(saved._pending)}
        self.__dict__.update(saved.__dict__, **fresh)


class SpatialRuntime:
    """Options, statistics and handler registry shared by the ops of one model
    (``registry``: a child of the default one; its handlers apply to this model only)."""

    def __init__(self, mesh=None, options: SpatialOptions | None = None) -> None:
        self.mesh = mesh
        self.options = options or SpatialOptions()
        self.stats = SpatialStats()
        self.registry = HandlerRegistry(parent=DEFAULT_REGISTRY)
        self.grad_reducer = GradReducer()  # ``sum_grad_over``'s
        #: elements of one rank's share of the largest activation a spatial layer took (the
        #: input image at least): the gather guards' yardstick of "activation-sized"
        self.input_share = 0
        #: ``(mesh, placements, global shape)`` of the last NCHW map a spatial layer took in this
        #: forward: the layout of tensors built from shapes alone (``_token_reduce.fourier_block``)
        self.last_image: tuple | None = None

    def __deepcopy__(self, memo) -> SpatialRuntime:
        # own statistics and registry entries; the mesh and the immutable options shared
        new = SpatialRuntime(self.mesh, self.options)
        new.registry = copy.deepcopy(self.registry, memo)
        return new

    def __repr__(self) -> str:
        return f"SpatialRuntime(options={self.options}, stats={self.stats})"


_DEFAULT_RUNTIME = SpatialRuntime()
#: The active runtimes (innermost last), one stack per thread (a context variable). Set
#: once per thread and mutated in place: Dynamo traces list mutations but graph-breaks on
#: ``ContextVar.set`` (torch 2.14), and ``SpatialMode``'s entry is traced where a compiled
#: forward resumes after a graph break.
_STACK: contextvars.ContextVar[list[SpatialRuntime] | None] = contextvars.ContextVar(
    "spconv_train_spatial_runtimes", default=None
)


def current_runtime() -> SpatialRuntime:
    """The runtime of the forward running in this thread (outside one: the default)."""
    stack = _STACK.get()
    return stack[-1] if stack else _DEFAULT_RUNTIME


@contextlib.contextmanager
def activate(runtime: SpatialRuntime) -> Iterator[SpatialRuntime]:
    """Make ``runtime`` current in this thread inside the ``with`` block (nests)."""
    stack = _STACK.get()
    if stack is None:  # inline, not a helper: each Python frame here costs Dynamo a frame
        stack = []
        _STACK.set(stack)
    stack.append(runtime)
    try:
        yield runtime
    finally:
        stack.pop()


def runtime_of(model: nn.Module) -> SpatialRuntime:
    """The runtime ``parallelize`` attached to ``model`` (or to the model in its DDP
    wrapper); ``ValueError`` for a model not parallelized."""
    runtime = getattr(local_module(model), "spatial_runtime", None)
    if not isinstance(runtime, SpatialRuntime):
        raise ValueError(
            f"{type(model).__name__} was not parallelized: call "
            f"spconv_train.parallel.parallelize(model, mesh) first"
        )
    return runtime


def local_module(model: nn.Module) -> nn.Module:
    """The model inside a ``replicate_gradients`` (DDP) wrapper, any other as it is (for
    forwards without DDP's bookkeeping and lock-step: validation, start-up probes)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
