"""Sliding windows of a sharded map (``Tensor.unfold``, ``F.unfold`` through the halo),
and plain masks that pick among them (``masked_fill``, ``torch.where``): what a
user-written neighbourhood attention is made of (docs/attention.md, "Neighbourhood
attention").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._dims import handled, mesh_group, mesh_rank, norm_dim, sharded_dims, wrap
from ._errors import run_dtensor_op
from ._mode import register_handler
from ._probe import result_shape
from ._runtime import current_runtime
from ._tiles import along, halo_window
from ._token_layout import local_part
from ._tokens import is_tokens
from ._window import gather_window, plan_window


@register_handler(torch.Tensor.unfold)
def spatial_tensor_unfold(x, dimension: int, size: int, step: int):
    """``x.unfold(dimension, size, step)`` of a sharded tensor: along a sharded dim the
    halo of ``size - 1`` positions comes from the next rank, then the local op."""
    args = (dimension, size, step)
    split = sharded_dims(x) if handled(x) else None
    # tokens, Partial (DTensor's own rules, named errors), or one dim split over several
    # mesh dims (no halo plan for that here)
    if split is None or sum(p.is_shard() for p in x.placements) != len(split):
        return run_dtensor_op(torch.Tensor.unfold, (x, *args), {})
    shape = result_shape(torch.Tensor.unfold, x.shape, *args)
    d = norm_dim(dimension, x.ndim)
    local = x.to_local()
    # the global strides DTensor's later view rules read mirror the local tensor's: the
    # window is a new buffer with ``d`` innermost, unfolded as a view (as on one device)
    meta = torch.empty_strided(x.shape, x.stride(), device="meta")
    if d in split and x.device_mesh.size(split[d]) > 1:
        mesh, m = x.device_mesh, split[d]
        rank, group = mesh_rank(mesh, m), mesh_group(mesh, m)
        wp = plan_window("Tensor.unfold", x.shape[d], mesh.size(m), size, step, 1, 0, 0)
        local = along(local, d, lambda t: gather_window(t, wp, rank, group))
        meta = along(meta, d, torch.Tensor.contiguous)
    out = local.unfold(d, size, step)
    stride = meta.unfold(d, size, step).stride()
    return DTensor.from_local(
        out, x.device_mesh, x.placements, run_check=False, shape=shape, stride=stride
    )


@register_handler(F.unfold)
def spatial_f_unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """``F.unfold`` (im2col) of a sharded NCHW map: the window with its halos, unfolded with
    padding 0, the rank's output grid flattened into the token layout of ``(N, C * k * k,
    L)``."""
    args = (kernel_size, dilation, padding, stride)
    if not handled(input) or input.ndim != 4:
        return run_dtensor_op(F.unfold, (input, *args), {})
    shape = result_shape(F.unfold, input.shape, *args)
    win = halo_window(input, kernel_size, stride, padding, dilation, what="F.unfold")
    (h0, h1), (w0, w1) = win.out_ranges[2], win.out_ranges[3]
    cols = F.unfold(win.local, kernel_size, dilation, 0, stride)
    grid = win.wrap(cols.unflatten(-1, (h1 - h0, w1 - w0)))  # the output grid as a map
    # flattened as the model's own reshape of such a map would be (token layout, or the
    # re-chunk of a map split along H over a one-dim mesh)
    reshape = current_runtime().registry.handler(torch.Tensor.reshape) or torch.Tensor.reshape
    return reshape(grid, shape)


def _local_operands(args: tuple):
    """The DTensor whose layout the result takes and ``args`` as local operands (plain
    tensors indexed with its positions), or ``None`` where DTensor's own rules apply
    (DTensors laid out differently, a plain tensor that would broadcast the sharded one)."""
    like = next(a for a in args if isinstance(a, DTensor))
    if not (handled(like) or is_tokens(like)):
        return None
    out = []
    for a in args:
        if isinstance(a, DTensor):
            if a.placements != like.placements or a.shape != like.shape:
                return None
            a = a.to_local()
        elif isinstance(a, Tensor) and a.ndim:
            try:
                if torch.broadcast_shapes(a.shape, like.shape) != like.shape:
                    return None
            except RuntimeError:  # torch's own message, from DTensor's rules
                return None
            a = local_part(a, like)
        out.append(a)
    return like, out


def _with_plain_masks(func):
    """Handler of an element-wise selection ``func``: a plain mask or operand next to a
    sharded DTensor indexed with the rank's positions."""

    def handler(*args, **kwargs):
        plain = any(isinstance(a, Tensor) and not isinstance(a, DTensor) and a.ndim for a in args)
        found = _local_operands(args) if plain and not kwargs else None
        if found is None:
            return run_dtensor_op(func, args, kwargs)
        like, local = found
        return wrap(func(*local), like, like.placements, like.shape)

    handler.__name__ = f"masked_{func.__name__}"
    return handler


for _fn in (torch.Tensor.masked_fill, torch.masked_fill, torch.where):
    register_handler(_fn)(_with_plain_masks(_fn))
