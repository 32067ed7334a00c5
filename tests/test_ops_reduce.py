"""Reductions and statistics (sum, mean, amax, var, std; functions and Tensor methods, every
call form) and softmax / cumsum over H, W, C or all dims of a width-sharded DTensor, also on
a (dp, sp) mesh: exact in fp64, no activation gather."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded

#: the call forms (overloads, keyword and positional arguments) and the reductions that keep
#: the sharded dim (local); each reduction along every layout's axes: test_reshape_grid.py
CASES = {
    "torch.mean w": lambda x: torch.mean(x, -1),
    "sum c keep": lambda x: x.sum(1, keepdim=True),
    "sum h": lambda x: torch.sum(x, dim=2),
    "mean n,w list": lambda x: x.mean([0, 3]),
    "amax all": lambda x: x.amax(),
    "std hw": lambda x: x.std((2, 3)),
    "std correction0": lambda x: torch.std(x, (-2, -1), correction=0, keepdim=True),
    "var unbiased false": lambda x: x.var(False),
    "var w biased": lambda x: x.var(3, False, True),
    "softmax c method": lambda x: x.softmax(1),
    "cumsum h method": lambda x: x.cumsum(-2),
}


def reduce_checks(shape: tuple[int, ...], width: int) -> list[str]:
    dmesh = mesh(shape)
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    failures: list[str] = []
    x = seeded(1, 2, 3, 5, width, dtype=torch.float64)
    x[0, 0, 1, 2] = x.max() + 1.0  # a unique maximum and a tie across strips for amax
    x[1, 1, 2, 0] = x[1, 1, 2, width - 1] = x.max() + 2.0
    for label, fn in CASES.items():
        check_fn(fn, x, dmesh, placements, f"{label} @{shape} w={width}", failures)
    return failures


def test_reduction_call_forms_exact_without_gather(dist_pool):
    # at 3 ranks (uneven strips) and on a (dp, sp) mesh
    for world, shape, width in ((3, (3,), 10), (4, (2, 2), 11)):
        for failures in dist_pool.run(world, reduce_checks, shape, width):
            assert not failures, failures


def out_refusals() -> list[str]:
    """Every reduction with ``out=`` on a sharded (handled) and a Partial (DTensor's rules)
    input: refused by name, never a silently unwritten ``out``."""
    dmesh, failures = mesh((2,)), []
    x = seeded(2, 2, 3, 4, 6, dtype=torch.float64)
    inputs = {
        "Shard(3)": distribute_tensor(x, dmesh, [Shard(3)]),
        "Partial": DTensor.from_local(x, dmesh, [Partial()], run_check=False),
    }
    calls = {
        "sum w": lambda t, o: torch.sum(t, 3, out=o),
        "mean c keep": lambda t, o: torch.mean(t, 1, True, out=o),
        "amax all keep": lambda t, o: torch.amax(t, (), True, out=o),
        "amin h": lambda t, o: torch.amin(t, 2, out=o),
        "var w": lambda t, o: torch.var(t, 3, out=o),
        "std all": lambda t, o: torch.std(t, None, out=o),
    }
    for (where, t), (label, call) in itertools.product(inputs.items(), calls.items()):
        out = torch.zeros(())
        try:
            with SpatialMode():
                call(t, out)
            failures.append(f"{label} on {where}: not refused (out {out})")
        except SpatialShardingError as exc:
            if "out=" not in str(exc):
                failures.append(f"{label} on {where}: {exc}")
    return failures


def test_reduction_out_refused(dist_pool):
    for failures in dist_pool.run(2, out_refusals):
        assert not failures, failures


#: reductions over the tokens of a map flattened to ``(N, L, C)`` (a ``_StridedShard``; on
#: tiles the token dim split by two mesh dims) that reach these handlers, not the token ones
TOKENS = {
    "var tokens": lambda t: t.var(1),
    "std tokens keep": lambda t: torch.std(t, 1, keepdim=True, correction=0),
    "amin all keep": lambda t: torch.amin(t, (), True),
    "amax all": lambda t: t.amax(),
    "var all": lambda t: t.var(),
    "sum none keep": lambda t: torch.sum(t, None, True),
    "softmax tokens": lambda t: t.softmax(1),
    "log_softmax tokens": lambda t: torch.log_softmax(t, -2, torch.float64),
}


def _as_map(y: torch.Tensor) -> torch.Tensor:
    """Tokens ``(2, 35, C)`` back as the ``5 x 7`` map (the harness shards a map's gradient)."""
    return y.transpose(1, 2).unflatten(2, (5, 7)) if y.shape[1:2] == (35,) else y


def token_checks(world: int) -> list[str]:
    failures: list[str] = []
    x = seeded(4, 2, 3, 5, 7, dtype=torch.float64)
    x[0, 1, 2, 3] = x.min() - 1.0  # a unique minimum
    tiles = mesh((2, world // 2), ("sp_h", "sp_w"))
    layouts = {"strips": (mesh((world,)), [Shard(3)]), "tiles": (tiles, [Shard(2), Shard(3)])}
    for (where, (dmesh, placements)), (label, fn) in itertools.product(
        layouts.items(), TOKENS.items()
    ):
        for grad in ("shard", "replicate"):
            tokens = lambda t, fn=fn: _as_map(fn(t.flatten(2).transpose(1, 2)))  # noqa: E731
            check_fn(tokens, x, dmesh, placements, f"{label} {where} {grad}", failures, grad=grad)
    return failures


def test_token_reductions_exact_without_gather(dist_pool):
    """Before: ``var(1)`` / ``std(1)`` / ``softmax(1)`` all-gathered the tokens (DTensor's
    rule on the ``_StridedShard``), ``amin((), keepdim=True)`` gave a NaN input gradient."""
    for failures in dist_pool.run(4, token_checks, 4):
        assert not failures, failures
