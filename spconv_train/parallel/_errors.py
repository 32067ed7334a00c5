"""Module labels, refusals for ops DTensor has no spatial rule for (``run_dtensor_op``) and
the no-silent-gather guards (docs/design.md, ``_errors.py``'s row). DTensor internals (torch
2.14.1): ``ExplicitRedistributionContext.observe_redistribution`` (``tests/test_no_gather.py``)
and ``_register_single_dim_pointwise`` (``add_pointwise_strategies``, ``tests/test_inplace.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import ExplicitRedistributionContext
from torch.distributed.tensor.placement_types import _StridedShard

from ._dims import DP
from ._geometry import SpatialShardingError, all_shard_bounds
from ._prefix_shard import prefix_of
from ._runtime import current_runtime, function_name

log = logging.getLogger("spconv_train.parallel")
#: Fragments of DTensor's own error messages (torch 2.14, lower case): "no sharding rule".
_DTENSOR_ERRORS = re.compile(
    "dtensor|unevenly sharded|_stridedshard|sharding (strateg|propagation)"
)


@dataclass
class GatherEvent:
    """One implicit redistribution of a sharded activation that was allowed."""

    op: str
    module: str
    src: str
    dst: str


@dataclass
class _Guard:
    allow: bool
    modules: list[str] = field(default_factory=list)


#: The active guard, per thread. A ``threading.local`` on purpose: Dynamo cannot trace it,
#: so it graph-breaks where the compiled forward enters the guard and runs that eagerly (a
#: traceable store would let Dynamo trace into the entry and break inside it).
_local = threading.local()
#: Allowed gathers (``allow_gather=True``) in this process, oldest first.
GATHER_EVENTS: list[GatherEvent] = []


def active_guard() -> _Guard | None:
    """This thread's guard of a running parallelized forward (``None`` outside one)."""
    return getattr(_local, "guard", None)


@contextlib.contextmanager
def gather_guard(allow: bool = False):
    """While active, implicit moves of a sharded activation raise (``allow``: counted)."""
    prev = active_guard()
    _local.guard = _Guard(allow, list(prev.modules) if prev else [])
    try:
        yield _local.guard
    finally:
        _local.guard = prev


def module_path() -> str:
    """Path of the innermost module of the parallelized model running now, or ``<model>``."""
    guard = active_guard()
    return guard.modules[-1] if guard is not None and guard.modules else "<model>"


def module_label(module: nn.Module) -> str:
    """``"<spatial_name> (<TorchClass>(<extra_repr>))"`` of ``module``, cached on it."""
    name = getattr(module, "spatial_name", "") or "<module>"
    cached = module.__dict__.get("_spatial_label")
    if cached is None or cached[0] != name:
        base = next(c for c in type(module).__mro__ if c.__module__.startswith("torch."))
        cached = (name, f"{name} ({base.__name__}({module.extra_repr()}))")
        module.__dict__["_spatial_label"] = cached  # plain attribute, not a parameter or buffer
    return cached[1]


def _moves_activation(src, dst) -> bool:
    """Whether the move changes a split of a non-batch dim (``Shard(0)``: data parallel)."""
    return any(
        p != q and (p.is_shard() or type(p) is _StridedShard) and (type(p), p.dim) != (Shard, 0)
        for p, q in zip(src.placements, dst.placements, strict=False)
    )


def guard_gather(op: str, src: str, dst: str, why: str) -> None:
    """A move of a sharded activation by ``op`` (``src`` -> ``dst`` placements) in a
    parallelized forward: raise saying ``why`` and the ways out, or with ``allow_gather``
    log and count it (``GATHER_EVENTS``, ``stats``); for handlers that see one coming."""
    guard = active_guard()
    if guard is None:
        return
    where = module_path()
    if not guard.allow:
        raise SpatialShardingError(
            f"an op in module '{where}' ({op}) {why} (gathering the image on every rank). "
            f"Replace the op with a supported one, make it spatial (spconv_train.parallel."
            f"extend.register_handler, docs/extending.md), or accept the gather explicitly with "
            f"parallelize(..., allow_gather=True) (config: parallel.allow_gather: true)."
        )
    GATHER_EVENTS.append(GatherEvent(op, where, src, dst))
    stats = current_runtime().stats
    stats.gathers += 1
    stats.gathered_ops[op] = stats.gathered_ops.get(op, 0) + 1
    log.warning("allowed gather of a sharded activation in %s: %s", where, op)


_original = ExplicitRedistributionContext.observe_redistribution.__func__


def _op_of(message) -> str | None:
    """The op an implicit redistribution's ``message`` names (``"... for aten.x(..."``)."""
    return (found := re.search(r"for (\S+?)[(\s]", str(message))) and found.group(1)


def _observe(cls, src_spec, dst_spec, message):
    meta = src_spec.tensor_meta
    # only token layouts (a _StridedShard, PrefixShard included) can be misread
    if meta is not None and any(isinstance(p, _StridedShard) for p in src_spec.placements):
        what = f"an implicit redistribution for {_op_of(message) or 'an op'}"
        check_tokens_move(what, src_spec.mesh, src_spec.placements, meta.shape, dst_spec.placements)
    inside = active_guard() is not None
    # outside the forward: on a parallelized model's mesh and outside any backward (the
    # model's own gradient moves, e.g. from_local's of a small replicated map, are weighed
    # by the communication audit); the graph task id is -1 outside one (torch 2.14.1)
    outside = src_spec.mesh in _SPATIAL_MESHES and torch._C._current_graph_task_id() == -1
    if (inside or outside) and _moves_activation(src_spec, dst_spec):
        op = _op_of(message) or str(message)
        src, dst = str(src_spec.placements), str(dst_spec.placements)
        if inside:
            why = "has no spatial implementation, and DTensor would redistribute the width-"
            guard_gather(op, src, dst, f"{why}sharded activation {src} -> {dst} to run it")
        elif not _SPATIAL_MESHES[src_spec.mesh]:
            raise SpatialShardingError(
                f"{op} outside the parallelized model's forward (a loss or a metric on its "
                f"output?) would make DTensor redistribute a tensor sharded over the image "
                f"{src} -> {dst} (gathering the image on every rank). Compute it on the local "
                f"parts (y.to_local(); the losses and metrics of spconv_train.train), gather "
                f"explicitly if that is meant (y.full_tensor()), or accept the gather with "
                f"parallelize(..., allow_gather=True) (config: parallel.allow_gather: true)."
            )
        else:
            GATHER_EVENTS.append(GatherEvent(op, "<outside the forward>", src, dst))
            log.warning("allowed gather of a sharded tensor outside the forward: %s", op)
    return _original(cls, src_spec, dst_spec, message)


#: The meshes of parallelized models and their ``allow_gather`` (the last ``parallelize``
#: on a mesh sets it): implicit moves on them are guarded outside the forward too.
_SPATIAL_MESHES: dict = {}


def _misread_mesh_dims(mesh, placements, shape) -> dict[int, tuple[int, ...]]:
    """``{tensor dim: mesh dims}`` of the dims holding pixel tokens nested over several
    spatial mesh dims that DTensor's own chunking reads differently: two mesh dims of more
    than one rank, or one whose chunks (``_token_layout._nest``) differ (uneven rows)."""
    if not any(isinstance(p, _StridedShard) for p in placements):
        return {}
    names = mesh.mesh_dim_names or ()
    chains: dict[int, list[tuple[int, int]]] = {}
    for m, p in enumerate(placements):
        if (p.is_shard() or isinstance(p, _StridedShard)) and names[m : m + 1] != (DP,):
            chains.setdefault(p.dim % len(shape), []).append((getattr(p, "split_factor", 1), m))
    found = {}
    for d, chain in chains.items():
        chain.sort()
        moving = [j for j, (_, m) in enumerate(chain) if mesh.size(m) > 1]
        if len(chain) < 2 or chain[-1][0] == 1 or not moving:
            continue
        if len(moving) == 1:  # one split moves: misread where its chunks differ
            (sf, m), n = chain[moving[0]], shape[d]
            nxt = chain[moving[0] + 1][0] if moving[0] + 1 < len(chain) else n
            if nxt % sf or n % nxt:
                continue  # not nested: the one-dim meaning, DTensor's own
            ours = [(b - a) * (n // nxt) for a, b in all_shard_bounds(nxt // sf, mesh.size(m))]
            if ours == [b - a for a, b in all_shard_bounds(n // sf, mesh.size(m))]:
                continue
        found[d] = tuple(m for _, m in chain)
    return found


def check_tokens_move(what: str, mesh, placements, shape, target=None) -> None:
    """Raise naming ``what`` when moving a tensor of ``shape`` laid out as ``placements`` to
    ``target`` (``None``: all ``Replicate``) changes a mesh dim of nested pixel tokens or of
    tokens behind prefix (class / register) tokens, which DTensor would read wrongly."""
    for m, p in enumerate(placements):
        # a PrefixShard (_prefix_shard.py) reads as its _StridedShard to DTensor, which
        # would gather or re-split the tokens without the first rank's prefix rows
        if prefix_of(p) and (target is None or target[m] != p):
            raise SpatialShardingError(
                f"{what} of a tensor {tuple(shape)} {tuple(placements)} in module "
                f"'{module_path()}' is not supported: dim {p.dim} holds {p.prefix} prefix "
                "(class / register) tokens on one rank in front of the pixel tokens, which "
                "DTensor reads as its own chunking (wrong values). Slice the prefix off first "
                f"(x[:, {p.prefix}:] gives the pixel tokens; x[:, :{p.prefix}] the prefix, "
                "replicated) or build the model without class token (class_token: false, no "
                "reg_tokens)."
            )
    names = mesh.mesh_dim_names or ()
    for d, mesh_dims in _misread_mesh_dims(mesh, placements, shape).items():
        if target is not None and all(target[m] == placements[m] for m in mesh_dims):
            continue
        on = [names[m] if m < len(names) else str(m) for m in mesh_dims]
        raise SpatialShardingError(
            f"{what} of a tensor {tuple(shape)} {tuple(placements)} in module '{module_path()}' "
            f"is not supported: dim {d} holds the pixel tokens of a map split over mesh dims {on} "
            "(H x W tiles or rows), nested splits that DTensor reads as its own chunking (wrong "
            "values). Reshape the tokens back to the map (B, C, H, W) first (e.g. "
            "t.transpose(1, 2).reshape(B, C, H, W)) and call it on the map."
        )


_original_redistribute = DTensor.redistribute
_original_full_tensor = DTensor.full_tensor


@functools.wraps(_original_redistribute)
def _redistribute(self, device_mesh=None, placements=None, **kwargs):
    if placements is not None and (device_mesh is None or device_mesh == self.device_mesh):
        check_tokens_move(
            "DTensor.redistribute()", self.device_mesh, self.placements, self.shape, placements
        )
    return _original_redistribute(self, device_mesh, placements, **kwargs)


@functools.wraps(_original_full_tensor)
def _full_tensor(self, **kwargs):
    check_tokens_move("DTensor.full_tensor()", self.device_mesh, self.placements, self.shape)
    return _original_full_tensor(self, **kwargs)


def install_guards() -> None:
    """Route DTensor's reports of implicit redistributions through the guard; make
    ``DTensor.redistribute`` and ``full_tensor`` (which calls it, torch 2.14.1) of nested
    pixel tokens raise instead of returning wrong values (``_mode.install``)."""
    ExplicitRedistributionContext.observe_redistribution = classmethod(_observe)
    DTensor.redistribute = _redistribute
    DTensor.full_tensor = _full_tensor


#: Backward ops of element-wise functions that DTensor (torch 2.14.1) has no strategy for.
_POINTWISE_BACKWARDS = ("hardtanh_backward", "hardswish_backward", "hardsigmoid_backward")


def add_pointwise_strategies() -> None:
    """Give DTensor the element-wise rule for ``_POINTWISE_BACKWARDS`` (``install``)."""
    from torch.distributed.tensor._ops import _pointwise_ops

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in _POINTWISE_BACKWARDS:
        op = getattr(torch.ops.aten, name).default
        known = (propagator.op_strategy_funcs, propagator.op_single_dim_strategy_funcs)
        if any(op in funcs for funcs in known):
            continue
        if hasattr(_pointwise_ops, "_register_single_dim_pointwise"):  # torch 2.14
            _pointwise_ops._register_single_dim_pointwise(op)
        else:  # torch 2.11 (the lent GPU machines' only torch: docs/benchmarks.md "One GPU")
            from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
            from torch.distributed.tensor._ops.utils import register_op_strategy

            info = RuntimeSchemaInfo(static_kwargkey=["out"])
            register_op_strategy(op, schema_info=info)(_pointwise_ops.pointwise_strategy)


def _dtensors(args, kwargs) -> list[DTensor]:
    """The DTensors among ``args``, ``kwargs`` and the lists and tuples in them."""
    found = (a if isinstance(a, (list, tuple)) else (a,) for a in (*args, *kwargs.values()))
    return [t for ts in found for t in ts if isinstance(t, DTensor)]


def _lost_prefix(func, args, kwargs, lost: DTensor) -> None:
    """Refuse ``lost``, an output of DTensor's own rule for ``func`` with a ``_StridedShard``,
    when an input had prefix tokens (``t.detach()``, ``torch.where``, ``t ** 2``, torch
    2.14.1): a layout the ranks' tokens (the prefix on the first rank) do not have."""
    prefixed = [t for t in _dtensors(args, kwargs) if any(map(prefix_of, t.placements))]
    if prefixed:
        raise SpatialShardingError(
            f"{function_name(func)} in module '{module_path()}' of tokens "
            f"{tuple(prefixed[0].shape)} {tuple(prefixed[0].placements)} behind prefix (class / "
            f"register) tokens: DTensor's own rule drops the prefix (giving "
            f"{tuple(lost.placements)}), which would be silently wrong. Run it on the pixel "
            f"tokens (x[:, p:]) and the prefix (x[:, :p]) apart, or register a handler "
            f"(spconv_train.parallel.register_handler)."
        )


#: the result classes holding several outputs: ``torch.sort``'s, ``torch.frexp``'s ... too
_MANY = frozenset((tuple, list, *torch.return_types.all_return_types))


def run_dtensor_op(func, args, kwargs):
    """``func(*args, **kwargs)``; a DTensor error becomes a ``SpatialShardingError``, an
    output that lost an input's prefix tokens is refused (``_lost_prefix``)."""
    try:
        out = func(*args, **kwargs)
        for o in out if out.__class__ in _MANY else (out,):  # few calls: host overhead
            if o.__class__ is DTensor:
                for p in o.placements:
                    if p.__class__ is _StridedShard:  # not a PrefixShard
                        _lost_prefix(func, args, kwargs, o)
        return out
    except SpatialShardingError:
        raise
    except (RuntimeError, NotImplementedError, AssertionError, ValueError) as exc:
        text = " ".join(str(exc).split())
        if not _DTENSOR_ERRORS.search(text.lower()):
            raise
        found = [f"{tuple(t.shape)} {tuple(t.placements)}" for t in _dtensors(args, kwargs)]
        raise SpatialShardingError(
            f"{function_name(func)} in module '{module_path()}' is not supported on these "
            f"sharded inputs ({'; '.join(found)}): DTensor has no local rule for it "
            f"({text[:300]}). Use a supported op, make it spatial (spconv_train.parallel."
            f"register_handler), or gather explicitly (x.full_tensor())."
        ) from exc
