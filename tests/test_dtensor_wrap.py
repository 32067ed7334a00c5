"""``_dims.wrap_local`` / ``local_of`` (the spatial layers' way in and out of DTensor, on
DTensor internals) build what the public ``DTensor.from_local`` / ``to_local`` build: the
same placements, shape, strides, local strides and ``requires_grad``, and the same gradients
with the same placements and strides, on a cache miss and on a hit (torch 2.14.1)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from spconv_train.parallel._dims import _FAST_NEW, local_of, wrap_local
from tests.dist_harness import mesh
from tests.reference import seeded


def _meta(t) -> tuple:
    if isinstance(t, DTensor):
        return (t.placements, t.shape, t.stride(), t._local_tensor.stride(), t.requires_grad)
    return (t.shape, t.stride(), t.requires_grad)


def _public(local, dmesh, placements, shape) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, dmesh, placements, run_check=False, shape=shape, stride=stride)


def _from_local_case(local, dmesh, placements, shape, ours: bool):
    """``(metadata of the DTensor, of its gradient, the local gradient)``."""
    leaf = local.clone().requires_grad_()
    wrap = wrap_local if ours else _public
    x = wrap(leaf, dmesh, placements, shape)
    seen = []
    x.register_hook(lambda g: seen.append(_meta(g)))
    weight = _public(seeded(5, *local.shape, dtype=local.dtype), dmesh, placements, shape)
    (x * weight).sum().backward()  # the gradient arrives Shard / Replicate / via Partial
    return _meta(x), seen, leaf.grad


def _to_local_case(local, dmesh, placements, shape, grad, grad_placements, ours: bool):
    """``(metadata of the local view, of the DTensor's gradient, the local gradient)``."""
    leaf = local.clone().requires_grad_()
    x = wrap_local(leaf, dmesh, placements, shape)
    seen = []
    x.register_hook(lambda g: seen.append((*_meta(g), g.to_local().clone())))
    out = local_of(x, grad_placements) if ours else x.to_local(grad_placements=grad_placements)
    out.backward(grad)
    return _meta(out), seen, leaf.grad


def wrap_cases() -> list[str]:
    dmesh = mesh(2)
    rank = dmesh.get_rank()
    width = (3, 2)[rank]  # uneven strips of a 5-wide image
    shape = (1, 4, 3, 5)
    local = seeded(1, 1, 4, 3, 5, dtype=torch.float64)[..., (0, 3)[rank] : (3, 5)[rank]]
    cl = local.contiguous(memory_format=torch.channels_last)
    failures = []
    for name, x, placements, shp in [
        ("strip", local, (Shard(3),), shape),
        ("channels-last", cl, (Shard(3),), shape),
        ("replicated", seeded(2, 2, 3, dtype=torch.float64), (Replicate(),), (2, 3)),
    ]:
        for _ in range(2):  # the first call fills the cache, the second reads it
            got = _from_local_case(x, dmesh, placements, shp, ours=True)
            want = _from_local_case(x, dmesh, placements, shp, ours=False)
            if got[:2] != want[:2] or not torch.equal(got[2], want[2]):
                failures.append(f"from_local {name}: {got} != {want}")
    g = seeded(3, 1, 4, 3, width, dtype=torch.float64)
    g_cl = g.contiguous(memory_format=torch.channels_last)
    rep = seeded(4, 2, 3, dtype=torch.float64)
    to_local_cases = [  # (name, local, placements, shape, gradient, grad_placements)
        *[
            (f"{xn} grad {gn}", x, (Shard(3),), shape, grad, None)
            for xn, x in (("strip", local), ("channels-last", cl))
            for gn, grad in (("same", g), ("channels-last", g_cl))
        ],
        ("replicated, Partial gradient", rep, (Replicate(),), (2, 3), rep * 2, (Partial(),)),
    ]
    for name, x, placements, shp, grad, gp in to_local_cases:
        for _ in range(2):
            got = _to_local_case(x, dmesh, placements, shp, grad, gp, ours=True)
            want = _to_local_case(x, dmesh, placements, shp, grad, gp, ours=False)
            same = got[0] == want[0] and torch.equal(got[2], want[2])
            same = same and [s[:-1] for s in got[1]] == [s[:-1] for s in want[1]]
            pairs = zip(got[1], want[1], strict=True)
            if not (same and all(torch.equal(a[-1], b[-1]) for a, b in pairs)):
                failures.append(f"to_local {name}: {got} != {want}")
    with torch.no_grad():  # no graph: a DTensor without grad_fn, like the public call's
        a = wrap_local(local.clone().requires_grad_(), dmesh, (Shard(3),), shape)
        if a.requires_grad or a.grad_fn is not None:
            failures.append(f"no_grad: requires_grad {a.requires_grad}, grad_fn {a.grad_fn}")
    return failures


def test_wrap_matches_public_dtensor_api(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, wrap_cases)):
        assert failures == [], (rank, failures)


def test_wrap_skips_dtensor_init_on_this_torch():
    """The cached crossings build DTensors with torch's ``__new__`` alone (the cases above
    compare them with the public API); torch moving the constructor turns this off."""
    assert _FAST_NEW
