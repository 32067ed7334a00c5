"""Review of the token layer's third cut: ``prod`` now runs through the token-wise handler on
any DTensor (maps too). Over dims no rank splits it is exact, also where the product's
gradient is special (zeros in the input: one zero, two zeros in one product), on a ``dp``
mesh dim, on volumes split along D and for integer maps; over a split dim (the batch split by
``dp`` included) it is refused by name with the workaround. The token handlers (reductions,
arithmetic, reshapes, ``chunk``, ``roll``) take the tensor by keyword too
(``torch.sum(input=x, dim=1)``: an unnamed ``TypeError`` before). fp64 output and input
gradient against one device, uneven widths, no-gather audit (``tests/op_check.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel.extend import SpatialMode, SpatialShardingError
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded


def _no_failures(results: list) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:20])


def _with_zeros(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros: one in a channel product, two in another (its gradient all zero
    but at neither), one in a row of W and in a column of H."""
    x = x.clone()
    x[0, 1, 0, 0] = 0
    x[1, 0, -1, 1] = x[1, 2, -1, 1] = 0
    x[0, 0, 2, -1] = 0
    return x


def _meshes(world: int, ndim: int = 4) -> list:
    """``(label, mesh, placements, split dims)``: strips along H and W, a ``dp`` mesh dim
    splitting the batch next to ``sp`` (each of size 1 in turn), volumes along D."""
    if ndim == 5:
        return [("D", mesh((world,), ("sp_d",)), [Shard(2)], {2})]
    return [
        ("W strips", mesh(world), [Shard(3)], {3}),
        ("H strips", mesh(world), [Shard(2)], {2}),
        ("dp", mesh((world, 1), ("dp", "sp")), [Shard(0), Shard(3)], {0, 3}),
        ("dp 1 x sp", mesh((1, world), ("dp", "sp")), [Shard(0), Shard(2)], {0, 2}),
    ]


#: ``(name, op, dim)``: a product over ``dim`` of a map, times the map where it keeps dims
PRODUCTS = [
    ("prod channels", lambda m: m.prod(1), 1),
    ("torch.prod keepdim", lambda m: torch.prod(m, 1, True) * m, 1),
    ("prod dim= keepdim= dtype=", lambda m: m.prod(dim=1, keepdim=True, dtype=m.dtype) * m, 1),
    ("prod W", lambda m: m.prod(-1, keepdim=True) * m, -1),
    ("prod H", lambda m: m.prod(-2), -2),
    ("prod batch", lambda m: m * m.prod(0), 0),
]


def product_failures(ndim: int) -> list[str]:
    world, failures = dist.get_world_size(), []
    spatial = (2 * world + 1, 3, 2 * world + 1)[5 - ndim :]  # uneven along the split dims
    for zeros in (False, True):
        x = seeded(51, 2, 3, *spatial, dtype=torch.float64)
        x = _with_zeros(x) if zeros and ndim == 4 else x
        for label, dmesh, placements, split in _meshes(world, ndim):
            for name, op, dim in PRODUCTS:
                tag = f"{name} {label}{' zeros' if zeros else ''}"
                if dim % ndim not in split:
                    check_fn(op, x, dmesh, placements, tag, failures)
                    continue
                try:
                    with SpatialMode():
                        op(distribute_tensor(x, dmesh, placements))
                    failures.append(f"{tag}: over a split dim, not refused")
                except SpatialShardingError as e:
                    if "prod" not in str(e) or "x.log().sum(dim).exp()" not in str(e):
                        failures.append(f"{tag}: refused without the name / workaround: {e}")
            # an integer map: exact, int64 as torch gives
            xi = (x * 4).round().long()
            with SpatialMode():
                y = distribute_tensor(xi, dmesh, placements).prod(1)
            if y.dtype != torch.int64 or not torch.equal(y.full_tensor(), xi.prod(1)):
                failures.append(f"int prod channels {label}: {y.dtype}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_prod_of_maps_exact_or_refused(dist_pool, world):
    """Maps (4-D), zeros in the input, ``dp`` meshes: no test covered them."""
    _no_failures(dist_pool.run(world, product_failures, 4))


def test_prod_of_volumes(dist_pool):
    _no_failures(dist_pool.run(2, product_failures, 5))


def _tokens(m: torch.Tensor) -> torch.Tensor:
    return m.flatten(2).transpose(1, 2)


def _map(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Tokens ``t`` ``(N, H W, C')`` back as a map like ``m``."""
    return t.transpose(1, 2).reshape(m.shape[0], -1, *m.shape[2:])


#: the tensor by keyword (``input=``), a reduction over the channels and over the split dim
BY_KEYWORD = [
    ("torch.prod(input=)", lambda m: torch.prod(input=m, dim=1)),
    ("torch.sum(input=) channels", lambda m: torch.sum(input=m, dim=1)),
    ("torch.sum(input=) tokens", lambda m: torch.sum(input=_tokens(m), dim=1)[..., None, None] * m),
    ("torch.amax(input=)", lambda m: _map(torch.amax(input=_tokens(m), dim=-1, keepdim=True), m)),
    ("torch.softmax(input=)", lambda m: torch.softmax(input=m, dim=1)),
    ("torch.cumsum(input=) channels", lambda m: _map(torch.cumsum(input=_tokens(m), dim=2), m)),
    # the other token handlers: arithmetic, reshapes, chunk, roll behind a prefix
    (
        "torch.mul(input=, other=) tokens",
        lambda m: _map(torch.mul(input=_tokens(m), other=_tokens(m)), m),
    ),
    (
        "torch.add(input=) a plain embedding",
        lambda m: _map(torch.add(input=_tokens(m), other=_embedding(m)), m),
    ),
    ("torch.flatten(input=)", lambda m: _map(torch.flatten(input=m, start_dim=2).mT, m)),
    (
        "torch.unflatten(input=)",
        lambda m: torch.unflatten(input=m.flatten(2), dim=2, sizes=m.shape[2:]),
    ),
    ("torch.reshape(input=) tokens", lambda m: _map(_heads(_tokens(m)).flatten(2), m)),
    (
        "torch.chunk(input=) tokens",
        lambda m: _map(torch.chunk(input=_tokens(m), chunks=2, dim=-1)[1], m),
    ),
    ("torch.roll(input=) behind a prefix", lambda m: _map(_rolled(_tokens(m))[:, 1:], m)),
]


def _embedding(m: torch.Tensor) -> torch.Tensor:
    """A plain ``(1, H W, C)`` position embedding for the tokens of ``m``."""
    n = m.shape[1] * m.shape[2:].numel()
    return torch.linspace(-1, 1, n, dtype=m.dtype, device=m.device).view(1, -1, m.shape[1])


def _heads(t: torch.Tensor) -> torch.Tensor:
    return torch.reshape(input=t, shape=(t.shape[0], t.shape[1], 2, -1))


def _rolled(t: torch.Tensor) -> torch.Tensor:
    """``t`` behind a constant prefix token, rolled along the channels by keyword."""
    front = torch.ones(1, 1, t.shape[-1], dtype=t.dtype, device=t.device)
    return torch.roll(input=torch.cat([front.expand(t.shape[0], -1, -1), t], 1), shifts=1, dims=-1)


def keyword_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(52, 2, 4, 5, 2 * world + 1, dtype=torch.float64)
    for label, dmesh, placements, _ in _meshes(world)[:2]:
        for name, op in BY_KEYWORD:
            try:
                check_fn(op, x, dmesh, placements, f"{name} {label}", failures)
            except TypeError as e:  # the handler's signature: unnamed, not a refusal
                failures.append(f"{name} {label}: {e}")
    return failures


def test_token_handlers_take_the_tensor_by_keyword(dist_pool):
    """``torch.sum(input=x, dim=1)``, ``torch.add(input=...)``, ``torch.reshape(input=...)``,
    ``torch.chunk(input=...)``, ``torch.roll(input=...)`` raised ``TypeError: handler()
    missing 1 required positional argument`` (the handlers took the tensor by position)."""
    _no_failures(dist_pool.run(2, keyword_failures))
