"""Attention masks and biases on the ring (``_ring.py``): a whole mask cut once to this
rank's query rows, each piece's key columns made an additive bias, a ``key_padding_mask``
travelling with the keys, ``is_causal`` formed per piece, a learned bias's gradient summed
into its columns (docs/attention.md, "Masks and biases on the ring").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._errors import module_path
from ._geometry import SpatialShardingError
from ._halo import sum_grad_over
from ._sharding import grad_groups
from ._token_layout import dim_layouts, held_indices, local_part
from ._tokens import TokenLayout, split_layouts


def additive(mask: Tensor, dtype: torch.dtype, masked: bool) -> Tensor:
    """``mask`` as an additive bias of ``dtype``: a boolean one ``-inf`` where it equals
    ``masked`` (SDPA masks ``False``, ``nn.MultiheadAttention`` ``True``), else 0."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(mask if masked else ~mask, -math.inf)


def select_rows(mask: Tensor, picks: dict[int, tuple[TokenLayout, ...]], groups: tuple) -> Tensor:
    """The entries of the whole ``mask`` that this rank's queries (or keys) meet: along
    each mask dim of ``picks`` (from the end: -2 the query rows, -4 the images, -1 the key
    columns) the indices the layouts give this rank, unless broadcast. Its gradient is
    summed over ``groups`` (the ranks splitting those queries or keys)."""
    part = sum_grad_over(mask, groups)
    for d, lays in picks.items():
        if lays and -d <= part.ndim and part.shape[d] != 1:
            part = part.index_select(d, held_indices(lays).to(part.device))
    return part


def finite(lse: Tensor) -> Tensor:
    """``lse`` with the rows no key reached (``-inf``) at 0, as the CPU flash kernel gives
    them: ``exp(score - lse)`` is then 0 there, not NaN."""
    return lse.masked_fill(lse == -math.inf, 0.0)


@dataclass(frozen=True)
class RingMask:
    """Where the mask meets the ring's pieces: ``cols``, the global key indices of every
    ring member in its local order; ``rows``, the global indices of this rank's queries
    when causal; ``dtype``: the queries'. The bias (this rank's rows, its last dim all
    ``S`` keys or 1) is passed apart, as an autograd input."""

    cols: tuple[Tensor, ...]
    rows: Tensor | None
    dtype: torch.dtype

    def _keys(self, span: tuple[int, int, int]) -> Tensor:
        owner, lo, hi = span
        return self.cols[owner][lo:hi]

    def block(
        self, bias: Tensor | None, span: tuple[int, int, int], travelling: tuple = ()
    ) -> Tensor | None:
        """The additive mask of the keys ``span`` (``(owner, lo, hi)``: tokens ``lo:hi`` of
        the owner's block) for this rank's queries; ``travelling``: the piece's own key
        mask ``(..., tokens, 1)``, if one travels. None when nothing masks."""
        keys = self._keys(span)
        out = travelling[0].transpose(-2, -1) if travelling else None
        if bias is not None:
            cols = bias if bias.shape[-1] == 1 else bias.index_select(-1, keys)
            out = _plus(out, additive(cols, self.dtype, masked=False))
        if self.rows is not None:  # a key after the query is masked
            out = _plus(out, additive(self.rows.unsqueeze(-1) < keys, self.dtype, masked=True))
        return out

    def add_grad(self, dbias: Tensor, span: tuple[int, int, int], ds: Tensor) -> None:
        """Add the score gradient ``ds`` of the keys ``span`` into ``dbias``'s columns of
        those keys, summed over the dims the bias broadcasts."""
        if dbias.shape[-1] == 1:
            dbias.add_(ds.sum_to_size(dbias.shape))
            return
        ds = ds.sum_to_size(*dbias.shape[:-1], ds.shape[-1])
        dbias.index_add_(-1, self._keys(span), ds)


def key_grads(travelling: tuple, ds: Tensor | None) -> tuple[Tensor, ...]:
    """The gradient of a piece's travelling key mask (``()`` without one; zeros when ``ds``
    was not formed: the mask needs none)."""
    if not travelling:
        return ()
    kb = travelling[0]
    if ds is None:
        return (torch.zeros_like(kb),)
    return (ds.sum_to_size(*kb.shape[:-2], 1, ds.shape[-1]).transpose(-2, -1),)


def _plus(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a + b


def sdpa_bias(mask, q: DTensor, what: str) -> Tensor | None:
    """This rank's rows (and images, windows) of SDPA's ``attn_mask`` (whole, or a DTensor
    split like the queries ``q``): boolean as given (a byte per entry), a float one in the
    queries' dtype."""
    if mask is None:
        return None
    if isinstance(mask, DTensor):
        alike = mask.ndim == q.ndim and mask.placements == q.placements
        if not alike or any(mask.shape[x.dim] != q.shape[x.dim] for x in split_layouts(q)):
            raise SpatialShardingError(
                f"{what} in module '{module_path()}': an attention mask {tuple(mask.shape)} "
                f"split as {mask.placements} next to queries {tuple(q.shape)} split as "
                f"{q.placements} is not supported; pass the mask whole (a plain tensor) or "
                "split like the queries."
            )
        rows = mask.to_local()
    else:
        # the mask broadcasts against the scores (..., L, S) like q against (..., L, E)
        rows = local_part(mask, q, what=what)
    return rows if rows.dtype == torch.bool else rows.to(q.dtype)


def _key_mask(mask: DTensor, k: DTensor, what: str) -> Tensor:
    """This rank's keys' entries ``(N_r, 1, S_r, 1)`` of a ``key_padding_mask`` ``(N, S)``
    split like the sequence-first keys ``k`` ``(S, N, E)``: it travels with them."""
    swap = {0: 1, 1: 0}  # (N, S) against (S, N, E)
    lays = {dataclasses.replace(x, dim=swap[x.dim]) for x in split_layouts(mask)}
    if mask.ndim != 2 or lays != set(split_layouts(k)):
        raise SpatialShardingError(
            f"{what} in module '{module_path()}': a key_padding_mask {tuple(mask.shape)} "
            f"split as {mask.placements} unlike the keys {tuple(k.shape)} {k.placements} is "
            "not supported; pass it whole (a plain tensor) or split like the keys."
        )
    local = additive(mask.to_local(), k.dtype, True)
    return local.view(local.shape[0], 1, local.shape[1], 1)


def mha_bias(
    attn_mask, key_padding_mask, q: DTensor, k: DTensor, heads: int, what: str
) -> tuple[Tensor | None, Tensor | None]:
    """``nn.MultiheadAttention``'s masks on the ring: ``(bias, key bias)``. ``bias``: this
    rank's rows of the whole ones (``attn_mask`` ``(L, S)`` or ``(N * heads, L, S)``,
    ``key_padding_mask`` ``(N, S)``) as one additive bias broadcasting to ``(N_r, heads,
    L_r, S)``; ``key bias``: a ``key_padding_mask`` split like the keys (``_key_mask``).
    ``q``, ``k``: the sequence-first queries ``(L, N, E)`` and keys."""
    bias, lays = None, split_layouts(q)
    n, groups = q.shape[1], grad_groups(q)
    # (L, N, E) against (N, heads, L, S): q's dim 0 meets the mask's -2, dim 1 its -4
    picks = {{0: -2, 1: -4}[d]: dim_layouts(lays, d) for d in {lay.dim for lay in lays}}
    kbias = _key_mask(key_padding_mask, k, what) if isinstance(key_padding_mask, DTensor) else None
    kpm = key_padding_mask if kbias is None else None
    for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", kpm)):
        if mask is None:
            continue
        if isinstance(mask, DTensor):
            raise SpatialShardingError(
                f"{what} in module '{module_path()}': an {name} that is a DTensor "
                f"({mask.placements}) is not supported; pass it whole (a plain tensor)."
            )
        mask = sum_grad_over(mask, groups)  # before the view: a parameter's own gradient
        if name == "key_padding_mask":
            mask = mask.view(n, 1, 1, mask.shape[-1])
        elif mask.ndim == 3:
            mask = mask.view(n, heads, *mask.shape[-2:])
        part = additive(select_rows(mask, picks, ()), q.dtype, True)
        bias = _plus(bias, part)
    return bias, kbias
