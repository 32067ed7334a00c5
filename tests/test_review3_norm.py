"""Review of the third cut of the reductions, the gradient reducer, ``CommAudit`` and the
memory probe (issue 22): the cases no other test holds. Every routed reduction name and
call form with a rank holding no column or row (3 ranks, 4 wide / high: 2, 2, 0), a
``dtype``, integer ``cumsum``, torch's error for an integer mean; ``CommAudit``'s kinds for
real gloo collectives; the bucket order of interleaved groups and dtypes; predict's probe
of a model that views or changes its input in place."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit
from spconv_train.parallel._grad_reduce import _layout
from spconv_train.parallel.extend import SpatialMode
from spconv_train.predict._memory_probe import CPU_OVERHEAD, probe_bytes_per_pixel
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import seeded

#: every name the registration loop routes (nansum / nanmean: DTensor's rules all-gathered
#: before), by keyword and position, torch function and Tensor method, dim int / tuple /
#: None, keepdim, dtype, correction / unbiased, on maps and tokens
FORMS = {
    "Tensor.sum w": lambda x: x.sum(3),
    "torch.sum None keep dtype": lambda x: torch.sum(x, None, True, dtype=torch.float64),
    "torch.mean tuple kw": lambda x: torch.mean(x, dim=(1, 3), keepdim=True),
    "Tensor.mean all": lambda x: x.mean(),
    "Tensor.nansum w": lambda x: x.nansum(3),
    "torch.nansum hw NaN dtype": lambda x: torch.nansum(
        x.masked_fill(x > 1.0, float("nan")), (2, 3), dtype=torch.float64
    ),
    "Tensor.nanmean w NaN keep": lambda x: x.masked_fill(x < -1.0, float("nan")).nanmean(3, True),
    "torch.nanmean None dtype": lambda x: torch.nanmean(x, None, dtype=torch.float64),
    "Tensor.nansum tokens": lambda x: x.flatten(2).transpose(1, 2).nansum(1),
    "torch.nanmean tokens keep": lambda x: torch.nanmean(x.flatten(2).transpose(1, 2), 1, True),
    "torch.amax w": lambda x: torch.amax(x, 3),
    "Tensor.amin hw keep": lambda x: x.amin((2, 3), True),
    "torch.max all": lambda x: torch.max(x),
    "Tensor.min all": lambda x: x.min(),
    "torch.var kw unbiased": lambda x: torch.var(x, dim=3, unbiased=False, keepdim=True),
    "Tensor.var positional": lambda x: x.var(2, True, True),
    "torch.var bool": lambda x: torch.var(x, False),
    "Tensor.std correction 2": lambda x: x.std((2, 3), correction=2),
    "torch.std None keep": lambda x: torch.std(x, None, keepdim=True),
    "torch.cumsum w kw": lambda x: torch.cumsum(x, dim=3),
    "Tensor.cumsum h": lambda x: x.cumsum(-2),
}

SCANS = {
    "fp32 cumsum dtype fp64": lambda t: t.float().cumsum(3, dtype=torch.float64),
    "long cumsum": lambda t: (t * 10).long().cumsum(3),
    "bool cumsum dim kw": lambda t: torch.cumsum(t > 0, dim=2),
}


def empty_rank_checks() -> list[str]:
    """``FORMS`` on strips (4 wide) and tiles (4 high) at 3 ranks: the last holds nothing."""
    failures: list[str] = []
    x = seeded(30, 2, 3, 4, 4, dtype=torch.float64)
    x[1, 2, 0, 1] = x.max() + 1.0  # a unique maximum on the first rank
    x[0, 1, 3, 3] = x.min() - 1.0  # a unique minimum on the second rank (strips and tiles)
    layouts = {
        "strips": (mesh(3), [Shard(3)]),
        "tiles 3x1": (mesh((3, 1), ("sp_h", "sp_w")), [Shard(2), Shard(3)]),
    }
    for where, (dmesh, placements) in layouts.items():
        for label, fn in FORMS.items():
            check_fn(fn, x, dmesh, placements, f"{label} @{where}", failures)
        # scans along the split dim in another dtype (values: the input gradient would
        # differ by fp32's rounding of fp64 sums in another order)
        xs = distribute_tensor(x, dmesh, placements)
        for label, fn in SCANS.items():
            with SpatialMode():
                got = fn(xs).full_tensor()
            want = fn(x)
            if got.dtype != want.dtype or not torch.allclose(got, want, rtol=1e-12, atol=0):
                failures.append(f"{label} @{where}: {got.dtype} {got.tolist()} != {want.tolist()}")
        failures += integer_errors(xs)
    return failures


def integer_errors(xs) -> list[str]:
    """An integer ``mean`` / ``nanmean`` / ``var`` / ``std`` raises torch's own error (on
    one device: a RuntimeError), not a floating result; with a floating ``dtype`` it runs."""
    failures, n = [], (xs * 10).long()
    for name in ("mean", "nanmean", "var", "std"):
        want = ""
        try:
            getattr(torch, name)(n.full_tensor(), 3)
        except RuntimeError as exc:
            want = str(exc)
        try:
            with SpatialMode():
                got = f"a {getattr(torch, name)(n, 3).dtype} result"
        except RuntimeError as exc:
            got = str(exc)
        if not want or got != want:
            failures.append(f"integer {name}: {got!r}, on one device {want!r}")
    with SpatialMode():
        y = n.mean(3, dtype=torch.float64).full_tensor()
    if not torch.allclose(y, n.full_tensor().mean(3, dtype=torch.float64), rtol=1e-12):
        failures.append("integer mean with dtype float64: wrong")
    return failures


def test_reductions_exact_with_a_rank_holding_nothing(dist_pool):
    for failures in dist_pool.run(3, empty_rank_checks):
        assert not failures, failures


def audit_real_collectives() -> tuple[list[tuple[str, str]], list[str]]:
    """(op, kind) of each collective gloo runs under ``CommAudit``, and the ops
    ``activation_sized(50)`` flags."""
    rank, x = dist.get_rank(), seeded(31, 2, 3, 4, 5)  # a 120-element map
    with CommAudit() as audit:
        dist.all_gather_into_tensor(torch.empty(4, 3, 4, 5), x)
        dist.all_gather([torch.empty_like(x) for _ in range(2)], x)
        dist.gather(x, [torch.empty_like(x) for _ in range(2)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty_like(x), [x, x] if rank == 0 else None, src=0)
        dist.broadcast(x.clone(), src=0)
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.all_gather_into_tensor(torch.empty(240), x.flatten())  # FSDP's flat buffer
        dist.all_reduce(torch.ones(2, 8))  # a norm's statistics
        dist.all_reduce(x.clone())  # a reduced activation
        if rank == 0:  # a halo of activation size
            dist.send(x, 1)
        else:
            dist.recv(torch.empty_like(x), 0)
    return [(r.op, r.kind) for r in audit.records], [r.op for r in audit.activation_sized(50)]


def test_comm_audit_kinds_of_real_collectives(dist_pool):
    """Every gather-like c10d op is a gather (a flat 1-D one FSDP's ``param``) and flagged;
    a halo's point-to-point and small statistics are not."""
    for rank, (records, flagged) in enumerate(dist_pool.run(2, audit_real_collectives)):
        kinds = [kind for _, kind in records]
        p2p = "send" if rank == 0 else "recv_"
        want = ["gather"] * 6 + ["param", "reduce", "reduce", "p2p"]
        assert kinds == want, records
        assert records[-1][0] == p2p, records
        assert [op for op, _ in records[:6] if op not in flagged] == [], (records, flagged)
        assert flagged == [op for op, _ in records[:6]] + ["allreduce_"], flagged


def test_layout_order_of_interleaved_groups_and_dtypes():
    """Buckets close in the order they fill, then the open ones in the order first used
    (after a close, a key's new bucket counts as first used then); offsets per bucket."""
    f = [torch.zeros(4) for _ in range(4)]  # 16 bytes each
    d = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    entries = [(f[0], ("g",)), (d[0], ("g",)), (f[1], ("h",)), (f[2], ("g",))]
    entries += [(d[1], ("g",)), (f[3], ("g",))]
    buckets = _layout(entries, bucket_bytes=32)
    got = [(bk.groups, [id(p) for p in bk.params], bk.offsets, bk.buffer.numel()) for bk in buckets]
    assert got == [
        (("g",), [id(f[0]), id(f[2])], [0, 4], 10),
        (("g",), [id(d[0]), id(d[1])], [0, 2], 6),
        (("h",), [id(f[1])], [0], 5),
        (("g",), [id(f[3])], [0], 5),
    ]


class _ViewsInput(nn.Module):
    """A 1x1 convolution of a view of its input changed in place (3 -> 2 channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.mul_(1.0)[:, :, ::1])


def test_probe_counts_no_view_of_the_input():
    """The probe's input (``io_bytes_per_pixel`` counts it) stays out of the peak when the
    model views it or changes it in place: only the 2-channel output, 8 B per pixel."""
    assert probe_bytes_per_pixel(_ViewsInput().eval(), 3, 4)[0] == 8 * CPU_OVERHEAD
