"""Global result shapes are probed once per geometry, not on every call (``_dims.py``).

The handlers of ``torch.cat``, ``split`` / ``chunk``, pixel (un)shuffle, token reshapes and
reductions wrap their local results with the op's global shape, read from the op run on
meta tensors. A second forward of the same shapes runs no meta op; its output matches the
plain model's.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from spconv_train.parallel import parallelize
from spconv_train.parallel._dims import _cached, cat_shape, result_shape
from tests.dist_harness import mesh
from tests.reference import seeded
from tests.test_ops_channels import Splits


class _MetaOps(TorchDispatchMode):
    """Counts the aten ops run on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        flat += [t for a in args if isinstance(a, (list, tuple)) for t in a]
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Tokens(Splits):
    """``Splits`` (cat, chunk, split, pixel (un)shuffle on the map), then the same on pixel
    tokens: chunk along the channels, cat, a mean over them, the reshape back."""

    def forward(self, x):
        y = super().forward(x)
        t = y.flatten(2).transpose(1, 2)  # (N, L, C) tokens
        a, b = t.chunk(2, dim=-1)
        # the op's own dtype keyword next to the probe's
        t = torch.cat([a * b.softmax(-1), b], -1) - t.mean(-1, keepdim=True, dtype=t.dtype)
        return t.transpose(1, 2).reshape(y.shape)


def meta_ops_per_forward(world: int) -> tuple[dict, dict, float]:
    torch.manual_seed(0)
    plain = Tokens().double()
    dmesh = mesh(world)
    model = parallelize(copy.deepcopy(plain), dmesh)
    x = seeded(3, 2, 3, 4, 9, dtype=torch.float64)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    counts = []
    for _ in range(2):
        with _MetaOps() as meta:
            out = model(xs)
        counts.append(dict(meta.ops))
    err = float((out.full_tensor() - plain(x)).abs().max())
    return counts[0], counts[1], err


def test_second_forward_runs_no_meta_probe(dist_pool):
    for rank, (first, second, err) in enumerate(dist_pool.run(2, meta_ops_per_forward, 2)):
        assert err < 1e-12, (rank, err)
        assert first, rank  # the probes ran once (the counter sees them)
        assert not second, (rank, second)


def test_probe_cached_and_errors_raised_again():
    hits = _cached.cache_info().hits
    shape = result_shape(torch.split, (2, 7, 5), (3, 4), 1)
    assert shape == ((2, 3, 5), (2, 4, 5))
    assert result_shape(torch.split, (2, 7, 5), (3, 4), 1) == shape
    assert _cached.cache_info().hits == hits + 1
    # the op's own ``dtype`` and ``shape`` keywords reach it
    assert result_shape(torch.sum, (2, 3), 1, meta_dtype=torch.float16, dtype=torch.float64) == (2,)
    assert result_shape(torch.reshape, (2, 3), shape=(3, -1)) == (3, 2)
    # torch's rules: legacy empty 1-D tensors are skipped by cat
    assert cat_shape([(2, 3), (0,), (2, 4)], 1) == (2, 7)
    # an argument that is no cache key (a list) is probed every call, same result
    assert result_shape(torch.split, (2, 7, 5), [3, 4], 1) == shape
    for _ in range(2):  # a failing probe is not cached: torch's error every time
        with pytest.raises(RuntimeError):
            cat_shape([(2, 3), (3, 4)], 1)


def test_probe_keys_tell_bool_from_int():
    """``1`` and ``True`` are the same dict key, not the same index: ``t[1]`` drops a dim,
    ``t[True]`` adds one; each is probed under its own key whichever comes first."""
    from spconv_train.parallel._dims import index_shape

    assert index_shape((2, 3), (1,)) == (3,)
    assert index_shape((2, 3), (True,)) == (1, 2, 3)
    assert index_shape((2, 3), (slice(None), 1)) == (2,)
    assert index_shape((2, 3), (slice(None), True)) == (2, 1, 3)
    assert result_shape(torch.sum, (2, 3), 1, True) == (2, 1)  # dim 1, keepdim
