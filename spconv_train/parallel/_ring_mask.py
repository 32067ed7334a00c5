"""Attention masks on the ring (``_ring.py``) and the cross route, cut to this rank's rows or
keys, additive per piece (docs/attention.md, "Masks and biases on the ring")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._sharding import grad_groups
from ._token_layout import held_indices, local_part
from ._token_ring import partial_local
from ._tokens import TokenLayout, split_layouts

CROSS = " with whole queries and keys split over the spatial ranks"
GATHER = ". Drop it, or gather explicitly (x.full_tensor())."


def refuse(what: str, why: str, where: str = CROSS, fix: str = GATHER) -> SpatialShardingError:
    """The error of an attention op ``what`` that does not take ``why`` ``where``."""
    return SpatialShardingError(
        f"{what} in module '{module_path()}'{where}: {why} is not supported{fix}"
    )


def additive(mask: Tensor, dtype: torch.dtype, masked: bool) -> Tensor:
    """``mask`` as an additive bias of ``dtype``: a boolean one ``-inf`` where it equals
    ``masked`` (SDPA masks ``False``, ``nn.MultiheadAttention`` ``True``), else 0."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(mask if masked else ~mask, -math.inf)


def select_rows(mask: Tensor, d: int, lays: tuple[TokenLayout, ...], groups: tuple) -> Tensor:
    """This rank's entries ``lays`` of a whole ``mask`` along ``d`` (gradient over ``groups``)."""
    part = sum_grad_over(mask, groups)
    if lays and -d <= part.ndim and part.shape[d] != 1:
        part = part.index_select(d, held_indices(lays).to(part.device))
    return part


def finite(lse: Tensor) -> Tensor:
    """``lse`` 0 where no key was reached, as the CPU flash kernel gives (no NaN after)."""
    return lse.masked_fill(lse == -math.inf, 0.0)


Span = tuple[int, int, int]  # (owner, lo, hi): tokens lo:hi of the owner's block


@dataclass(frozen=True)
class RingMask:
    """Where masks meet the pieces: ``cols``, every member's global key indices; ``rows``,
    this rank's queries' when causal. The bias is passed apart (an autograd input)."""

    cols: tuple[Tensor, ...]
    rows: Tensor | None
    dtype: torch.dtype

    def block(self, bias: Tensor | None, span: Span, travelling: tuple) -> Tensor | None:
        """The additive mask of the keys ``span`` (``travelling``: their own), None: none."""
        keys = self.cols[span[0]][span[1] : span[2]]
        out = [travelling[0].transpose(-2, -1)] if travelling else []
        if bias is not None:
            cols = bias if bias.shape[-1] == 1 else bias.index_select(-1, keys)
            out.append(additive(cols, self.dtype, masked=False))
        if self.rows is not None:  # a key after the query is masked
            out.append(additive(self.rows.unsqueeze(-1) < keys, self.dtype, masked=True))
        return sum(out[1:], out[0]) if out else None

    def add_grad(self, dbias: Tensor, span: Span, ds: Tensor) -> None:
        """The score gradient ``ds`` of the keys ``span`` added into ``dbias``."""
        if dbias.shape[-1] == 1:
            dbias.add_(ds.sum_to_size(dbias.shape))
        else:
            keys = self.cols[span[0]][span[1] : span[2]]
            dbias.index_add_(-1, keys, ds.sum_to_size(*dbias.shape[:-1], ds.shape[-1]))


def summed(t: DTensor) -> DTensor:
    """``t`` with its pending sums done (keys or masks pooled over the split tokens by
    DTensor's own matmul are ``Partial``: each rank holds a part of each, not the whole)."""
    if not any(p.is_partial() for p in t.placements):
        return t
    return t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])


def sdpa_bias(mask, q: DTensor, what: str) -> Tensor | None:
    """This rank's rows (images, windows) of SDPA's ``attn_mask`` (whole, or split like the
    queries ``q``): boolean as given (a byte per entry), else in the queries' dtype."""
    if mask is None:
        return None
    if isinstance(mask, DTensor):
        alike = mask.ndim == q.ndim and mask.placements == q.placements
        if not alike or any(mask.shape[x.dim] != q.shape[x.dim] for x in split_layouts(q)):
            why = f"an attention mask {tuple(mask.shape)} split as {mask.placements} next to"
            fix = "; pass the mask whole (a plain tensor) or split like the queries."
            raise refuse(what, f"{why} queries {tuple(q.shape)} split as {q.placements}", "", fix)
        rows = mask.to_local()
    else:
        # the mask broadcasts against the scores (..., L, S) like q against (..., L, E)
        rows = local_part(mask, q, what=what)
    return rows if rows.dtype == torch.bool else rows.to(q.dtype)


def batch_rows(t: Tensor, x: DTensor, seq: tuple, dim: int, rows: int) -> Tensor:
    """This rank's batch of a plain ``t`` along ``dim`` (``rows`` entries per sample: MHA's
    ``(N * heads, Q, L)`` masks) where ``x``'s splits outside ``seq`` split it, unless 1."""
    outer = tuple(lay for lay in split_layouts(x) if lay not in seq)
    if not outer or t.shape[dim] == 1:
        return t
    idx = held_indices(outer).view(-1, 1) * rows + torch.arange(rows).view(1, -1)
    return t.index_select(dim, idx.reshape(-1).to(t.device))


def mha_mask(kw: dict, dtype, cut) -> Tensor | None:
    """MHA's ``attn_mask`` and ``key_padding_mask`` cut by ``cut(mask, name, per_sample or
    None)``, as one additive mask against the scores ``(N_r, heads, Q_r, S_r)``."""
    heads, am, kpm, out = kw["num_heads"], kw["attn_mask"], kw["key_padding_mask"], None
    if am is not None:
        am = additive(cut(am, "attn_mask", heads if am.ndim == 3 else None), dtype, True)
        out = am.view(-1, heads, *am.shape[1:]) if am.ndim == 3 else am
    if kpm is not None:
        kpm = additive(cut(kpm, "key_padding_mask", 1), dtype, True)
        kpm = kpm.view(-1, 1, 1, kpm.shape[-1])
        out = kpm if out is None else out + kpm
    return out


def mha_bias(kw: dict, q: DTensor, k: DTensor, seq: tuple, what: str):
    """MHA's masks on the ring, ``(bias, key bias)``: this rank's rows (``seq``) and batch of
    the whole masks; a ``key_padding_mask`` split like the keys ``k`` (it travels)."""
    kpm, kbias = kw["key_padding_mask"], None
    if isinstance(kpm, DTensor):  # (N, S) split like the keys (S, N, E): it travels with them
        kpm = summed(kpm)
        lays = {replace(x, dim=1 - x.dim) for x in split_layouts(kpm)}
        if kpm.ndim != 2 or lays != set(split_layouts(k)):
            why = f"a key_padding_mask {tuple(kpm.shape)} split as {kpm.placements} unlike the keys"
            fix = "; pass it whole (a plain tensor) or split like the keys."
            raise refuse(what, f"{why} {tuple(k.shape)} {k.placements}", "", fix)
        # whole over the ring (whole keys): each rank's gradient is a part (its queries')
        ring = any(x.mesh_dim in {m.mesh_dim for m in seq} for x in lays)
        kbias = additive(kpm.to_local() if ring else partial_local(kpm, seq), k.dtype, True)
        kbias = kbias.view(kbias.shape[0], 1, kbias.shape[1], 1)  # (N_r, 1, S_r, 1)
    groups = grad_groups(q)

    def cut(mask: Tensor, name: str, per: int | None) -> Tensor:
        if isinstance(mask, DTensor):
            why = f"an {name} that is a DTensor ({mask.placements})"
            raise refuse(what, why, "", "; pass it whole (a plain tensor).")
        part = select_rows(mask, -2, seq if name == "attn_mask" else (), groups)
        return part if per is None else batch_rows(part, q, seq, 0, per)

    kw = kw if kbias is None else {**kw, "key_padding_mask": None}  # it travels
    return mha_mask(kw, q.dtype, cut), kbias
