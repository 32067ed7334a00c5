"""The extension example of docs/extending.md, run exactly as the page shows it.

The marked code blocks (a median filter and its spatial version, built on
``spconv_train.parallel.extend`` only) are read from the markdown file and executed, then
the parallelized filter is compared with one device in fp64, output and input gradient, on
width strips, H x W tiles, volumes split along one dim and volume blocks, at 2 and 3 ranks
(and a real 2 x 2 grid at 4) with uneven sizes. ``CommAudit`` checks that no collective
moved an activation: the halos are point-to-point messages between neighbours.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit, parallelize
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MARK = "<!-- tests/test_extend_example.py runs this block -->"
TOL = 1e-12
#: the spatial version must stay this short (issue: "a new op in at most 15 lines")
MAX_LINES = 15


def example_blocks() -> list[str]:
    """The code blocks of docs/extending.md marked as run by this test, in order."""
    text = DOC.read_text()
    blocks = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2, f"expected 2 marked blocks in {DOC}, found {len(blocks)}"
    return blocks


_NAMESPACE: dict = {}


def example() -> dict:
    """The names the example defines (executed once per process)."""
    if not _NAMESPACE:
        ns: dict = {"__name__": "extending_example"}
        for block in example_blocks():
            exec(compile(block, str(DOC), "exec"), ns)  # noqa: S102 - the project's own docs
        _NAMESPACE.update(ns)
    return _NAMESPACE


def test_example_is_short_and_uses_only_extend():
    single, spatial = example_blocks()
    lines = [ln for ln in spatial.splitlines() if ln.strip()]
    assert len(lines) <= MAX_LINES, spatial
    imports = [ln for ln in spatial.splitlines() if ln.startswith(("import ", "from "))]
    assert imports == [
        "from spconv_train.parallel.extend import halo_window, register_spatial_module"
    ]
    assert "spconv_train" not in single


def test_example_is_the_plain_op_on_one_device():
    ns = example()
    x = seeded(0, 1, 1, 4, 5, dtype=torch.float64)
    got = ns["MedianFilter"](3)(x)
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate")
    want = (
        torch.stack([padded[..., i : i + 4, j : j + 5] for i in range(3) for j in range(3)], -1)
        .median(-1)
        .values
    )
    assert torch.equal(got, want)
    # the spatial version on a plain tensor is the plain op
    assert torch.equal(ns["SpatialMedianFilter"](3)(x), got)


def _cases(world: int) -> list[tuple[str, tuple, tuple, tuple, list]]:
    """``(label, global shape, mesh shape, mesh names, placements)`` per layout."""
    n = 3 * world + 1  # uneven over ``world`` parts
    cases = [
        ("strips", (2, 2, 5, n), (world,), ("sp",), [Shard(3)]),
        ("tiles H", (2, 2, n, 6), (world, 1), ("sp_h", "sp_w"), [Shard(2), Shard(3)]),
        ("tiles W", (1, 2, 5, n), (1, world), ("sp_h", "sp_w"), [Shard(2), Shard(3)]),
        ("volume D", (1, 2, n, 4, 5), (world,), ("sp",), [Shard(2)]),
        ("volume W", (1, 2, 4, 3, n), (world,), ("sp",), [Shard(4)]),
        ("volume blocks", (1, 2, 4, n, n), (1, world), ("sp_h", "sp_w"), [Shard(3), Shard(4)]),
    ]
    if world == 4:  # a real grid: corners come from the diagonal neighbours
        cases = [
            ("tiles 2x2", (2, 2, 7, 9), (2, 2), ("sp_h", "sp_w"), [Shard(2), Shard(3)]),
            ("blocks 2x2x1", (1, 2, 5, 7, 4), (2, 2, 1), ("sp_d", "sp_h", "sp_w"),
             [Shard(2), Shard(3), Shard(4)]),
        ]  # fmt: skip
    return cases


def run_example(world: int, k: int) -> list[str]:
    """Every layout of ``_cases``: the parallelized example filter equals one device."""
    ns = example()
    failures: list[str] = []
    for label, shape, mshape, names, placements in _cases(world):
        dmesh = mesh(mshape, names)
        ref = nn.Sequential(ns["MedianFilter"](k)).double()
        par = parallelize(copy.deepcopy(ref), dmesh)
        if type(par[0]).__name__ != "SpatialMedianFilter":
            failures.append(f"{label}: parallelize did not swap the filter")
        x = seeded(1, *shape, dtype=torch.float64)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        g = seeded(2, *yr.shape, dtype=torch.float64)
        yr.backward(g)
        xs = distribute_tensor(x, dmesh, placements).requires_grad_()
        gs = distribute_tensor(g, dmesh, placements)
        with CommAudit() as audit:
            ys = par(xs)
            ys.backward(gs)
        tag = f"{label} k={k} {shape} on {mshape}"
        if list(ys.placements) != placements:
            failures.append(f"{tag}: output placements {ys.placements}")
        check_close(f"{tag} output", ys, yr, TOL, failures)
        check_close(f"{tag} input grad", xs.grad, xr.grad, TOL, failures)
        moved = audit.activation_sized(max(1, xs.to_local().numel() // 4))
        failures += [f"{tag}: activation-sized {r.op} {r.shape}" for r in moved]
        if not any(r.kind == "p2p" for r in audit.records):
            failures.append(f"{tag}: no halo exchanged")
    return failures


@pytest.mark.parametrize("world,k", [(2, 3), (3, 3), (4, 3)])
def test_example_matches_one_device_on_every_layout(dist_pool, world, k):
    for failures in dist_pool.run(world, run_example, world, k):
        assert not failures, "\n".join(failures)
