"""FSDP2 over the whole mesh (``parallel.fsdp``, ``shard_parameters``), issue 25 items 1, 2, 4.

In float64 on gloo worker groups: dp 2 x sp 2 (4 ranks) and dp 1 x sp 2 on a width that
does not split evenly. After two AdamW steps with gradient clipping, the gradients and
parameters of the FSDP run equal one device's and the plain sharded run's; each rank keeps
1 / world of the parameters and optimizer state; the built-in reducer issues no collective
(nothing reduced twice); activation checkpointing keeps working; bf16 maps to FSDP's mixed
precision policy; replicas may validate different numbers of images inside
``full_parameters``; and ``verify`` with ``parallel.fsdp: true`` passes at dp 2 x sp 2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.parallel import _grad_reduce, full_parameters, parallelize, shard_parameters
from spconv_train.train.losses import cross_entropy
from spconv_train.train.optim import (
    checkpoint_blocks,
    clip_gradients,
    enable_activation_checkpointing,
)
from tests.dist_harness import device, mesh
from tests.reference import full, rel_err, seeded

TOL = 1e-10
CLIP = 0.05  # small enough that every step clips: the global norm over shards matters


class _Squeeze(nn.Module):
    """Squeeze-and-excitation: its convs see the width-replicated pooled map, so their
    gradients are partial over dp only (reduced over fewer ranks than the world)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))


class _Net(nn.Module):
    """Blocks with batch norm (affine gradients reduced with its statistics), group norm,
    a conv used twice, squeeze-and-excitation and a head at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU()
        )
        self.shared = nn.Conv2d(6, 6, 3, padding=1)
        self.mid = nn.Sequential(nn.GroupNorm(2, 6), _Squeeze(6))
        self.head = nn.Conv2d(6, 3, 1)

    def forward(self, x):
        h = self.enc(x)
        h = self.shared(torch.relu(self.shared(h)))
        return self.head(self.mid(h))


def _net() -> _Net:
    torch.manual_seed(3)
    net = _Net().double()
    with torch.no_grad():
        for norm in (net.enc[1], net.mid[0]):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return net.to(device())  # SPCONV_TEST_DEVICE


def _batches(steps: int, n: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(steps):
        x = seeded(10 + s, n, 3, 6, width, dtype=torch.float64)
        t = (seeded(20 + s, n, 6, width).abs() * 1.5).long().clamp(max=2)
        out.append((x.to(device()), t.to(device())))
    return out


def _train(model, batches, dmesh=None) -> tuple[list[dict], dict]:
    """Two AdamW steps with clipping; per step the full gradients, then the parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for x, t in batches:
        if dmesh is None:
            loss = F.cross_entropy(model(x), t)
        else:
            xd = distribute_tensor(x, dmesh, [Shard(0), Shard(3)])
            loss = cross_entropy(model(xd), t)
        loss.backward()
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        clip_gradients(list(model.parameters()), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, DTensor)]
    return grads, {"params": params, "optim_local": sum(v.to_local().numel() for v in state)}


def _worst(got: dict, want: dict) -> tuple[float, str]:
    return max((rel_err(got[n], want[n], floor=1e-12), n) for n in want)


def fsdp_vs_references(dp: int, sp: int, width: int, checkpointing: bool) -> dict:
    dmesh = mesh((dp, sp))
    batches = _batches(2, 2 * dp, width)
    ref_grads, ref = _train(_net(), batches)
    plain_grads, plain = _train(parallelize(_net(), dmesh), batches, dmesh)

    calls = []
    real = _grad_reduce.sum_async
    _grad_reduce.sum_async = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        model = parallelize(_net(), dmesh)
        if checkpointing:
            enable_activation_checkpointing(model)
        blocks = checkpoint_blocks(model)
        shard_parameters(model, blocks)
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        grads, got = _train(model, batches, dmesh)
    finally:
        _grad_reduce.sum_async = real
    return {
        "blocks": len(blocks),
        "reducer_calls": len(calls),
        "local": local,
        "total": total,
        "optim_local": got["optim_local"],
        "grad_vs_one": max(_worst(g, r) for g, r in zip(grads, ref_grads, strict=True)),
        "grad_vs_plain": max(_worst(g, r) for g, r in zip(grads, plain_grads, strict=True)),
        "param_vs_one": _worst(got["params"], ref["params"]),
        "param_vs_plain": _worst(got["params"], plain["params"]),
    }


@pytest.mark.parametrize(
    "dp, sp, width, checkpointing",
    [(2, 2, 16, False), (1, 2, 19, False), (2, 2, 16, True)],
    ids=["dp2xsp2", "dp1xsp2-uneven", "dp2xsp2-checkpointing"],
)
def test_fsdp_equals_one_device_and_the_plain_sharded_run(dist_pool, dp, sp, width, checkpointing):
    world = dp * sp
    for res in dist_pool.run(world, fsdp_vs_references, dp, sp, width, checkpointing):
        assert res["blocks"] == 2  # enc and mid: one gather / reduce-scatter unit each
        for key in ("grad_vs_one", "grad_vs_plain", "param_vs_one", "param_vs_plain"):
            assert res[key][0] < TOL, (key, res[key])
        assert res["reducer_calls"] == 0  # the built-in reducer stepped aside
        # 1/world of every parameter (dim 0 padded up to a multiple of world at most)
        assert res["local"] <= res["total"] / world + 6 * 3 * 3 * 3
        assert res["optim_local"] == 2 * res["local"]  # AdamW's two moments, sharded alike


def bf16_policy() -> dict:
    dmesh = mesh((2, 2))
    model = parallelize(_net().float(), dmesh)
    ref = _net().float()
    shard_parameters(
        model, checkpoint_blocks(model), param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    seen = []
    model.head.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    ((x, t),) = _batches(1, 4, 16)
    x = x.float()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = cross_entropy(model(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])), t)
    loss.backward()
    F.cross_entropy(ref(x), t).backward()
    p = model.enc[0].weight
    return {
        "forward_dtype": str(seen[0]),
        "sharded_dtype": str(p.dtype),
        "grad_dtype": str(p.grad.dtype),
        "grad_err": rel_err(p.grad, ref.enc[0].weight.grad),
    }


def test_bf16_gathers_bf16_parameters_and_keeps_fp32_shards(dist_pool):
    for res in dist_pool.run(4, bf16_policy):
        assert res["forward_dtype"] == "torch.bfloat16"
        assert res["sharded_dtype"] == res["grad_dtype"] == "torch.float32"
        assert res["grad_err"] < 0.05, res  # bf16 compute, same gradient


def uneven_replicas() -> list[float]:
    """dp 2 x sp 1: replica 0 runs two evaluation forwards, replica 1 one."""
    dmesh = mesh((2, 1))
    ref = _net().eval()
    model = shard_parameters(parallelize(_net(), dmesh), [])
    model.eval()
    rank = dmesh.get_coordinate()[0]
    errs = []
    with torch.no_grad(), full_parameters(model):
        for i in range(2 - rank):
            x = seeded(40 + i, 1, 3, 6, 12, dtype=torch.float64).to(device())
            y = model(distribute_tensor(x, dmesh["sp"], [Shard(3)]))
            errs.append(rel_err(y, ref(x)))
    # parameters are shards again afterwards: a training forward gathers them as usual
    ((x, t),) = _batches(1, 2, 12)
    model.train()
    cross_entropy(model(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])), t).backward()
    return errs + [float(isinstance(next(model.parameters()), DTensor))]


def test_full_parameters_lets_replicas_run_different_numbers_of_forwards(dist_pool):
    out = dist_pool.run(2, uneven_replicas, timeout=120)
    assert len(out[0]) == 3 and len(out[1]) == 2
    assert all(e < TOL for e in out[0][:-1] + out[1][:-1]), out
    assert out[0][-1] == out[1][-1] == 1.0


def test_shard_parameters_refuses_a_plain_model():
    with pytest.raises(ValueError, match="not parallelized"):
        shard_parameters(_net())


def verify_fsdp() -> dict:
    from tests.test_verify import TINY, _verify

    return _verify(TINY + ["parallel.sp=2", "parallel.fsdp=true"], steps=2)


def test_verify_with_fsdp_passes_at_dp2_sp2(dist_pool):
    d = dist_pool.run(4, verify_fsdp)[0]
    assert d["passed"], d["verdict"]
    assert d["mesh"] == {"dp": 2, "sp": 2}
    assert d["precision"] == "fp64"
    assert not d["activation_sized_collectives"]
    kinds = d["comms"][0]["max_per_rank"]
    assert kinds["param"]["count"] > 0  # FSDP's all-gathers and reduce-scatters
    assert "gather" not in kinds  # verify's own recording (full gradients) is not counted
    assert max(c["max_rel_err"] for c in d["checks"] if c["kind"] == "param") < 1e-12


def refusals() -> list[str]:
    model = shard_parameters(parallelize(_net(), mesh((1, 2))))
    out = []
    for attempt in (lambda: shard_parameters(model), lambda: copy.deepcopy(model)):
        try:
            attempt()
            out.append("")
        except (ValueError, AssertionError) as exc:
            out.append(str(exc))
    return out


def test_a_sharded_model_is_not_sharded_again_nor_copied(dist_pool):
    # verify copies the reference before sharding: FSDP2 refuses a copy afterwards.
    for again, copied in dist_pool.run(2, refusals):
        assert "sharded already" in again
        assert "deepcopy" in copied


def compiled_fsdp() -> list[float]:
    """``training.compile`` on an FSDP model (aot_eager): gradients equal one device's."""
    from spconv_train.models import create_model

    dmesh = mesh((1, 2))
    torch.manual_seed(0)
    ref = create_model("unet", num_classes=3, depth=2, base_width=4).double().to(device())
    model = parallelize(copy.deepcopy(ref), dmesh)
    shard_parameters(model, checkpoint_blocks(model))
    model.compile(backend="aot_eager", dynamic=False)
    errs = []
    for x, t in _batches(2, 1, 20):
        x = torch.cat([x, x], dim=2)  # 12 rows: the U-Net pools once
        t = torch.cat([t, t], dim=1)
        cross_entropy(model(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])), t).backward()
        F.cross_entropy(ref(x), t).backward()
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        errs.append(max(rel_err(p.grad, r.grad, floor=1e-12) for p, r in pairs))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
    return errs


def test_compile_keeps_working_with_fsdp(dist_pool):
    for errs in dist_pool.run(2, compiled_fsdp):
        assert max(errs) < TOL, errs
