"""Handler registry keyed by the function object model code calls: ``F.conv2d``,
``torch.batch_norm`` (another object than ``F.batch_norm``, another signature),
``torch._C._nn.adaptive_max_pool2d`` (always a pair), or an unbound Tensor method such as
``torch.Tensor.mean`` (what ``__torch_function__`` receives for ``x.mean()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._compile import not_traced, route_through_modes

#: bumped by every ``register`` / ``refuse`` of any registry: ``lookup``'s resolved entries
#: (a child's include its parent's) are kept while it stays the same
_GENERATION = [0]
#: functions resolved per registry at most (a bound on what the cache keeps alive)
_MAX_RESOLVED = 4096


@dataclass(frozen=True)
class Entry:
    """What the registry holds for one function: a handler, or a refusal reason."""

    name: str
    handler: Callable | None = None
    refused: str | None = None
    #: what ``SpatialMode`` calls under ``torch.compile``: the handler when ``traced``,
    #: otherwise the handler run eagerly (exchanges, collectives: no graph material)
    run: Callable | None = field(default=None, compare=False, repr=False)


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
    """Function object -> ``Entry``; lookups fall back to ``parent``."""

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
            self._entries[id(fn)] = (fn, Entry(function_name(fn), **fields))
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
