"""Attention written out over sharded pixel tokens: ``q @ k.transpose(-2, -1)`` -> softmax ->
``@ v`` (``@``, ``torch.matmul``, ``torch.bmm``, two-operand ``torch.einsum``).

The queries' sequence dim (rows, dim -2) is split over the spatial ranks (a token layout,
``_tokens.py``). The product of the queries with the keys keeps that split and holds
*every* key on each rank (its rows of the one-device score matrix, keys in global order):
a DTensor with the queries' placements. Scaling, softmax over the keys and dropout are
then local (DTensor's own rules: the split dim is not the reduced one). The product of
those weights with the values contracts over every key again. When the keys / values are
split over the same ranks (self-attention, or their own layout: spatial-reduction
attention's strided-conv keys), both products run as ring matmuls (``_ring_matmul.py``:
blocks point to point, never a gather); when they are whole on every rank, locally with
their gradient summed over the ranks. Any other product goes to DTensor's own rules:
the no-gather guard refuses one that would move a sharded activation, naming the
aten op and the module (``allow_gather`` runs it gathered), and a DTensor error becomes a
``SpatialShardingError`` naming the op and the module (``_errors.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import _attention  # noqa: F401  (registers first; its helpers are reused)
from ._attention import Seq, _replicated_local
from ._cross_attention import whole_operand_einsum
from ._dims import wrap
from ._errors import run_dtensor_op
from ._mode import register_handler
from ._registry import DEFAULT_REGISTRY
from ._ring_matmul import APPLY, SCORES, ring_matmul
from ._token_ring import token_ring
from ._tokens import split_layouts

LOCAL = "local"


def _plan(a, b) -> tuple[str, Seq, Seq] | None:
    """``(kind, rows layouts of a, layouts of b on the same mesh dims)`` for ``a @ b`` with
    the rows of ``a`` split (over one mesh dim, or nested over several: tiles); ``None``
    when the product is not one of the attention forms."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        return None
    if any(p.is_partial() for p in (*a.placements, *b.placements)):
        return None  # a pending sum is no operand of a local product
    if a.ndim != b.ndim or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]:
        return None
    la = {m.mesh_dim: m for m in split_layouts(a)}
    lb = {m.mesh_dim: m for m in split_layouts(b)}
    rows = tuple(m for m in la.values() if m.dim == a.ndim - 2)
    if not rows or a.shape[-1] != b.shape[-2]:
        return None
    seq = {m.mesh_dim for m in rows}
    for mesh_dim in (set(la) | set(lb)) - seq:  # batch splits, alike on both
        x, y = la.get(mesh_dim), lb.get(mesh_dim)
        if x is None or y is None or (x.dim, x.split_factor) != (y.dim, y.split_factor):
            return None
        if x.dim >= a.ndim - 2:
            return None
    kb = tuple(lb[m] for m in sorted(seq) if m in lb)
    if not kb:
        return LOCAL, rows, rows
    if len(kb) != len(rows) or len({m.dim for m in kb}) != 1:
        return None
    if kb[0].dim == b.ndim - 1:
        return SCORES, rows, kb
    if kb[0].dim == b.ndim - 2:
        return APPLY, rows, kb
    return None


def token_matmul(a, b) -> DTensor | None:
    """``a @ b`` when it is one of the attention products on split rows (see the module
    docstring); ``None`` when it is not."""
    plan = _plan(a, b)
    if plan is None:
        return None
    kind, seq, kb = plan
    shape = (*a.shape[:-1], b.shape[-1])
    if kind == LOCAL:
        out = a.to_local() @ _replicated_local(b, seq)
        return wrap(out, a, a.placements, shape)
    t = b.to_local()
    if kind == SCORES:
        t = t.transpose(-2, -1)
    ring = token_ring(a.device_mesh, kb)
    out = ring_matmul(
        kind, a.to_local(), t, ring.group, ring.sizes(), ring.columns(t.device), b.shape[kb[0].dim]
    )
    return wrap(out, a, a.placements, shape)


_MATMULS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm)


def _dtensor_op(fn):
    """``fn`` by DTensor's own rules, its errors named (``_errors.py``)."""
    return lambda *args, **kwargs: run_dtensor_op(fn, args, kwargs)


def _matmul_handler(fn):
    prev = DEFAULT_REGISTRY.handler(fn) or _dtensor_op(fn)

    def handler(a, b, *args, **kwargs):
        out = token_matmul(a, b) if not args and not kwargs else None
        return out if out is not None else prev(a, b, *args, **kwargs)

    handler.__name__ = f"token_{fn.__name__}"
    return handler


for _fn in _MATMULS:
    register_handler(_fn)(_matmul_handler(_fn))


def _as_matmul(equation: str) -> tuple[str, str, str, str] | None:
    """A two-operand einsum that is a batched matmul: ``(a_order, b_order, mm_order,
    out)``, the operands permuted to ``a_order`` (batch, rows, contracted) and
    ``b_order`` (batch, contracted, columns), their product laid out as ``mm_order``."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    parts = ins.split(",")
    if len(parts) != 2 or any(len(set(s)) != len(s) for s in (*parts, out)):
        return None
    sa, sb = parts
    batch = [c for c in out if c in sa and c in sb]
    contr = [c for c in sa if c in sb and c not in out]
    rows = [c for c in sa if c not in sb]
    cols = [c for c in sb if c not in sa]
    if (len(contr), len(rows), len(cols)) != (1, 1, 1) or len(sa) != len(batch) + 2:
        return None
    if len(sb) != len(batch) + 2 or set(out) != {*batch, *rows, *cols}:
        return None
    b_ = "".join(batch)
    return b_ + rows[0] + contr[0], b_ + contr[0] + cols[0], b_ + rows[0] + cols[0], out


def _permuted(x, src: str, dst: str):
    return x.permute([src.index(c) for c in dst]) if src != dst else x


@register_handler(torch.einsum)
def token_einsum(equation, *operands):
    """``torch.einsum`` of two operands that is a batched matmul of the attention forms on
    token tensors (``"bhxd,bhyd->bhxy"``, ``"bhxy,bhyd->bhxd"``); a whole operand times a
    split one, locally (``whole_operand_einsum``); DTensor's own otherwise."""
    ops = operands[0] if len(operands) == 1 and isinstance(operands[0], list | tuple) else operands
    form = _as_matmul(equation) if len(ops) == 2 else None
    # tokens of a one-row map are a plain Shard (no _StridedShard): the plan decides
    if form is not None and all(isinstance(t, DTensor) for t in ops):
        a_order, b_order, mm_order, out = form
        sa, sb = equation.replace(" ", "").split("->")[0].split(",")
        res = token_matmul(_permuted(ops[0], sa, a_order), _permuted(ops[1], sb, b_order))
        if res is not None:
            return _permuted(res, mm_order, out)
    if len(ops) == 2 and all(isinstance(t, DTensor) for t in ops):
        res = whole_operand_einsum(equation, *ops)  # whole queries times a map
        if res is not None:
            return res
    return run_dtensor_op(torch.einsum, (equation, *ops), {})
