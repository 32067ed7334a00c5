"""Tensor dims and mesh dims: which tensor dims a DTensor's placements shard (others than
plain ``Shard`` / ``Replicate``, ``handled`` False, are left to DTensor's rules), cached mesh
lookups, ``ParallelDims`` (the mesh dim names), and the way in and out of DTensor at the
spatial layers (``wrap_local`` / ``local_of``, docs/design.md; their DTensor internals are
checked against the public API by ``tests/test_dtensor_wrap.py``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._api import _FromTorchTensor, _ToTorchTensor

_PLAIN = (Shard, Replicate)


def handled(x) -> bool:
    """True for a DTensor whose placements are all exactly ``Shard`` or ``Replicate``."""
    return isinstance(x, DTensor) and all(type(p) in _PLAIN for p in x.placements)


def norm_dim(d: int, ndim: int) -> int:
    """``d`` as a non-negative dimension index of an ``ndim``-D tensor."""
    if not -ndim <= d < max(ndim, 1):
        raise IndexError(f"dimension {d} out of range for a {ndim}-D tensor")
    return d % ndim if ndim else 0


def sharded_dims(x: DTensor) -> dict[int, int]:
    """``{tensor dim: mesh dim}`` for every sharded dimension of ``x`` (non-negative)."""
    return {norm_dim(p.dim, x.ndim): i for i, p in enumerate(x.placements) if isinstance(p, Shard)}


#: ``(id(mesh), placements, their types, shape, stride, dtype) -> (mesh, DTensorSpec)``
#: (the entry holds its mesh: its id is not reused while cached)
_SPECS: dict[tuple, tuple] = {}
#: ``(spec, grad_placements, grad shape, grad stride, grad dtype, local stride) -> spec``
#: of the gradient (``local_of``'s backward)
_GRAD_SPECS: dict[tuple, object] = {}
_MAX_ENTRIES = 4096

#: ``DTensor(local, spec, requires_grad=...)`` without ``DTensor.__init__``: torch 2.14's
#: only calls ``Tensor.__init__`` (a no-op) behind ``torch._disable_dynamo`` and an export
#: marker (its cost: docs/benchmarks.md); torch's C++ ``_dtensor__new__`` builds it all.
#: Eager only: under ``torch.compile`` and ``torch.export`` the public functions run.
_FAST_NEW = DTensor.__new__ is getattr(torch.Tensor, "_dtensor__new__", None)


def _dtensor(local: Tensor, spec, requires_grad: bool) -> DTensor:
    if _FAST_NEW and not torch.compiler.is_exporting():
        return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)
    return DTensor(local, spec, requires_grad=requires_grad)


def _remember(cache: dict, key: tuple, value, bound: int = _MAX_ENTRIES) -> None:
    if len(cache) >= bound:  # bounded: shapes or meshes that change every step
        cache.clear()
    cache[key] = value


class _FromLocal(torch.autograd.Function):
    """``DTensor.from_local`` with a prepared spec: the same DTensor, torch's backward."""

    @staticmethod
    def forward(ctx, local: Tensor, spec) -> DTensor:  # type: ignore[override]
        ctx.forward_input_placements = spec.placements
        ctx.forward_input_device_mesh = spec.mesh
        ctx.grad_placements = None
        ctx.set_materialize_grads(False)
        return _dtensor(local.view_as(local), spec, local.requires_grad)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _FromTorchTensor.backward(ctx, grad)[:2]


def _public_from_local(local: Tensor, mesh, placements, shape, stride) -> DTensor:
    row_major = (math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))
    stride = tuple(row_major if stride is None else stride)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def wrap_local(local: Tensor, mesh, placements, shape, stride=None) -> DTensor:
    """``DTensor.from_local(..., run_check=False, shape=shape, stride=stride or row-major)``."""
    placements, shape = tuple(placements), tuple(shape)
    if torch.compiler.is_compiling():  # Dynamo traces the public function
        return _public_from_local(local, mesh, placements, shape, stride)
    key = (id(mesh), placements, tuple(map(type, placements)), shape, stride, local.dtype)
    hit = _SPECS.get(key)
    if hit is None or hit[0] is not mesh or local.device.type != mesh.device_type:
        out = _public_from_local(local, mesh, placements, shape, stride)
        if all(type(p) in _PLAIN for p in placements) and out._local_tensor.shape == local.shape:
            _remember(_SPECS, key, (mesh, out._spec))
        return out
    if not local.requires_grad:  # no graph to record
        return _dtensor(local.view_as(local), hit[1], False)
    return _FromLocal.apply(local, hit[1])


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local``: the same local view; the backward's gradient spec cached."""

    @staticmethod
    def forward(ctx, x: DTensor, grad_placements) -> Tensor:  # type: ignore[override]
        ctx.dtensor_spec = x._spec
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        ctx.local_tensor_stride = local.stride()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None or torch.is_grad_enabled() or type(grad) is not Tensor:
            return _ToTorchTensor.backward(ctx, grad)
        spec, stride = ctx.dtensor_spec, ctx.local_tensor_stride
        key = (spec, ctx.grad_placements, grad.shape, grad.stride(), grad.dtype, stride)
        grad_spec = _GRAD_SPECS.get(key)
        if grad_spec is None or grad.device.type != spec.mesh.device_type:
            out, none = _ToTorchTensor.backward(ctx, grad)
            if all(type(p) in _PLAIN for p in (*spec.placements, *out.placements)):
                _remember(_GRAD_SPECS, key, out._spec)
            return out, none
        return _dtensor(grad.view_as(grad), grad_spec, grad.requires_grad), None


def local_of(x: DTensor, grad_placements=None) -> Tensor:
    """``x.to_local(grad_placements=grad_placements)`` (differentiable)."""
    if (
        torch.compiler.is_compiling()  # Dynamo traces the public method
        or not torch.is_grad_enabled()
        or getattr(x, "_is_param", False)
    ):
        return x.to_local(grad_placements=grad_placements)
    if grad_placements is not None:
        grad_placements = tuple(grad_placements)
    return _ToLocal.apply(x, grad_placements)


#: ``(id(mesh), mesh dim) -> (mesh, size, local rank, group)``, fixed for a mesh's lifetime
#: (``DeviceMesh.get_group`` / ``get_local_rank`` are slow: docs/benchmarks.md)
_MESH_AXES: dict[tuple[int, int | str], tuple] = {}
_MESH_AXES_MAX = 256


def mesh_axis(mesh, m: int | str) -> tuple[int, int, object]:
    """``(size, local rank, process group)`` of mesh dim ``m`` (read once per mesh and dim)."""
    hit = _MESH_AXES.get((id(mesh), m))
    if hit is None or hit[0] is not mesh:
        hit = (mesh, mesh.size(m), mesh.get_local_rank(m), mesh.get_group(m))
        _remember(_MESH_AXES, (id(mesh), m), hit, _MESH_AXES_MAX)
    return hit[1:]


def mesh_rank(mesh, m: int | str) -> int:
    """This rank's index along mesh dim ``m`` (``mesh.get_local_rank(m)``, cached)."""
    return mesh_axis(mesh, m)[1]


def mesh_group(mesh, m: int | str):
    """The process group of mesh dim ``m`` (``mesh.get_group(m)``, cached)."""
    return mesh_axis(mesh, m)[2]


def wrap(local: Tensor, x: DTensor, placements, shape) -> DTensor:
    """``local`` as a DTensor on ``x``'s mesh with ``placements`` and global ``shape``."""
    return wrap_local(local, x.device_mesh, placements, shape)


#: The data-parallel mesh dim (shards the batch) and the one-split-dim spatial mesh dim.
DP, SP = "dp", "sp"
#: The mesh dim that splits each spatial axis of a grid (tiles, volume blocks), D, H, W order.
AXIS_MESH_DIMS = {"D": "sp_d", "H": "sp_h", "W": "sp_w"}
GRID_MESH_DIMS = tuple(AXIS_MESH_DIMS.values())


def is_dp(x: DTensor, mesh_dim: int) -> bool:
    """Whether ``mesh_dim`` of ``x``'s mesh is the data-parallel one (splits whole images)."""
    return (x.device_mesh.mesh_dim_names or ())[mesh_dim : mesh_dim + 1] == (DP,)


@dataclass(frozen=True)
class ParallelDims:
    """The mesh dims of a run and what each shards (as torchtitan's ``ParallelDims``):
    ``dp`` splits the batch; the spatial ranks split an image along one dim over ``sp``
    (strips) or along several, one mesh dim each (``grid``: ``sp_d`` / ``sp_h`` / ``sp_w``)."""

    #: the names, for code that reads a mesh (``AXIS["H"]``: the grid dim splitting H)
    DP: ClassVar[str] = DP
    SP: ClassVar[str] = SP
    AXIS: ClassVar[Mapping[str, str]] = AXIS_MESH_DIMS
    GRID: ClassVar[tuple[str, ...]] = GRID_MESH_DIMS

    dp: int = 1
    sp: int = 1
    #: ``((mesh dim name, ranks), ...)`` of a grid, in D, H, W order; empty for strips
    grid: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        names = [n for n, _ in self.grid]
        if [n for n in GRID_MESH_DIMS if n in names] != names:
            raise ValueError(f"grid {self.grid}: names must be among {GRID_MESH_DIMS}, in order")
        if self.grid and math.prod(n for _, n in self.grid) != self.sp:
            shown = "x".join(str(n) for _, n in self.grid)
            raise ValueError(f"grid {shown} does not hold sp={self.sp} ranks")

    @classmethod
    def of(cls, dp: int, sp: int, grid: Mapping[str, int] | tuple[int, int] | None = None):
        """From ``build_mesh``'s arguments: a grid ``(p, q)`` is H x W tiles, a mapping
        names its mesh dims (``config.grid_mesh_dims``)."""
        if grid is not None and not isinstance(grid, Mapping):
            grid = {AXIS_MESH_DIMS["H"]: grid[0], AXIS_MESH_DIMS["W"]: grid[1]}
        return cls(dp, sp, tuple(grid.items()) if grid is not None else ())

    @property
    def names(self) -> tuple[str, ...]:
        """Every mesh dim name, ``dp`` first."""
        return (DP, *(n for n, _ in self.grid)) if self.grid else (DP, SP)

    @property
    def shape(self) -> tuple[int, ...]:
        """Ranks per mesh dim, in ``names`` order."""
        return (self.dp, *(n for _, n in self.grid)) if self.grid else (self.dp, self.sp)

    @staticmethod
    def spatial_names_of(mesh) -> tuple[str, ...]:
        """The spatial mesh dim names of ``mesh`` (every dim but ``dp``)."""
        return tuple(n for n in mesh.mesh_dim_names or () if n != DP)

    @staticmethod
    def dims_from_end(name: str) -> int:
        """How far from the last the dim ``name`` splits is: ``sp_w`` 1, ``sp_h`` 2, ``sp_d`` 3."""
        return len(GRID_MESH_DIMS) - GRID_MESH_DIMS.index(name)

    @staticmethod
    def spatial_mesh_dim(mesh) -> int | None:
        """The index of ``mesh``'s spatial dim that ops treat as *the* spatial one: the only
        dim of a 1-D mesh, ``sp``, or the last grid dim present (``None``: none named)."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return 0
        found = [names.index(n) for n in (*GRID_MESH_DIMS, SP) if n in names]
        return max(found) if found else None


# Global result shapes (``result_shape``, ``cat_shape``, ``index_shape``), probed on meta
# tensors (torch's own rules and checks: ``torch.cat`` skipping legacy empty 1-D tensors,
# ``split``'s sections, a reshape's ``-1``) once per (op, shapes, arguments) in a bounded
# cache; arguments that cannot be a key probe every call, a failed probe is not cached.
Shape = tuple  # one tuple, or one per tensor of a tuple / list result


def _run(func: Callable, shapes: tuple, many: bool, dtype, args: tuple, kwargs: tuple) -> Shape:
    metas = [torch.empty(s, device="meta", dtype=dtype) for s in shapes]
    out = func(metas if many else metas[0], *args, **dict(kwargs))
    many_out = isinstance(out, (tuple, list))
    return tuple(tuple(o.shape) for o in out) if many_out else tuple(out.shape)


def _types(x):
    """The types of an argument's leaves: ``1``, ``1.0`` and ``True`` are equal keys to a
    dict, but ``t[1]`` drops a dim where ``t[True]`` adds one."""
    if isinstance(x, (tuple, list)):
        return tuple(_types(i) for i in x)
    return type(x)


@functools.lru_cache(maxsize=1024)
def _cached(types: tuple, *key) -> Shape:
    return _run(*key)


def _probe(func: Callable, shapes: tuple, many: bool, dtype, args: tuple, kwargs: dict) -> Shape:
    key = (func, shapes, many, dtype, args, tuple(kwargs.items()))
    # a tensor argument would be kept alive by the cache (and hashes by identity)
    if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
        return _run(*key)
    try:
        hash(key)
    except TypeError:  # e.g. a list or slice argument: probed every call
        return _run(*key)
    return _cached(_types(key[4:]), *key)


def result_shape(
    func: Callable, shape: Sequence[int], /, *args, meta_dtype=None, **kwargs
) -> Shape:
    """The global shape of ``func(t, *args, **kwargs)`` for ``t`` of ``shape`` and
    ``meta_dtype`` (a tuple of shapes for a tuple result: ``split``, ``max`` over a dim)."""
    return _probe(func, (tuple(shape),), False, meta_dtype, args, kwargs)


def index_shape(shape: Sequence[int], items: tuple) -> Shape:
    """The global shape of ``t[items]`` (basic indices) for a tensor ``t`` of ``shape``."""
    key = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else (i,) for i in items)
    return _probe(_index, (tuple(shape),), False, None, (key,), {})


def _index(t, key: tuple):
    return t[tuple(slice(*k) if len(k) == 3 else k[0] for k in key)]


def cat_shape(shapes: Sequence[Sequence[int]], dim: int) -> Shape:
    """The global shape of ``torch.cat`` of tensors of ``shapes`` along ``dim``."""
    return _probe(torch.cat, tuple(tuple(s) for s in shapes), True, None, (dim,), {})
