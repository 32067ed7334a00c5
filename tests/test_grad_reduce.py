"""Bucketed asynchronous gradient reduction (issue 11 item 3): exact gradients vs one device
at 1, 2 and (dp, sp) = 2x2 ranks with a shared weight, a weight also used whole outside a
sharded op, an unused parameter, a parameter that gets no gradient in one step and
gradient accumulation; fewer all-reduces than parameters; batch norm's affine gradients
reduced once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import CommAudit, _small_sum, parallelize
from spconv_train.parallel._grad_reduce import GradReducer, _layout
from tests.dist_harness import mesh
from tests.reference import check_close, seeded


class _Net(nn.Module):
    """A conv used twice (shared weight), batch norm, group norm, an unused parameter, a
    head whose weight is also used whole, a head that only some steps use and a branch
    computed but off the way to the loss (its gradient stays None on one device, so it must
    sharded too)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=False)  # batch norm follows
        self.bn = nn.BatchNorm2d(6)
        self.shared = nn.Conv2d(6, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.head = nn.Conv2d(6, 2, 1)
        self.extra = nn.Conv2d(6, 2, 1)  # used only when asked
        self.unused = nn.Parameter(torch.ones(4))
        self.dead = nn.Conv2d(6, 2, 1)  # run, output discarded

    def forward(self, x, use_extra: bool = False):
        h = torch.relu(self.bn(self.stem(x)))
        h = self.shared(torch.relu(self.shared(h)))  # the same weight twice
        h = self.gn(h)
        self.dead(h)
        # the head's weight also whole, in a plain factor: that use's gradient is complete
        # on every rank and must not be summed with the conv's partial one
        out = self.head(h) * self.head.weight.mean()
        return out + self.extra(h) if use_extra else out


def _randomized(seed: int) -> _Net:
    torch.manual_seed(seed)
    net = _Net()
    with torch.no_grad():
        for name in ("bn", "gn"):
            getattr(net, name).weight.uniform_(0.5, 1.5)
            getattr(net, name).bias.uniform_(-0.5, 0.5)
    return net


def grads_compare(shape: tuple[int, ...], exchange_bytes: int | None = None) -> dict:
    if exchange_bytes is not None:  # a pool worker: restored below
        saved, _small_sum.EXCHANGE_SUM_BYTES = _small_sum.EXCHANGE_SUM_BYTES, exchange_bytes
        try:
            return grads_compare(shape)
        finally:
            _small_sum.EXCHANGE_SUM_BYTES = saved
    dmesh = mesh(shape)
    placements = [Shard(3)] if len(shape) == 1 else [Shard(0), Shard(3)]
    batch = 2 if len(shape) == 1 else 2 * shape[0]
    ref = _randomized(0)
    par = parallelize(copy.deepcopy(ref), dmesh)
    failures: list[str] = []
    # Three backwards accumulated: one without ``extra``, then two with it.
    for step, use_extra in enumerate((False, True, True)):
        x = seeded(10 + step, batch, 3, 6, 19)
        y_ref = ref(x, use_extra)
        target = seeded(50 + step, *y_ref.shape)
        ((y_ref - target) ** 2).sum().div(target.numel()).backward()
        y_par = par(distribute_tensor(x, dmesh, placements), use_extra)
        t = distribute_tensor(target, dmesh, placements)
        ((y_par - t) ** 2).sum().div(t.numel()).backward()  # a sum: no gather of strips
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            if q.grad is None:
                if p.grad is not None:
                    failures.append(f"step {step} {name}: gradient where one device has none")
                continue
            check_close(f"step {step} {name} grad", p.grad, q.grad, 1e-5, failures)
    with CommAudit() as audit:
        par.zero_grad()
        y_par = par(distribute_tensor(seeded(1, batch, 3, 6, 19), dmesh, placements))
        y_par.to_local().sum().backward()
    reduces = audit.summary().get("reduce", {}).get("count", 0)
    n_params = sum(1 for _ in par.parameters())
    # The summed gradients, bit for bit (every rank must hold the same ones).
    bits = [p.grad.double().flatten().tolist() for p in par.parameters() if p.grad is not None]
    return {"failures": failures, "reduces": reduces, "params": n_params, "bits": bits}


@pytest.mark.parametrize(
    "shape,exchange_bytes",
    # exchange_bytes 0: every bucket and norm statistic takes gloo's all-reduce instead of
    # the exchange sum.
    [((1,), None), ((2,), None), ((2, 2), None), ((3,), None), ((3,), 0)],
    ids=str,
)
def test_bucketed_grads_match_single_device(dist_pool, shape, exchange_bytes):
    world = 1
    for n in shape:
        world *= n
    results = dist_pool.run(world, grads_compare, shape, exchange_bytes)
    assert all(r["bits"] == results[0]["bits"] for r in results), "ranks disagree on grads"
    for rank, res in enumerate(results):
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"])
        if world > 1:
            # Per step: one batch-norm statistics reduce in forward (x2: mean, variance) and
            # one in backward (its affine grads included), group norm's 2 forward + 1
            # backward, and the bucketed parameter gradients (1 bucket per group); before
            # this, 11 parameter gradients were reduced one by one (plus batch norm twice).
            assert res["reduces"] < res["params"], res


def exchange_beside_other(order_by_rank: tuple[str, str], other: str) -> list[float]:
    """Post a gradient exchange and another message ("halo": a halo-style message on tag 0,
    "stats": a norm layer's synchronous statistics sum) in ``order_by_rank[rank]`` order
    ("gh": gradients first), then wait on both; return the summed buffer."""
    import torch.distributed as dist

    from spconv_train.parallel._halo import post_p2p
    from spconv_train.parallel._runtime import SpatialStats
    from spconv_train.parallel._small_sum import ExchangeSum, sum_now

    rank = dist.get_rank()
    peer = 1 - rank
    buf = seeded(70 + rank, 5)
    halo_out, halo_in = seeded(80 + rank, 3), torch.empty(3)

    def second():
        if other == "stats":
            sum_now(halo_in.copy_(halo_out), dist.group.WORLD)
            return None
        return post_p2p(dist.group.WORLD, [(peer, halo_out)], [(peer, halo_in)], SpatialStats())

    if order_by_rank[rank] == "gh":
        pending = [ExchangeSum(buf, dist.group.WORLD), second()]
    else:
        pending = [second(), ExchangeSum(buf, dist.group.WORLD)]
    for p in reversed(pending):
        if p is not None:
            p.wait()
    want = seeded(80 + peer, 3)
    assert torch.equal(halo_in, want if other == "halo" else seeded(80, 3) + seeded(81, 3))
    return buf.tolist()


@pytest.mark.parametrize("other", ["halo", "stats"])
def test_gradient_exchange_never_matches_other_messages(dist_pool, other):
    """A bucket posted before a halo exchange (or a norm's statistics sum) on one rank and
    after it on the other (its gradient hook fires elsewhere in the backward there) still
    pairs with its own kind."""
    results = dist_pool.run(2, exchange_beside_other, ("gh", "hg"), other, timeout=60)
    expected = (seeded(70, 5) + seeded(71, 5)).tolist()
    assert results == [expected, expected]


def test_layout_buckets_by_size_and_groups():
    """Buckets close at the size limit, keep one group/dtype each, and list parameters in
    the given order."""
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(3, dtype=torch.float64)

    buckets = _layout([(a, ("g",)), (b, ("g",)), (c, ("g",))], bucket_bytes=40)
    assert [[id(p) for p in bk.params] for bk in buckets] == [[id(a)], [id(b)], [id(c)]]
    buckets = _layout([(a, ("g",)), (b, ("g",)), (c, ("g",))], bucket_bytes=10**6)
    assert [len(bk.params) for bk in buckets] == [2, 1]
    assert buckets[0].offsets == [0, 10] and buckets[0].flags_at == 20
    assert buckets[0].buffer.numel() == 22  # the gradients, then one flag per parameter


def test_reducer_ignores_one_rank_groups():
    """Nothing is marked (no hook, no collective) when no group has more than one rank."""

    reducer = GradReducer()
    p = torch.zeros(3, requires_grad=True)
    reducer.mark(p, ())
    assert not reducer._pending and not reducer._hooked


def test_a_parameter_at_a_freed_ones_address_gets_its_own_hook(monkeypatch):
    """Ids are reused once their object is freed: a new parameter at a freed one's address
    must still be hooked (before: it was taken for the old one, its gradient was never
    summed on this rank and the other ranks waited forever)."""
    import spconv_train.parallel._grad_reduce as gr

    monkeypatch.setattr(gr, "group_size", lambda group: 2)  # as if 2+ ranks
    reducer = GradReducer()
    old = torch.zeros(3, requires_grad=True)
    reducer.mark(old, ("g",))
    address = id(old)
    reducer._pending.clear()  # the step ended
    del old
    for _ in range(1000):  # CPython hands a freed object's memory to the next one soon
        new = torch.zeros(3, requires_grad=True)
        if id(new) == address:
            break
    else:
        pytest.skip("the allocator reused no address")
    reducer.mark(new, ("g",))
    assert reducer._hooked[address][0]() is new
