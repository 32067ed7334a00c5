"""``parallel.grad_reduce: ddp`` (the default): DistributedDataParallel over the whole mesh
as the gradient reducer, issue 25 item 2.

In float64 on gloo worker groups, through ``prepare_model`` (what ``run`` and ``verify``
train): dp 1 x sp 2 on a width that does not split evenly and dp 2 x sp 2. After two AdamW
steps with gradient clipping the parameters of the DDP run equal the built-in reducer's
run's and one device's; a parameter no rank uses keeps ``.grad`` None and the run goes on;
``runtime_of``, ``local_module``, activation checkpointing and ``verify`` work through the
wrapper (an smp model with unused encoder stages too); ``train()`` (float32) ends alike
with either reducer, exports the model's own names and resumes from one to the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from spconv_train.config import load_config
from spconv_train.parallel import local_module, runtime_of
from spconv_train.train.losses import cross_entropy
from spconv_train.train.model_setup import prepare_model
from tests.dist_harness import mesh
from tests.test_fsdp import TOL, _batches, _net, _train, _worst

PREFIX = "module."


def _prepared(dmesh, reducer: str, checkpointing: bool = False) -> nn.Module:
    ck = f"training.activation_checkpointing={str(checkpointing).lower()}"
    cfg = load_config(None, [f"parallel.grad_reduce={reducer}", ck])
    return prepare_model(_net(), dmesh, cfg, "fp64")


def _names(params: dict) -> dict:
    return {n.removeprefix(PREFIX): p for n, p in params.items()}


def ddp_vs_builtin(dp: int, sp: int, width: int, checkpointing: bool) -> dict:
    dmesh = mesh((dp, sp))
    batches = _batches(2, 2 * dp, width)
    _, one = _train(_net(), batches)
    builtin_model = _prepared(dmesh, "builtin", checkpointing)
    _, builtin = _train(builtin_model, batches, dmesh)
    model = _prepared(dmesh, "ddp", checkpointing)
    _, ddp = _train(model, batches, dmesh)
    ddp_params = _names(ddp["params"])
    return {
        "wrapped": isinstance(model, DistributedDataParallel),
        "builtin_wrapped": isinstance(builtin_model, DistributedDataParallel),
        "deferred": runtime_of(model).grad_reducer.deferred_world,
        "same_names": sorted(ddp_params) == sorted(one["params"]),
        "ddp_vs_builtin": _worst(ddp_params, builtin["params"]),
        "ddp_vs_one": _worst(ddp_params, one["params"]),
        "builtin_vs_one": _worst(builtin["params"], one["params"]),
        "local_is_inner": local_module(model) is getattr(model, "module", None),
    }


@pytest.mark.parametrize(
    "dp, sp, width, checkpointing",
    [(1, 2, 19, False), (2, 2, 16, False), (2, 2, 16, True)],
    ids=["dp1xsp2-uneven", "dp2xsp2", "dp2xsp2-checkpointing"],
)
def test_ddp_equals_builtin_reducer_and_one_device(dist_pool, dp, sp, width, checkpointing):
    for res in dist_pool.run(dp * sp, ddp_vs_builtin, dp, sp, width, checkpointing):
        assert res["wrapped"] and not res["builtin_wrapped"]
        assert res["deferred"] == dp * sp  # DDP averages over the whole mesh
        assert res["same_names"] and res["local_is_inner"]
        for key in ("ddp_vs_builtin", "ddp_vs_one", "builtin_vs_one"):
            assert res[key][0] < TOL, (key, res[key])


class _WithUnused(nn.Module):
    """``_net`` plus a head the forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.unused = nn.Conv2d(3, 3, 1).double()

    def forward(self, x):
        return self.net(x)


def unused_parameter_steps() -> dict:
    dmesh = mesh((2, 2))
    cfg = load_config(None, [])  # grad_reduce: ddp, the default
    model = prepare_model(_WithUnused(), dmesh, cfg, "fp64")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads_none = []
    for x, t in _batches(3, 4, 16):
        loss = cross_entropy(model(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])), t)
        loss.backward()
        grads_none.append(local_module(model).unused.weight.grad is None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"wrapped": isinstance(model, DistributedDataParallel), "grads_none": grads_none}


def test_a_parameter_no_rank_uses_keeps_no_gradient_and_training_goes_on(dist_pool):
    for res in dist_pool.run(4, unused_parameter_steps):
        assert res["wrapped"]
        assert res["grads_none"] == [True, True, True]


def one_rank_mesh() -> bool:
    return isinstance(_prepared(mesh(1), "ddp"), DistributedDataParallel)


def test_a_one_rank_mesh_is_not_wrapped(dist_pool):
    assert dist_pool.run(1, one_rank_mesh) == [False]


def test_an_unknown_reducer_is_refused():
    with pytest.raises(Exception, match="grad_reduce"):
        load_config(None, ["parallel.grad_reduce=nccl"])


def verify_reducers() -> list[dict]:
    from tests.test_verify import TINY, _verify

    base = [*TINY, "parallel.sp=2"]
    return [_verify([*base, f"parallel.grad_reduce={r}"], steps=2) for r in ("ddp", "builtin")]


def test_verify_passes_with_either_reducer_and_names_the_ddp_one(dist_pool):
    ddp, builtin = dist_pool.run(4, verify_reducers)[0]
    assert ddp["passed"] and builtin["passed"], (ddp["printed"], builtin["printed"])
    assert any("DistributedDataParallel" in n for n in ddp["notes"]), ddp["notes"]
    assert any("built-in bucketed reducer" in n for n in builtin["notes"]), builtin["notes"]
    # Different traffic: DDP all-reduces every parameter once over the world, the built-in
    # reducer the partial gradients over sp, then over dp
    reduce = [d["comms"][0]["max_per_rank"]["reduce"]["elements"] for d in (ddp, builtin)]
    assert reduce[0] > 0 and reduce[1] > 0 and reduce[0] != reduce[1], reduce


def audited_ddp_reduction() -> dict:
    """One step after a first (DDP's static graph settles in its first backward)."""
    from spconv_train.parallel import CommAudit

    dmesh = mesh((1, 2))
    model = _prepared(dmesh, "ddp")
    for x, t in _batches(2, 2, 16):
        with CommAudit() as audit:
            cross_entropy(model(distribute_tensor(x, dmesh, [Shard(0), Shard(3)])), t).backward()
    n = sum(p.numel() for p in model.parameters())
    return {"n": n, "reduces": [r.numel for r in audit.records if r.op == "allreduce_"]}


def test_ddp_all_reduce_is_audited_once_per_step_with_every_parameter(dist_pool):
    for res in dist_pool.run(2, audited_ddp_reduction):
        # the bucket of all parameters; no used-parameter map after the first step
        assert res["reduces"].count(res["n"]) == 1, res
        assert all(k < 16 for k in res["reduces"] if k != res["n"]), res  # norm statistics


def smp_unused_encoder_stages() -> dict:
    """smp U-Net on a depth-3 ResNet-18 encoder: layers 3 and 4 exist but are unused."""
    from spconv_train.models import create_model

    def build():
        torch.manual_seed(0)
        kw = {"encoder_name": "resnet18", "encoder_depth": 3, "decoder_channels": (16, 8, 4)}
        return create_model("smp.Unet", num_classes=3, **kw).double().train()

    dmesh = mesh(2)
    x = torch.randn(2, 3, 32, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    t = torch.randint(0, 3, (2, 32, 40), generator=torch.Generator().manual_seed(6))
    out = {}
    for reducer in ("ddp", "builtin", "one"):
        if reducer == "one":
            model = build()
        else:
            cfg = load_config(None, [f"parallel.grad_reduce={reducer}"])
            model = prepare_model(build(), dmesh, cfg, "fp64")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            if reducer == "one":
                loss = torch.nn.functional.cross_entropy(model(x), t)
            else:
                loss = cross_entropy(model(distribute_tensor(x, dmesh, [Shard(3)])), t)
            loss.backward()
            unused = sorted(n for n, p in local_module(model).named_parameters() if p.grad is None)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[reducer] = {n: p.detach().clone() for n, p in local_module(model).named_parameters()}
        out[f"{reducer}_unused"] = unused
    return {
        "unused": len(out["ddp_unused"]),
        "same_unused": out["ddp_unused"] == out["one_unused"] == out["builtin_unused"],
        "ddp_vs_builtin": _worst(out["ddp"], out["builtin"]),
        "ddp_vs_one": _worst(out["ddp"], out["one"]),
    }


def test_smp_model_with_unused_encoder_stages_trains_as_one_device(dist_pool):
    for res in dist_pool.run(2, smp_unused_encoder_stages):
        assert res["unused"] > 0 and res["same_unused"], res
        for key in ("ddp_vs_builtin", "ddp_vs_one"):
            assert res[key][0] < TOL, (key, res[key])


RUN_CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 1, base_width: 4}}}}
data: {{height: 16, width: 44, num_train: 8, num_val: 1, batch_size: 1}}
optimizer: {{name: adamw, lr: 1.0e-2}}
parallel: {{sp: 2, grad_reduce: {reducer}}}
training: {{steps: {steps}, val_every: 2, log_every: 100, seed: 5}}
checkpoint: {{every: 2, keep_last: 2}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def train_runs(root: str) -> dict:
    """``train()`` at dp 2 x sp 2: 4 steps with DDP; 4 steps with the built-in reducer; 2
    steps with the built-in reducer resumed to 4 with DDP. Returns the exported weights."""
    import torch.distributed as dist

    from spconv_train.config import load_config
    from spconv_train.train import loop

    def run(name: str, reducer: str, steps: int, resume: bool) -> dict:
        path = Path(root) / f"{name}-{reducer}-{steps}.yaml"
        if dist.get_rank() == 0:
            text = RUN_CONFIG.format(run_dir=Path(root) / name, reducer=reducer, steps=steps)
            path.write_text(text)
        dist.barrier()
        loop.train(load_config(path, []), resume=resume)
        dist.barrier()
        return torch.load(Path(root) / name / "model.pt", weights_only=True)["model"]

    out = {"ddp": run("ddp", "ddp", 4, False), "builtin": run("builtin", "builtin", 4, False)}
    run("switch", "builtin", 2, False)
    out["switch"] = run("switch", "ddp", 4, True)
    return out


def test_run_trains_alike_with_both_reducers_and_resumes_across_them(dist_pool, tmp_path):
    res = dist_pool.run(4, train_runs, str(tmp_path))[0]
    ddp = res["ddp"]
    assert not any(k.startswith(PREFIX) for k in ddp)  # model.pt: the model's own names
    for other in ("builtin", "switch"):
        assert sorted(res[other]) == sorted(ddp)
        worst = max((float((res[other][k] - v).abs().max()), k) for k, v in ddp.items())
        assert worst[0] < 1e-6, (other, worst)  # float32: the reduction order differs
