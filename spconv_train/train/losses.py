"""Segmentation losses on width-sharded logits, equal to the single-device losses.

Conventions (shared with ``metrics.py``):

* ``logits`` is a DTensor ``[N, K, H, W]`` laid out for the spatial ops: one ``Shard(3)``
  (width) mesh dimension, other mesh dimensions ``Shard(0)`` (data parallel) or
  ``Replicate`` -- exactly what a parallelized model returns. A plain tensor means one
  device and needs no communication.
* ``target`` (integer class indices, global shape ``[N, H, W]``) may be given as the plain
  LOCAL strip ``[n, H, w]`` matching this rank's logits strip (what the trainer loads from
  disk; the recommended form), the plain FULL target (same on every rank; the local part is
  sliced), or a DTensor (``shard_like`` makes one; other placements are redistributed to
  the logits' layout: width ``Shard(2)``, batch ``Shard(0)``).

Gradient semantics -- call ``loss.backward()`` on EVERY rank. Each loss is a function of
global sums ``S = sum_r s_r`` of per-rank local sums ``s_r`` (numerator, denominator,
per-class intersections...). ``S`` is formed by ``replicated_sum``: all-reduce forward,
*identity* backward. Every rank then evaluates the same function ``L = f(S)`` and gets the
same upstream gradient ``f'(S)``, which the identity backward hands to its own ``s_r``; so
each rank's logits strip receives ``f'(S) * ds_r/dx_r``, exactly its part of the
single-device gradient. (``torch.distributed.nn.functional.all_reduce``, whose backward
all-reduces again, would multiply it by the number of ranks, since every rank
backpropagates the same loss.) The parallelized model then sums parameter gradients over
the ranks (``sum_grad_over``): they equal the single-device gradients of the loss over the
GLOBAL batch, with no division by the data-parallel size.

Target validation (labels outside ``[0, K)`` other than ``ignore_index``, a target strip of
the wrong shape) is agreed over the mesh in the same all-reduce as the loss, so every rank
raises the same ``ValueError`` together instead of one rank raising while the others wait.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from spconv_train.parallel.extend import (
    block_slices,
    enter,
    mesh_coords,
    sharded_dim,
    spatial_layout,
)

__all__ = [
    "LossInfo",
    "ce_dice_loss",
    "class_sums",
    "class_sums_reference",
    "cross_entropy",
    "dice_loss",
    "dice_loss_reference",
    "local_target",
    "replicated_sum",
    "shard_like",
]


class _SumForwardIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, groups: tuple) -> Tensor:
        out = x.detach().clone().contiguous()
        for group in groups:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # Every rank backpropagates the same replicated result, so the gradient of the sum
        # with respect to this rank's own term is the incoming gradient itself.
        return grad, None


def replicated_sum(x: Tensor, groups: tuple) -> Tensor:
    """Sum of ``x`` over the ranks of ``groups`` (same value on every rank); the backward is
    the identity. Correct when every rank backpropagates the same function of the result
    (see the module docstring). Groups of one rank add nothing (a one-rank mesh): ``x`` is
    returned unchanged when no group has more ranks, as for ``groups=()``."""
    groups = tuple(g for g in groups if dist.get_world_size(g) > 1)
    if not groups:
        return x
    return _SumForwardIdentityBackward.apply(x, groups)


def _target_placements(like: DTensor) -> tuple:
    """Placements of a class-index target ``[N, H, W]`` laid out like ``like``
    (logits ``[N, K, H, W]``: tensor dims after the channel move down by one)."""
    if like.ndim == 3:
        return tuple(like.placements)
    out = []
    for p in like.placements:
        if sharded_dim(p) is not None and not isinstance(p, Shard):
            raise ValueError(f"logits placed {like.placements}: {p} has no per-pixel target")
        if isinstance(p, Shard):
            d = p.dim % like.ndim
            if d == 1:
                raise ValueError("logits sharded over the class dimension are not supported")
            out.append(Shard(d if d == 0 else d - 1))
        else:
            out.append(p)
    return tuple(out)


def _dense_shape(like: Tensor) -> tuple[int, ...]:
    shape = tuple(like.shape)
    return shape if len(shape) == 3 else shape[:1] + shape[2:]


def local_target(target: Tensor, like: Tensor) -> Tensor:
    """The plain local strip of ``target`` that matches the local strip of ``like`` (logits
    ``[N, K, H, W]`` or predictions ``[N, H, W]``, DTensor or plain). ``target`` may be the
    local strip itself, the full plain target, or a DTensor (redistributed if laid out
    differently). Raises ``ValueError`` if the shapes do not fit."""
    gshape = _dense_shape(like)
    if not isinstance(like, DTensor):
        if isinstance(target, DTensor):
            raise ValueError("a DTensor target needs DTensor logits")
        if tuple(target.shape) != gshape:
            raise ValueError(f"target shape {tuple(target.shape)} != logits shape {gshape}")
        return target
    lshape = _dense_shape(like.to_local())
    placements = _target_placements(like)
    if isinstance(target, DTensor):
        if target.device_mesh != like.device_mesh:
            raise ValueError("the target DTensor lives on another mesh than the logits")
        if tuple(target.shape) != gshape:
            raise ValueError(f"target DTensor shape {tuple(target.shape)} != logits shape {gshape}")
        if tuple(target.placements) != placements:
            target = target.redistribute(like.device_mesh, placements)
        return target.to_local()
    if tuple(target.shape) == lshape:
        return target
    if tuple(target.shape) == gshape:
        local = target[block_slices(gshape, placements, mesh_coords(like.device_mesh))]
        if tuple(local.shape) == lshape:
            return local
    raise ValueError(
        f"target of shape {tuple(target.shape)} is neither this rank's strip {lshape} of the "
        f"logits nor the full target {gshape}"
    )


def shard_like(target: Tensor, like: DTensor) -> DTensor:
    """``target`` (local strip, full plain tensor or DTensor) as a DTensor ``[N, H, W]``
    laid out like the logits ``like`` (width ``Shard(2)``, batch ``Shard(0)``); no
    communication unless a DTensor target must be redistributed."""
    local, shape = local_target(target, like), _dense_shape(like)
    stride = [1]
    for n in reversed(shape[1:]):
        stride.insert(0, stride[0] * n)
    kw = dict(run_check=False, shape=shape, stride=tuple(stride))
    return DTensor.from_local(local, like.device_mesh, _target_placements(like), **kw)


class _Strips(NamedTuple):
    logits: Tensor  # local [n, K, h, w]
    target: Tensor | None  # local int64 [n, h, w]; None if it did not fit (see error)
    groups: tuple  # process groups of the ranks holding other pixels
    error: str | None


def _strips(logits: Tensor, target: Tensor, what: str) -> _Strips:
    if isinstance(logits, DTensor):
        logits, layout = spatial_layout(logits, what, ndim=logits.ndim, tiles=True)
        local, groups = enter(logits), layout.stat_groups
    else:
        if logits.ndim not in (4, 5):
            raise ValueError(
                f"{what}: expected logits [N, K, H, W] or [N, K, D, H, W], got "
                f"{tuple(logits.shape)}"
            )
        local, groups = logits, ()
    if target.is_floating_point():
        raise ValueError(f"{what}: expected integer class-index targets, got {target.dtype}")
    try:
        t = local_target(target, logits)
        return _Strips(local, t if t.dtype == torch.int64 else t.long(), groups, None)
    except ValueError as exc:
        return _Strips(local, None, groups, f"{what}: {exc}")


def _sum_dims(x: Tensor) -> tuple[int, ...]:
    """Every dimension of logits ``[N, K, ...]`` but the classes (images and volumes)."""
    return (0, *range(2, x.ndim))


def _label_masks(t: Tensor, num_classes: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(valid, bad): pixels counted by the loss, and labels outside ``[0, K)``."""
    keep = t != ignore_index
    bad = keep & ((t < 0) | (t >= num_classes))
    return keep & ~bad, bad


def _raise_if_bad(flags: list[float], s: _Strips, what: str, num_classes: int, ignore) -> None:
    bad_labels, bad_shapes = flags
    if bad_shapes:
        raise ValueError(
            s.error or f"{what}: the target strip of another rank does not fit its logits"
        )
    if bad_labels:
        raise ValueError(
            f"{what}: {int(bad_labels)} target pixels hold labels outside [0, {num_classes}) "
            f"and are not ignore_index={ignore}"
        )


class LossInfo(NamedTuple):
    """Global counts behind a loss value (for logging and averaging across steps)."""

    valid_pixels: int  # pixels not equal to ignore_index, over the global batch
    weight_sum: float  # the mean's denominator (sum of class weights of valid pixels)


def _consts(device, *values) -> Tensor:
    """Detached float64 vector of scalars (python numbers or 0-d tensors), no host sync."""
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).detach() for v in values]
    )


def _low_precision(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = 255,
    weight: Tensor | None = None,
    label_smoothing: float = 0.0,
    return_info: bool = False,
) -> Tensor | tuple[Tensor, LossInfo]:
    """Equal to ``F.cross_entropy(full_logits, full_target, ignore_index=ignore_index,
    weight=weight, label_smoothing=label_smoothing, reduction="mean")``: the weighted mean over
    the non-ignored pixels of the global batch and image, as a plain scalar with the same
    value on every rank (one all-reduce). ``loss.backward()`` on every rank gives every
    logits strip its single-device gradient (module docstring). If every pixel of the
    global batch is ignored (an all-``ignore_index`` crop under sparse labels: not an
    error) the loss is 0 with a zero gradient on every rank, where torch gives nan.
    ``return_info`` also returns ``LossInfo``."""
    what = "cross_entropy"
    s = _strips(logits, target, what)
    x = _low_precision(s.logits)
    k = x.shape[1]
    if s.target is None:
        num = x.sum() * 0.0  # keeps the graph; the agreed error below is raised anyway
        wsum = count = bad = 0.0
    else:
        valid, bad_mask = _label_masks(s.target, k, ignore_index)
        # Bad labels are counted, treated as ignored here, and raised on every rank below.
        t = s.target.masked_fill(bad_mask, ignore_index)
        kw = dict(weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
        num = F.cross_entropy(x, t, reduction="sum", **kw)
        count, bad = valid.sum(), bad_mask.sum()
        if weight is None:
            wsum = count
        else:
            wsum = (weight.to(torch.float64)[t.masked_fill(~valid, 0)] * valid).sum()
    # One all-reduce: [numerator, denominator, valid pixels, bad labels, misfit strips].
    consts = _consts(x.device, wsum, count, bad, float(s.target is None))
    stats = torch.cat([num.double().reshape(1), consts])
    total = replicated_sum(stats, s.groups)
    _, den, n_valid, *flags = total.detach().tolist()
    _raise_if_bad(flags, s, what, k, ignore_index)
    # Nothing to learn from (every pixel ignored, or zero class weights): the numerator is a
    # sum over no pixel, 0 with a zero gradient; keep it instead of torch's 0 / 0 = nan, which
    # would stop training on a crop that only holds ignored pixels.
    loss = total[0] if den == 0 else total[0] / den
    loss = loss.to(x.dtype)
    return (loss, LossInfo(int(n_valid), den)) if return_info else loss


def dice_loss(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = 255,
    smooth: float = 1.0,
    include_background: bool = True,
) -> Tensor:
    """Soft multi-class Dice loss on softmax probabilities, equal to
    ``dice_loss_reference(full_logits, full_target, ...)``: per class ``c``, over the
    non-ignored pixels of the global batch and image,
    ``dice_c = (2 * sum(p_c * [t == c]) + smooth) / (sum(p_c) + sum([t == c]) + smooth)``,
    and the loss is ``1 - mean_c dice_c`` (class 0 left out of the mean if not
    ``include_background``). A class absent from target and prediction scores ~1 with
    ``smooth > 0`` (nan with ``smooth == 0``). Returns a plain scalar with the same value on
    every rank (one all-reduce of ``3K`` sums); ``loss.backward()`` on every rank gives every
    logits strip its single-device gradient (module docstring)."""
    total, k, dtype = class_sums(logits, target, ignore_index, "dice_loss")
    return overlap_loss(_dice(total, k, smooth), include_background).to(dtype)


def _dice(sums: Tensor, k: int, smooth: float) -> Tensor:
    """Per-class Dice scores from the ``3K`` sums of ``class_sums``."""
    return (2.0 * sums[:k] + smooth) / (sums[k : 2 * k] + sums[2 * k :] + smooth)


def overlap_loss(scores: Tensor, include_background: bool) -> Tensor:
    """``1 - mean`` of per-class overlap scores (Dice, Tversky), class 0 left out of the
    mean if not ``include_background``."""
    return 1.0 - (scores if include_background else scores[1:]).mean()


def class_sums(logits: Tensor, target: Tensor, ignore_index: int, what: str) -> tuple:
    """``(sums, K, dtype)``: per class ``c``, over the non-ignored pixels of the global
    batch and image, ``[sum(p_c * [t == c]) for c] + [sum(p_c)] + [sum([t == c])]`` (3K
    float64 values, the same on every rank; one all-reduce, identity backward) with ``p``
    the softmax probabilities, and the dtype the loss is returned in (fp32 for fp16 / bf16
    logits). Bad labels and misfit strips raise on every rank together."""
    s = _strips(logits, target, what)
    x = _low_precision(s.logits)
    k, dims = x.shape[1], _sum_dims(x)
    if s.target is None:
        zero = x.sum(dims) * 0.0  # keeps the graph; the agreed error is raised below
        inter, psum, count, bad = zero, zero, zero.detach(), 0.0
    else:
        valid, bad_mask = _label_masks(s.target, k, ignore_index)
        classes = torch.arange(k, device=x.device).view(1, k, *[1] * (x.ndim - 2))
        onehot = (s.target.unsqueeze(1) == classes) & valid.unsqueeze(1)
        probs = x.softmax(1) * valid.unsqueeze(1)
        inter = (probs * onehot).sum(dims)
        psum = probs.sum(dims)
        count = onehot.sum(dims)
        bad = bad_mask.sum()
    # One all-reduce: [intersections, probability sums, pixel counts, bad labels, misfits].
    flags = _consts(x.device, bad, float(s.target is None))
    stats = torch.cat([inter.double(), psum.double(), count.double(), flags])
    total = replicated_sum(stats, s.groups)
    _raise_if_bad(total[3 * k :].detach().tolist(), s, what, k, ignore_index)
    return total[: 3 * k], k, x.dtype


def dice_loss_reference(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = 255,
    smooth: float = 1.0,
    include_background: bool = True,
) -> Tensor:
    """Single-device soft Dice loss on plain full tensors (the definition ``dice_loss``
    reproduces on shards): one-hot targets, ignored pixels removed from every sum."""
    sums = class_sums_reference(logits, target, ignore_index)
    return overlap_loss(_dice(sums, logits.shape[1], smooth), include_background)


def class_sums_reference(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """The 3K sums of ``class_sums`` on plain full tensors, by their definition: one-hot
    targets, softmax probabilities, ignored pixels removed from every sum."""
    k = logits.shape[1]
    valid = (target != ignore_index).unsqueeze(1)
    onehot = F.one_hot(target.masked_fill(~valid.squeeze(1), 0), k).movedim(-1, 1)
    onehot = onehot.to(logits.dtype) * valid
    probs = logits.softmax(1) * valid
    dims = _sum_dims(logits)
    return torch.cat([(probs * onehot).sum(dims), probs.sum(dims), onehot.sum(dims)])


def ce_dice_loss(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = 255,
    weight: Tensor | None = None,
    label_smoothing: float = 0.0,
    smooth: float = 1.0,
    include_background: bool = True,
    ce_weight: float = 1.0,
    dice_weight: float = 1.0,
) -> Tensor:
    """``ce_weight * cross_entropy(...) + dice_weight * dice_loss(...)`` (same conventions)."""
    ce = cross_entropy(
        logits, target, ignore_index=ignore_index, weight=weight, label_smoothing=label_smoothing
    )
    kw = dict(ignore_index=ignore_index, smooth=smooth, include_background=include_background)
    return ce_weight * ce + dice_weight * dice_loss(logits, target, **kw)
