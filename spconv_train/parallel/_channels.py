"""Ops over channels (or other unsplit dims) on a sharded DTensor, run per strip:
``F.layer_norm``, ``F.prelu``, ``chunk`` / ``split``, ``torch.cat`` and ``F.linear`` on whole
rows (DTensor refuses a DTensor input with plain parameters), weight gradients summed over
the mesh dims splitting the rows; ``pixel_shuffle`` / ``pixel_unshuffle`` move elements
between blocks along each sharded one of the last two dims.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._dims import cat_shape, handled, local_of, norm_dim, result_shape, sharded_dims, wrap
from ._errors import module_path, run_dtensor_op
from ._geometry import ExchangePlan, SpatialShardingError, all_shard_bounds, check_strips
from ._halo import gather_columns, sum_grad_over
from ._layout import in_layout
from ._mode import register_handler, register_spatial_module
from ._pointwise import plain_part
from ._sharding import enter, grad_groups, leave, sharded_dim, spatial_layout
from ._tiles import sharded_axes
from ._token_layout import is_tokens, split_layouts


@register_handler(F.layer_norm, torch.layer_norm)
def spatial_layer_norm(
    input, normalized_shape, weight=None, bias=None, eps=1e-5, *args, cudnn_enable=True
):
    """``F.layer_norm`` over trailing dims no rank splits (channels-last maps, tokens):
    local on each rank, the weight's and bias's gradients summed over the ranks
    (``torch.layer_norm``'s ``cudnn_enable``, by position or keyword: unused)."""
    tokens = is_tokens(input)  # first: a token tensor's _StridedShard is not ``handled``
    if not (tokens or handled(input)):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)  # DTensor's rules
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    across = sorted({lay.dim for lay in split_layouts(input) if lay.dim >= input.ndim - k})
    if across:  # statistics over a split (image or token) dim: DTensor would gather or fail
        raise SpatialShardingError(
            f"F.layer_norm over the split dim(s) {across} of {tuple(input.shape)} "
            f"{input.placements} in module '{module_path()}': statistics over the "
            f"{'tokens' if tokens else 'image width'} of several ranks are not supported; "
            "normalise over the channels (the last dim: channels-last LayerNorm, GroupNorm) "
            "or gather explicitly with x.full_tensor()"
        )
    g = grad_groups(input)
    out = F.layer_norm(
        local_of(input), normalized_shape, sum_grad_over(weight, g), sum_grad_over(bias, g), eps
    )
    return wrap(out, input, input.placements, input.shape)


@register_handler(F.prelu, torch.prelu)
def spatial_prelu(input, weight):
    """``F.prelu``, local (DTensor has no rule for ``_prelu_kernel_backward``)."""
    if not handled(input) or (input.ndim > 1 and 1 in sharded_dims(input)):
        return F.prelu(input, weight)
    out = F.prelu(local_of(input), sum_grad_over(weight, grad_groups(input)))
    return wrap(out, input, input.placements, input.shape)


def local_pieces(func, x: DTensor, arg, d: int) -> tuple[DTensor, ...]:
    """``func(x, arg, d)`` (``split`` / ``chunk`` along a dim ``d`` no rank splits): each
    rank's local pieces, with ``x``'s placements and the pieces' global shapes."""
    arg = tuple(arg) if isinstance(arg, list) else arg  # sections: a cache key (_dims.py)
    shapes = result_shape(func, x.shape, arg, d)
    pieces = func(local_of(x), arg, d)
    return tuple(wrap(t, x, x.placements, s) for t, s in zip(pieces, shapes, strict=True))


def _pieces(func, x, arg, dim, **kwargs):
    d = norm_dim(dim, x.ndim)
    if not handled(x) or d in sharded_dims(x):
        return func(x, arg, dim, **kwargs)
    return local_pieces(func, x, arg, d)


@register_handler(torch.chunk, Tensor.chunk)
def spatial_chunk(input, chunks, dim=0):
    """``chunk`` along an unsharded dim (e.g. channels): local, same placements."""
    return _pieces(torch.chunk, input, chunks, dim)


@register_handler(torch.split, Tensor.split)
def spatial_split(tensor, split_size_or_sections, dim=0):
    """``split`` along an unsharded dim (e.g. channels): local, same placements."""
    return _pieces(torch.split, tensor, split_size_or_sections, dim)


@functools.lru_cache(maxsize=256)
def _shuffle_plan(width: int, parts: int, r: int, up: bool):
    """The exchange of a pixel shuffle (``up``: output ``j`` is input ``j // r``) or unshuffle
    (inputs ``[j * r, j * r + r)``: every rank needs an input and an output position, only
    neighbours lend), and every rank's output chunk."""
    what = "F.pixel_shuffle" if up else "F.pixel_unshuffle"
    if up:
        owned, out = all_shard_bounds(width, parts), all_shard_bounds(width * r, parts)
    else:
        owned = check_strips(what, width, parts)
        out = check_strips(what, width // r, parts, "output")
    reads = [((o0 // r, -(-o1 // r)) if up else (o0 * r, o1 * r), o0 < o1) for o0, o1 in out]
    needed = tuple((span,) if some else () for span, some in reads)
    plan = ExchangePlan(width, tuple(owned), needed)
    if not up:
        plan.check_neighbours(what)
    return plan, tuple(out)


def _shuffle(input, r: int, up: bool):
    """``pixel_shuffle`` (``up``) / ``pixel_unshuffle`` by ``r``: per sharded dim (the last two,
    or the batch) each rank fetches its output chunk's inputs, runs the op, keeps its chunk."""
    fn, n = (F.pixel_shuffle if up else F.pixel_unshuffle), input.ndim
    if not handled(input) or n not in (4, 5) or not set(sharded_dims(input)) <= {0, n - 2, n - 1}:
        return fn(input, r)
    x, layout = spatial_layout(input, f"F.{fn.__name__}", n, tiles=True)
    local, crops = enter(x), []
    for d, parts, rank, group in sharded_axes(layout):
        plan, out = _shuffle_plan(x.shape[d], parts, r, up)
        local = gather_columns(local.movedim(d, -1), plan, rank, group).movedim(-1, d)
        (o0, o1), lo = out[rank], plan.needed[rank][0][0] if plan.needed[rank] else 0
        crops.append((d, o0 - lo * r if up else 0, o1 - o0))
    out = fn(local, r)
    for d, start, n in crops:
        out = out.narrow(d, start, n)
    return leave(out, layout, result_shape(fn, x.shape, r))


@register_handler(F.pixel_shuffle, torch.pixel_shuffle)
def spatial_pixel_shuffle(input, upscale_factor):
    """``F.pixel_shuffle`` on a sharded input (``_shuffle``)."""
    return _shuffle(input, int(upscale_factor), True)


@register_handler(F.pixel_unshuffle, torch.pixel_unshuffle)
def spatial_pixel_unshuffle(input, downscale_factor):
    """``F.pixel_unshuffle`` on a sharded input (``_shuffle``)."""
    return _shuffle(input, int(downscale_factor), False)


for _base in (nn.PReLU, nn.PixelShuffle, nn.PixelUnshuffle):
    # their functional calls are handled here; the swap shows it in ``print(model)``
    _doc = f"``nn.{_base.__name__}`` (its functional form is handled in ``_channels.py``)."
    _attrs = {"__module__": __name__, "__doc__": _doc}
    register_spatial_module(_base)(type(f"Spatial{_base.__name__}", (_base,), _attrs))


@register_handler(torch.cat, torch.concat, torch.concatenate)
def spatial_cat(tensors, dim=0, **kwargs):
    """``torch.cat`` along an unsharded dim (skips on channels): local, same placements;
    plain tensors (timm encoders' empty dummy features) cut to each rank's part. Otherwise
    DTensor's own rules, their errors named (``_errors.py``)."""
    dts = [t for t in tensors if isinstance(t, DTensor)]
    first = dts[0] if dts else None
    d = norm_dim(kwargs.pop("axis", dim), first.ndim) if first is not None else dim
    ok = first is not None and not kwargs and d not in sharded_dims(first)
    if not ok or not all(handled(t) and t.placements == first.placements for t in dts):
        return run_dtensor_op(torch.cat, (tensors, dim), kwargs)
    # in_layout: channels-last parts give a channels-last result (_layout.py)
    parts = [
        in_layout(local_of(t)) if isinstance(t, DTensor) else plain_part(t, first, "cat")
        for t in tensors
    ]
    shape = cat_shape([t.shape for t in tensors], d)
    return wrap(torch.cat(parts, d), first, first.placements, shape)


@register_handler(F.linear)  # torch._C._nn.linear is the same object
def _functional_linear(input, weight, bias=None):
    if not isinstance(input, DTensor) or isinstance(weight, DTensor):
        return F.linear(input, weight, bias)  # DTensor parameters: DTensor's own rules
    last = input.ndim - 1
    for p in input.placements:
        if sharded_dim(p) in (last, -1):
            raise SpatialShardingError(
                f"F.linear on a DTensor sharded on its last dimension {input.placements} would "
                f"mix columns of different ranks; pool or reduce the width first."
            )
        if p.is_partial():
            raise SpatialShardingError(
                f"F.linear on a Partial DTensor {input.placements}: redistribute it first."
            )
    groups = grad_groups(input)  # each mesh dim splitting rows holds a partial gradient
    out = F.linear(local_of(input), sum_grad_over(weight, groups), sum_grad_over(bias, groups))
    return wrap(out, input, tuple(input.placements), (*input.shape[:-1], out.shape[-1]))
