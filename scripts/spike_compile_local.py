"""Spike: is a compiled strip-sharded CNN of plain local tensors faster than eager DTensor?

A toy residual CNN (``--blocks`` x [conv3x3 -> BatchNorm -> ReLU -> conv3x3 -> BatchNorm,
+ input, ReLU], ``--width`` channels, no conv bias) is trained one step at a time on an
image split in width strips over 1 or 2 gloo ranks (uneven widths: ``--image-w`` odd), by
three routes in the same processes, interleaved round by round:

- ``A eager``: ``parallelize(model, mesh)`` on a ``Shard(3)`` DTensor (the project today);
- ``B eager`` / ``B compiled``: the same parameters on plain local strips. Each 3x3 conv is
  the custom op ``spike::halo_conv``, whose impl calls the forward body of
  ``spconv_train.parallel._halo_conv._HaloConv`` directly (halo exchange overlapped, no
  DTensor, no autograd engine inside) and returns the received halos with the output; its
  ``register_autograd`` backward is a second custom op calling ``_HaloConv.backward`` on
  them. Batch norm: local sums, one ``_functional_collectives.all_reduce`` (traceable) in an
  autograd function, normalise + ReLU in plain ops that inductor fuses. Parameter
  gradients: one flat all-reduce after ``backward()``. ``B compiled``: ``torch.compile``
  (inductor) of that forward; Dynamo's counters are printed (graphs, graph breaks).

Printed per world size: CPU seconds per step (``time.process_time``, max over ranks;
min / median over ``--rounds``), wall seconds (median), Python calls per step (rank 0,
``sys.setprofile``), and the fp64 check: every route's output and every parameter gradient
against the one-device model (max abs error).

Usage: ``python scripts/spike_compile_local.py [--worlds 1 2 --width 64 --blocks 2 --image-h 32
--image-w 255 --rounds 7 --threads 1]`` (docs/design.md, ``torch.compile``: the results).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import init_worker, spawn_ranks  # noqa: E402

from spconv_train.parallel import parallelize  # noqa: E402
from spconv_train.parallel._geometry import all_shard_bounds  # noqa: E402
from spconv_train.parallel._halo_conv import _HaloConv, plan_split  # noqa: E402
from spconv_train.parallel._window import plan_window  # noqa: E402

#: key -> [wp, split, rank, group, geo, backward meta and corrections (set by the forward)]
_PLANS: dict[int, list] = {}


def _plan_key(width: int, kernel: int, rank: int, parts: int, group) -> int:
    """The registry key of a 'same' conv's halo plan over ``parts`` strips of ``width``."""
    key, pad = hash((width, kernel, rank, parts)), kernel // 2
    if key not in _PLANS:
        wp = plan_window("spike conv", width, parts, kernel, 1, 1, pad, pad)
        geo = ((1, 1), (pad,), (1, 1), 1)
        _PLANS[key] = [wp, plan_split(wp, rank, kernel, 1, 1, pad), rank, group, geo, None]
    return key


@torch.library.custom_op("spike::halo_conv", mutates_args=())
def halo_conv_op(x: Tensor, w: Tensor, key: int) -> list[Tensor]:
    """The rank's output of the 'same' conv of strip ``x``, then the received halos."""
    wp, split, rank, group, geo, _ = _PLANS[key]
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved", t))
    out = _HaloConv.forward(ctx, x, w, None, wp, split, rank, group, geo)
    _PLANS[key][5] = ctx.meta
    return [out, *ctx.saved[2:]]


@halo_conv_op.register_fake
def _(x, w, key):
    wp, _, rank = _PLANS[key][:3]
    halos = [(*x.shape[:-1], e - s) for q, s, e in wp.exchange.pieces(rank) if q != rank]
    return [x.new_empty((x.shape[0], w.shape[0], *x.shape[2:])), *map(x.new_empty, halos)]


@torch.library.custom_op("spike::halo_conv_bwd", mutates_args=())
def halo_conv_bwd_op(
    g: Tensor, x: Tensor, w: Tensor, halos: list[Tensor], key: int
) -> list[Tensor]:
    """(input gradient, weight gradient) by ``_HaloConv.backward`` on the saved halos."""
    ctx = SimpleNamespace(saved_tensors=(x, w, *halos), meta=_PLANS[key][5])
    ctx.needs_input_grad = (True, True, False)
    gx, gw = _HaloConv.backward(ctx, g.contiguous())[:2]
    return [gx, gw]


@halo_conv_bwd_op.register_fake
def _(g, x, w, halos, key):
    return [torch.empty_like(x), torch.empty_like(w)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2], *output[1:])
    ctx.key = inputs[2]


def _backward(ctx, grads):
    x, w, *halos = ctx.saved_tensors
    gx, gw = torch.ops.spike.halo_conv_bwd(grads[0], x, w, halos, ctx.key)
    return gx, gw, None


halo_conv_op.register_autograd(_backward, setup_context=_setup)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks (functional collective, traceable); its adjoint is the same sum."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return fc.wait_tensor(fc.all_reduce(g.contiguous(), "sum", dist.group.WORLD))


def bn_local(x: Tensor, bn: nn.BatchNorm2d, count: int, world: int) -> Tensor:
    """Training-mode batch norm with statistics over every rank's strip (``count`` pixels in
    all); running statistics are not updated (a spike)."""
    c = x.shape[1]
    sums = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))])
    if world > 1:
        sums = _AllReduceSum.apply(sums)
    mean, var = sums[:c] / count, sums[c:] / count - (sums[:c] / count) ** 2
    scale = torch.rsqrt(var + bn.eps) * bn.weight
    return x * scale[:, None, None] + (bn.bias - mean * scale)[:, None, None]


class Block(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, + input, ReLU."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)


def forward_local(model: nn.Sequential, x: Tensor, width: int, world: int, group) -> Tensor:
    """Route B: the model on this rank's strip ``x`` of an image ``width`` columns wide."""
    rank = dist.get_rank()
    count = x.shape[0] * x.shape[2] * width

    def conv(c: nn.Conv2d, t: Tensor) -> Tensor:
        if world == 1:
            return F.conv2d(t, c.weight, None, 1, 1)
        return torch.ops.spike.halo_conv(t, c.weight, _plan_key(width, 3, rank, world, group))[0]

    for b in model:
        y = F.relu(bn_local(conv(b.conv1, x), b.bn1, count, world))
        x = F.relu(bn_local(conv(b.conv2, y), b.bn2, count, world) + x)
    return x


def _reduce_grads(model: nn.Module) -> None:
    """Sum every parameter gradient over the ranks (one flat all-reduce)."""
    grads = [p.grad for p in model.parameters()]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))


def _routes(model, img, world, mesh):
    """name -> (model, step function returning the rank's output part) for each route."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    parallelize(a, mesh)
    width, group = img.shape[-1], dist.group.WORLD
    lo, hi = all_shard_bounds(width, world)[dist.get_rank()]
    strip = img[..., lo:hi].contiguous()
    dx = distribute_tensor(img, mesh, [Shard(3)])

    def step_a():  # the loss on the local part as in B (DTensor's mean all-gathers y)
        y = a(dx).to_local()
        ((y * y).sum() / img.numel()).backward()
        return y

    def step_b(fn):
        y = fn(strip)
        ((y * y).sum() / img.numel()).backward()
        if world > 1:
            _reduce_grads(b)
        return y

    eager = lambda t: forward_local(b, t, width, world, group)  # noqa: E731
    compiled = torch.compile(eager)
    steps = {"A eager": step_a, "B eager": lambda: step_b(eager)}
    steps["B compiled"] = lambda: step_b(compiled)
    return {name: (a if name[0] == "A" else b, step) for name, step in steps.items()}


def _errors(routes, model, img, world) -> dict[str, float]:
    """Max abs error (output and every gradient) of each route against one device, fp64."""
    ref = copy.deepcopy(model)
    y = ref(img)
    (y * y).mean().backward()
    lo, hi = all_shard_bounds(img.shape[-1], world)[dist.get_rank()]
    found = {}
    for name, (m, step) in routes.items():
        m.zero_grad(set_to_none=True)
        out = step()
        pairs = zip(m.parameters(), ref.parameters(), strict=True)
        errs = [
            (out - y[..., lo:hi]).abs().max(),
            *((p.grad - q.grad).abs().max() for p, q in pairs),
        ]
        err = torch.stack(errs).max().reshape(1)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        found[name] = err.item()
    return found


def _python_calls(fn) -> int:
    """Python function calls during one call of ``fn`` (``sys.setprofile``)."""
    calls = []
    sys.setprofile(lambda frame, event, arg: event == "call" and calls.append(1))
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


def _time_routes(routes, rounds: int) -> dict[str, tuple[float, float, float]]:
    """Per route: (min, median CPU s, median wall s) per step, max over ranks; the routes
    interleaved round by round after two warm-up rounds (compilation)."""
    cpu, wall = {n: [] for n in routes}, {n: [] for n in routes}
    for r in range(rounds + 2):
        for name, (m, step) in routes.items():
            m.zero_grad(set_to_none=True)
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            t = [time.process_time() - c0, time.perf_counter() - w0]
            t = torch.tensor(t, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= 2:
                cpu[name].append(t[0].item())
                wall[name].append(t[1].item())
    return {n: (min(cpu[n]), statistics.median(cpu[n]), statistics.median(wall[n])) for n in cpu}


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.blocks))).double()
    img = torch.randn(1, args.width, args.image_h, args.image_w, dtype=torch.float64)
    out = {"errors": _errors(_routes(model, img, world, mesh), model, img, world)}
    torch._dynamo.reset()
    model, img = model.float(), img.float()
    routes = _routes(model, img, world, mesh)
    counters = torch._dynamo.utils.counters
    counters.clear()
    out["time"] = _time_routes(routes, args.rounds)
    graphs = counters["stats"]["unique_graphs"]
    out["calls"] = {n: _python_calls(s) for n, (_, s) in routes.items()}
    out["dynamo"] = {
        "graphs": graphs,
        "graph breaks": sum(counters["graph_break"].values()),
        "graphs compiled by a later step": counters["stats"]["unique_graphs"] - graphs,
    }
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    sizes = {"width": 64, "blocks": 2, "image-h": 32, "image-w": 255, "rounds": 7, "threads": 1}
    for name, default in sizes.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    args.device = "cpu"
    for world in args.worlds:
        res = dict(spawn_ranks(_worker, world, args))[0]
        print(f"world {world}: fp64 max abs error vs one device: {res['errors']}")
        print(f"  dynamo: {res['dynamo']}")
        base = res["time"]["A eager"][1]
        for name, (cmin, cmed, wmed) in res["time"].items():
            cpu = f"cpu min {cmin:.4f} med {cmed:.4f} s ({cmed / base:.2f}x A)"
            print(f"  {name:11s} {cpu}, wall med {wmed:.4f} s, python calls {res['calls'][name]}")


if __name__ == "__main__":
    main()
