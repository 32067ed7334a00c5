"""``split`` / ``chunk`` of a token tensor along a dim no layout splits: local pieces with
the same placements. DTensor's ``split_with_sizes`` takes a ``_StridedShard`` only when it
can treat it as even; on uneven strips (a rank holding no window) it would replicate,
gathering the activation. Plain ``Shard`` layouts: ``_channels.py``; prefix tokens:
``_token_prefix.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._channels import local_pieces
from ._dims import norm_dim
from ._prefix_shard import prefix_of
from ._tokens import chain, is_nested, is_tokens, split_layouts

#: the size argument's keyword in ``torch.split``, ``Tensor.split`` and ``chunk``
_SIZES = ("split_size_or_sections", "split_size", "chunks")


def _local_pieces(func, prev, x, *args, **kwargs):
    """``func(x, arg, dim)`` on the local tensor when ``x`` is a token tensor and ``dim``
    is not split by any of its layouts; otherwise ``prev`` (the handler before)."""
    arg = args[0] if args else next((kwargs[n] for n in _SIZES if n in kwargs), None)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if (
        arg is None
        or set(kwargs) - {"dim", *_SIZES}
        or not (is_tokens(x) or is_nested(x))
        or any(p.is_partial() or prefix_of(p) for p in x.placements)
    ):
        return prev(x, *args, **kwargs)
    d = norm_dim(dim, x.ndim)
    if any(lay.dim == d for lay in split_layouts(x)):
        return prev(x, *args, **kwargs)
    return local_pieces(func, x, arg, d)


for _fn, _run in (
    (torch.split, torch.split),
    (Tensor.split, torch.split),
    (torch.chunk, torch.chunk),
    (Tensor.chunk, torch.chunk),
):
    chain(_fn, prefix="token_pieces")(
        lambda prev, x, *a, _run=_run, **k: _local_pieces(_run, prev, x, *a, **k)
    )
