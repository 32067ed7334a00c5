"""Attention written out over sharded tokens (matmuls, two-operand einsum) as ring matmuls;
neighbourhood attention: ``Tensor.unfold`` / ``F.unfold`` through the halo, plain masks.
docs/attention.md, "Attention written out", "Neighbourhood attention"."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import _attention  # noqa: F401  (registers first)
from ._dims import handled, mesh_axis, norm_dim, result_shape, sharded_dims, wrap, wrap_local
from ._errors import run_dtensor_op
from ._mode import register_handler
from ._prefix_shard import placement
from ._ring import Blocks, Ring
from ._ring_mask import Span
from ._runtime import current_runtime
from ._tiles import along, halo_window
from ._token_layout import local_part
from ._token_ring import partial_local, token_ring
from ._tokens import MATMULS, chain, is_tokens, split_layouts
from ._window import gather_window, plan_window

SCORES, APPLY, LOCAL = "scores", "apply", "local"


def _product(kind: str, x: Tensor, t: Tensor, cols: Tensor, out: Tensor) -> None:
    """Into ``out``: ``x @ t^T`` at columns ``cols`` (``SCORES``), or ``x[..., cols] @ t`` added."""
    if kind == SCORES:
        out.index_copy_(-1, cols, x @ t.transpose(-2, -1))
    else:
        out.add_(x.index_select(-1, cols) @ t)


class RingMatmul(torch.autograd.Function):
    """``a @ t_all^T`` (``SCORES``) or ``a @ t_all`` (``APPLY``; ``a``: ``(..., L_r, n_cols)``),
    ``t`` this rank's block of ``t_all``, block ``j`` its global indices ``cols[j]``."""

    @staticmethod
    def forward(ctx, a, t, kind: str, group, sizes: tuple[int, ...], cols: tuple, n_cols: int):
        a, t = a.contiguous(), t.contiguous()  # gloo sends dense tensors
        ring = Ring(group, sizes, 1, (t,))
        alloc = a.new_empty if kind == SCORES else a.new_zeros  # (each score column written once)
        out = alloc(*a.shape[:-1], n_cols if kind == SCORES else t.shape[-1])
        ring.run((t,), lambda span, tb: _product(kind, a, tb[0], cols[span[0]], out))
        ctx.save_for_backward(a, t)
        ctx.kind, ctx.ring, ctx.cols = kind, ring, cols
        return out

    @staticmethod
    def backward(ctx, dout):
        a, t = ctx.saved_tensors
        kind, cols, dout = ctx.kind, ctx.cols, dout.contiguous()
        da = torch.zeros_like(a)
        x, y = (dout, a) if kind == SCORES else (a, dout)  # the block's gradient: x_j^T @ y

        def grads_of(span: Span, tb: Blocks) -> Blocks:
            """Adds the block's part of ``da``; this rank's part of the block's gradient."""
            _product(APPLY if kind == SCORES else SCORES, dout, tb[0], cols[span[0]], da)
            return (x.index_select(-1, cols[span[0]]).transpose(-2, -1) @ y,)

        (dt,) = ctx.ring.run((t,), grads_of, grads=True)
        return da, dt, None, None, None, None, None


def ring_matmul(
    kind: str, a: Tensor, t: Tensor, group, sizes: tuple[int, ...], cols: tuple, n_cols: int
) -> Tensor:
    """Differentiable ``RingMatmul`` (see there)."""
    if len(sizes) == 1:  # every key here, in global order
        return a @ t.transpose(-2, -1) if kind == SCORES else a @ t
    return RingMatmul.apply(a, t, kind, group, tuple(sizes), tuple(cols), n_cols)


def token_matmul(a, b) -> DTensor | None:
    """``a @ b``, ``a``'s rows split, batch splits alike: ``b`` split there along its last
    dim (``SCORES``) or rows (``APPLY``) by the ring, whole locally; else ``None``."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        return None
    pending = any(p.is_partial() for p in (*a.placements, *b.placements))  # no local operand
    if pending or a.ndim != b.ndim or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]:
        return None
    la, lb = split_layouts(a), split_layouts(b)
    rows = tuple(m for m in la if m.dim == a.ndim - 2)
    seq = {m.mesh_dim for m in rows}
    ba = {(m.mesh_dim, m.dim, m.split_factor) for m in la if m.mesh_dim not in seq}
    bb = {(m.mesh_dim, m.dim, m.split_factor) for m in lb if m.mesh_dim not in seq}
    kb = tuple(m for m in lb if m.mesh_dim in seq)
    kind = {b.ndim - 1: SCORES, b.ndim - 2: APPLY}.get(kb[0].dim) if kb else LOCAL
    alike = ba == bb and all(d < a.ndim - 2 for _, d, _ in ba)  # batch splits, alike on both
    if not (rows and alike and a.shape[-1] == b.shape[-2]) or kind is None:
        return None
    if kb and (len(kb) != len(rows) or len({m.dim for m in kb}) != 1):
        return None
    if kind == LOCAL:
        out = a.to_local() @ partial_local(b, rows)
    else:
        t = b.to_local().transpose(-2, -1) if kind == SCORES else b.to_local()
        spec = token_ring(a.device_mesh, kb).spec(t.device)  # group, sizes, columns
        out = ring_matmul(kind, a.to_local(), t, *spec, b.shape[kb[0].dim])
    return wrap(out, a, a.placements, (*a.shape[:-1], b.shape[-1]))


@chain(*MATMULS)
def _matmul(prev, a, b, *args, **kwargs):
    out = token_matmul(a, b) if not args and not kwargs else None
    return out if out is not None else prev(a, b, *args, **kwargs)


def whole_operand_einsum(terms: tuple[str, str, str], a, b) -> DTensor | None:
    """``torch.einsum`` (``terms``: a, b, out) of DTensors, one whole on every mesh dim that
    splits the other along an output index it lacks (``"bqc,bchw->bqhw"``), locally."""
    sa, sb, out = terms
    pending = any(p.is_partial() for p in (*a.placements, *b.placements))
    if (len(sa), len(sb)) != (a.ndim, b.ndim) or a.device_mesh != b.device_mesh or pending:
        return None
    la, lb = ({m.mesh_dim: m for m in split_layouts(t)} for t in (a, b))
    placements, partial = list(a.placements), [[], []]
    for i in sorted(la.keys() | lb.keys()):
        x, y = la.get(i), lb.get(i)
        lay, side, names = (x, 0, sa) if x is not None else (y, 1, sb)
        ch = names[lay.dim]
        if x is not None and y is not None:  # split alike on both (a batch index)
            local = sb.find(ch) == y.dim and (x.split_factor, x.inner) == (y.split_factor, y.inner)
        else:  # not contracted or shared with the whole operand; it meets this rank's part
            local = ch not in (sb if side == 0 else sa)
            partial[1 - side].append(lay)
        if not local or ch not in out:
            return None
        placements[i] = placement(out.index(ch), lay.split_factor, lay.prefix)
    pairs = zip((a, b), partial, strict=True)
    ops = [partial_local(t, tuple(p)) if p else t.to_local() for t, p in pairs]
    dims = (dict(zip(sa, a.shape, strict=True)), dict(zip(sb, b.shape, strict=True)))
    shape = tuple(max(d.get(ch, 1) for d in dims) for ch in out)  # a size-1 dim broadcasts
    return wrap(torch.einsum(f"{sa},{sb}->{out}", *ops), a, placements, shape)


def _permuted(x, src: str, dst: str):
    return x.permute([src.index(c) for c in dst]) if src != dst else x


@register_handler(torch.einsum)
def token_einsum(equation, *operands):
    """Two-operand ``torch.einsum`` (explicit output, no ellipsis or repeated index): a
    batched matmul by ``token_matmul``, else ``whole_operand_einsum``, else DTensor's."""
    ops = operands[0] if len(operands) == 1 and isinstance(operands[0], list | tuple) else operands
    terms = re.fullmatch(r"([a-zA-Z]*),([a-zA-Z]*)->([a-zA-Z]*)", equation.replace(" ", ""))
    plain = terms and len(ops) == 2 and all(len(set(x)) == len(x) for x in terms.groups())
    if plain and all(isinstance(t, DTensor) for t in ops):
        sa, sb, out = terms.groups()
        batch = "".join(c for c in out if c in sa and c in sb)
        rows, cols, contr = set(sa) - set(sb), set(sb) - set(sa), set(sa) & set(sb) - set(out)
        # (batch, rows, contracted) @ (batch, contracted, columns); tokens of a one-row
        # map are a plain Shard (no _StridedShard): the plan decides
        sizes = (len(rows), len(cols), len(contr), len(sa) - len(batch), len(sb) - len(batch))
        if sizes == (1, 1, 1, 2, 2) and set(out) == {*batch, *rows, *cols}:
            (r,), (c,), (k,) = rows, cols, contr
            a, b = _permuted(ops[0], sa, batch + r + k), _permuted(ops[1], sb, batch + k + c)
            res = token_matmul(a, b)
            if res is not None:
                return _permuted(res, batch + r + c, out)
        res = whole_operand_einsum((sa, sb, out), *ops)  # whole queries times a map
        if res is not None:
            return res
    return run_dtensor_op(torch.einsum, (equation, *ops), {})


@register_handler(torch.Tensor.unfold)
def spatial_tensor_unfold(x, dimension: int, size: int, step: int):
    """``x.unfold(dimension, size, step)`` of a sharded tensor, the halo from the next rank."""
    args = (dimension, size, step)
    split = sharded_dims(x) if handled(x) else None
    # tokens, Partial (DTensor's own rules), one dim split over several mesh dims (no plan)
    if split is None or sum(p.is_shard() for p in x.placements) != len(split):
        return run_dtensor_op(torch.Tensor.unfold, (x, *args), {})
    shape = result_shape(torch.Tensor.unfold, x.shape, *args)
    d = norm_dim(dimension, x.ndim)
    local = x.to_local()
    # the global strides DTensor's later view rules read mirror the local tensor's: the
    # window is a new buffer with ``d`` innermost, unfolded as a view (as on one device)
    meta = torch.empty_strided(x.shape, x.stride(), device="meta")
    parts, rank, group = mesh_axis(x.device_mesh, split[d]) if d in split else (1, 0, None)
    if parts > 1:
        wp = plan_window("Tensor.unfold", x.shape[d], parts, size, step, 1, 0, 0)
        local = along(local, d, lambda t: gather_window(t, wp, rank, group))
        meta = along(meta, d, torch.Tensor.contiguous)
    stride = meta.unfold(d, size, step).stride()
    return wrap_local(local.unfold(d, size, step), x.device_mesh, x.placements, shape, stride)


@register_handler(F.unfold)
def spatial_f_unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """``F.unfold`` of a sharded NCHW map: its halo window unfolded to ``(N, C k k, L)`` tokens."""
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


def _with_plain_masks(func):
    """Handler of ``func``: a plain mask / operand cut to a sharded DTensor's part, or DTensor's."""

    def local(a, like: DTensor):
        if isinstance(a, DTensor):
            same = (a.placements, a.shape) == (like.placements, like.shape)
            return a.to_local() if same else None
        if not (isinstance(a, Tensor) and a.ndim):
            return a
        tail = like.shape[like.ndim - a.ndim :]  # a must broadcast to like, not like to a
        fits = a.ndim <= like.ndim and all(n in (1, m) for n, m in zip(a.shape, tail, strict=True))
        return local_part(a, like) if fits else None

    def handler(*args, **kwargs):
        like = next((a for a in args if isinstance(a, DTensor)), None)
        plain = any(isinstance(a, Tensor) and not isinstance(a, DTensor) and a.ndim for a in args)
        ok = plain and not kwargs and like is not None and (handled(like) or is_tokens(like))
        ops = [local(a, like) for a in args] if ok else [None]
        if any(o is None for o in ops):
            return run_dtensor_op(func, args, kwargs)
        return wrap(func(*ops), like, like.placements, like.shape)

    handler.__name__ = f"masked_{func.__name__}"
    return handler


for _fn in (torch.Tensor.masked_fill, torch.masked_fill, torch.where):
    register_handler(_fn)(_with_plain_masks(_fn))
