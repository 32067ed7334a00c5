"""Token-wise ops over unsplit dims (the channels) of pixel tokens, a prefix or not, locally:
reductions, scans, ``split`` / ``chunk`` (DTensor sizes gradients by its own chunking and
replicates an uneven ``_StridedShard`` to split it); over the split tokens a sum or mean is
local sums added over the groups (token pooling), others go to ``_reduce.py``, or are refused
by name behind a prefix. And timm EdgeNeXt's Fourier position encoding built per strip or tile
(timm's plain whole-image one would sum its gradient at the activation's size), from global
coordinates in timm's float32 steps (bitwise one device's). docs/attention.md, docs/models.md."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._channels import local_pieces
from ._dims import norm_dim, result_shape, wrap, wrap_local
from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._mode import register_spatial_module
from ._prefix_shard import prefix_of, reduced_placements
from ._reduce import _dims, reduce_sharded  # (and its handlers, wrapped here)
from ._runtime import current_runtime, function_name
from ._sharding import block_slices, grad_groups, mesh_coords, sharded_dim
from ._token_prefix import has_prefix  # (and its handlers, wrapped here)
from ._tokens import chain, chain_each, is_nested, is_tokens, split_layouts

_T = torch.Tensor


#: the ops (a name: ``torch.name`` and ``Tensor.name``) by ``(dim_pos, keep_pos, default,
#: needs_dim)``: ``dim`` / ``keepdim`` positions (``keep_pos`` ``None``: shape kept), dims
#: without ``dim`` (``None``: all), whether without ``dim`` they are another op (``x.max()``)
_OPS = {
    (1, 2, None, False): ("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin")
    + ("logsumexp", "argmax", "argmin"),
    (1, 3, None, False): ("var", "std"),
    (2, 3, None, False): ("norm", torch.linalg.vector_norm),
    (1, 2, None, True): ("max", "min", "median", "nanmedian"),
    (1, None, None, True): ("softmax", "log_softmax", "cumsum", "cumprod")
    + (F.softmax, F.log_softmax),
    (2, None, 1, False): (F.normalize,),
}
#: the p-norms (``p`` / ``ord`` the first argument after the tensor)
_NORMS = (torch.norm, _T.norm, torch.linalg.vector_norm)
#: the reductions over the split token dim done by ``_reduce.reduce_sharded``
_SUMS = {torch.sum: "sum", _T.sum: "sum", torch.mean: "mean", _T.mean: "mean"}

#: why a reduction over the split token dim is refused, and the way around it
_BEHIND_PREFIX = (
    "a reduction or scan over the tokens behind prefix (class / register) tokens, which one "
    "rank holds alone, is not supported. Slice the prefix off first (x[:, p:]), or reduce "
    "over the channels (dim=-1)."
)
_P_NORM = (
    "DTensor's own p-norm over the split token dim of a token tensor gives a wrong input "
    "gradient (torch 2.14.1), so it is not supported. Write it as x.square().sum(dim).sqrt(), "
    "or reduce over the channels (dim=-1)."
)
_PRODUCT = (
    "a product over a split dim is not supported. Write it as x.log().sum(dim).exp() "
    "(positive x), or gather explicitly (x.full_tensor())."
)


def _arg(args, kwargs, pos: int | None, name: str, default):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and len(args) > pos else default


def _token_wise(fn, prev, spec: tuple):
    """Handler for ``fn``: local on token tensors reduced over dims no rank splits (a
    product: on any DTensor; DTensor's own rule fails in its backward, torch 2.14.1)."""
    what, (dim_pos, keep_pos, default, needs_dim) = function_name(fn), spec
    product = fn in (torch.prod, _T.prod)

    def handler(x, *args, **kwargs):
        local = is_tokens(x) or (
            product and isinstance(x, DTensor) and not any(p.is_partial() for p in x.placements)
        )
        if not local or kwargs.get("out") is not None:
            return prev(x, *args, **kwargs)
        full = (x, *args)
        dim = _arg(full, kwargs, dim_pos, "dim", default)
        dim = None if isinstance(dim, bool) else dim  # x.var(unbiased): over every dim
        ints = all(isinstance(d, int) for d in (dim if isinstance(dim, (tuple, list)) else [dim]))
        if not ints and (dim is not None or needs_dim):
            # x.max(): over all; torch.max(a, b): element-wise; softmax without dim
            return prev(x, *args, **kwargs)
        dims = _dims(dim, x.ndim)
        split = {sharded_dim(p) % x.ndim for p in x.placements if sharded_dim(p) is not None}
        keepdim = keep_pos is None or bool(_arg(full, kwargs, keep_pos, "keepdim", 0))
        if split & set(dims):
            behind = any(prefix_of(p) and sharded_dim(p) % x.ndim in dims for p in x.placements)
            order = _arg(full, kwargs, 1, "ord" if fn is _NORMS[2] else "p", 2)  # p, 2 or "fro"
            p_norm = fn in _NORMS and len(dims) < x.ndim and order != 1
            if behind or p_norm or product:
                why = _BEHIND_PREFIX if behind else _P_NORM if p_norm else _PRODUCT
                kind = "tokens " if is_tokens(x) else ""
                raise SpatialShardingError(
                    f"{what} over dims {dims} of {kind}{tuple(x.shape)} {x.placements} in "
                    f"module '{module_path()}': {why}"
                )
            if fn in _SUMS:  # a sum or mean over the tokens (token pooling)
                return reduce_sharded(x, _SUMS[fn], dims, keepdim, dtype=kwargs.get("dtype"))
            return prev(x, *args, **kwargs)
        placements = reduced_placements(x, dims, keepdim)
        shape = result_shape(fn, x.shape, *args, meta_dtype=x.dtype, **kwargs)
        out = fn(x.to_local(), *args, **kwargs)
        if isinstance(out, tuple):  # max / min: (values, indices)
            parts = [wrap(o, x, placements, s) for o, s in zip(out, shape, strict=True)]
            return type(out)(parts)
        return wrap(out, x, placements, shape)

    return handler


for _spec, _ops in _OPS.items():
    _both = [(getattr(torch, n), getattr(_T, n)) if isinstance(n, str) else (n,) for n in _ops]
    chain_each([f for fns in _both for f in fns], partial(_token_wise, spec=_spec), graph=True)


@chain(F.rms_norm)
def _rms_norm(prev, input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` over unsplit trailing dims (the channels): local."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    # is_tokens first: the layouts are read only for token tensors
    if not is_tokens(input) or any(lay.dim >= input.ndim - k for lay in split_layouts(input)):
        return prev(input, normalized_shape, weight, eps)
    out = F.rms_norm(
        input.to_local(), normalized_shape, sum_grad_over(weight, grad_groups(input)), eps
    )
    return wrap(out, input, input.placements, input.shape)


#: the size argument's keyword in ``torch.split``, ``Tensor.split`` and ``chunk``
_SIZES = ("split_size_or_sections", "split_size", "chunks")


def _local_pieces(fn, prev):
    """Handler: ``fn(x, arg, dim)`` (``split`` / ``chunk``) of a token tensor along an
    unsplit ``dim`` on the local tensor; otherwise ``prev``."""
    run, what = getattr(torch, fn.__name__), function_name(fn)

    def handler(x, *args, **kwargs):
        arg = args[0] if args else next((kwargs[n] for n in _SIZES if n in kwargs), None)
        d = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if (
            arg is None
            or set(kwargs) - {"dim", *_SIZES}
            or not (is_tokens(x) or is_nested(x))
            or any(p.is_partial() for p in x.placements)
        ):
            return prev(x, *args, **kwargs)
        if any(lay.dim == norm_dim(d, x.ndim) for lay in split_layouts(x)):
            if has_prefix(x):  # DTensor's rule: a gradient it cannot cat (torch 2.14.1)
                raise _along_tokens(what, x)
            return prev(x, *args, **kwargs)
        return local_pieces(run, x, arg, norm_dim(d, x.ndim))  # a prefix stays in place

    return handler


chain_each((torch.split, _T.split, torch.chunk, _T.chunk), _local_pieces, "token_pieces")


@chain(torch.stack, prefix="prefix_stack")
def _stack(prev, tensors, dim=0, **kwargs):
    """``torch.stack`` behind a prefix as ``cat`` of each ``unsqueeze``d (their handlers keep
    it): DTensor's own rule drops the prefix (torch 2.14.1; silently wrong after)."""
    tensors = list(tensors)
    if kwargs or not any(map(has_prefix, tensors)):
        return prev(tensors, dim, **kwargs)
    d, registry = norm_dim(dim, tensors[0].ndim + 1), current_runtime().registry
    unsqueeze, cat = (registry.handler(f) for f in (torch.unsqueeze, torch.cat))
    return cat([unsqueeze(t, d) for t in tensors], d)


def _pad_dims(ndim: int, pad, *args, **kwargs) -> set[int]:
    return {ndim - 1 - i // 2 for i, v in enumerate(pad) if v}


def _roll_dims(ndim: int, shifts, dims=None) -> set[int]:
    if dims is None or dims == ():  # a roll of the flattened tensor
        return set(range(ndim))
    return {norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}


def _flip_dims(ndim: int, *dims, **kwargs) -> set[int]:
    """The dims ``flip`` reverses: ``x.flip(0, 1)``, ``x.flip((0, 1))``, ``flip(dims=...)``."""
    given = kwargs["dims"] if "dims" in kwargs else dims[0] if len(dims) == 1 else dims
    return {norm_dim(d, ndim) for d in ([given] if isinstance(given, int) else given)}


def _along_tokens(what: str, x: DTensor) -> SpatialShardingError:
    """The refusal of ``what`` along the split tokens of ``x`` behind a prefix (raised on
    every rank alike: it reads the global shape and the placements only)."""
    return SpatialShardingError(
        f"{what} along the tokens of {tuple(x.shape)} {x.placements} in module "
        f"'{module_path()}': along tokens behind prefix (class / register) tokens, which one "
        f"rank holds alone, it is not supported. Slice the prefix off first (x[:, p:]), or "
        f"apply it along the channels (the last dim)."
    )


def _along_unsplit(fn, prev, touched):
    """Handler for ``fn`` (pad, roll, flip) behind a prefix: local along unsplit dims (the
    channels), refused along the tokens (DTensor's own rule drops the prefix)."""
    what = function_name(fn)

    def handler(x, *args, **kwargs):
        if not has_prefix(x):
            return prev(x, *args, **kwargs)
        split = {sharded_dim(p) % x.ndim for p in x.placements if sharded_dim(p) is not None}
        if touched(x.ndim, *args, **kwargs) & split:
            raise _along_tokens(what, x)
        shape = result_shape(fn, x.shape, *args, meta_dtype=x.dtype, **kwargs)
        return wrap(fn(x.to_local(), *args, **kwargs), x, x.placements, shape)

    return handler


chain_each((F.pad, torch._C._nn.pad), partial(_along_unsplit, touched=_pad_dims), "prefix")
chain_each((torch.roll, _T.roll), partial(_along_unsplit, touched=_roll_dims), "prefix")
chain_each((torch.flip, _T.flip), partial(_along_unsplit, touched=_flip_dims), "prefix")


TIMM_CLASS = "timm.models.edgenext.PositionalEncodingFourier"
_EPS = 1e-6  # timm's


def fourier_block(
    hidden: int, temperature: float, scale: float, size: tuple[int, int], rows: slice,
    cols: slice, device=None,
) -> Tensor:  # fmt: skip
    """``(2 * hidden, len(rows), len(cols))``: ``rows`` x ``cols`` of timm's encoding of an
    ``H x W = size`` map before its projection (per axis sin / cos interleaved, y first)."""
    dim_t = torch.arange(hidden, dtype=torch.int64, device=device).to(torch.float32)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / hidden)
    axes = []
    for n, part in zip(size, (rows, cols), strict=True):
        pos = torch.arange(part.start + 1, part.stop + 1, dtype=torch.float32, device=device)
        pos = (pos / (torch.tensor(float(n), device=device) + _EPS) * scale)[:, None] / dim_t
        axes.append(torch.stack((pos[:, 0::2].sin(), pos[:, 1::2].cos()), dim=2).flatten(1))
    (y, x), h, w = axes, len(axes[0]), len(axes[1])
    both = (y[:, None, :].expand(h, w, hidden), x[None, :, :].expand(h, w, hidden))
    return torch.cat(both, dim=2).permute(2, 0, 1)


@register_spatial_module(TIMM_CLASS)
class SpatialFourierEncoding:
    """``PositionalEncodingFourier`` whose output is laid out like the map it encodes."""

    def forward(self, shape: tuple[int, int, int]):
        seen = current_runtime().last_image
        if seen is None:  # no sharded map in this forward: the plain encoding is right
            return super().forward(shape)
        mesh, placements, image = seen
        batch, height, width = (int(n) for n in shape)
        if (image[0], *image[2:]) != (batch, height, width):
            raise SpatialShardingError(
                f"module '{getattr(self, 'spatial_name', '?')}' (PositionalEncodingFourier): "
                f"asked to encode a {batch} x {height} x {width} map, but the last map a "
                f"spatial layer took is {image}, so its layout is unknown. Call it with the "
                f"shape of the activation it is added to (as timm's EdgeNeXt does)."
            )
        weight = self.token_projection.weight
        full = (batch, 2 * self.hidden_dim, height, width)
        b, _, rows, cols = block_slices(full, placements, mesh_coords(mesh))
        args = (self.hidden_dim, self.temperature, self.scale, (height, width), rows, cols)
        local = fourier_block(*args, weight.device).to(weight.dtype)
        local = local.expand(b.stop - b.start, -1, -1, -1)
        return self.token_projection(wrap_local(local.contiguous(), mesh, placements, full))
