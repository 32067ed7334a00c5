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
  gradients: one flat all-reduce after ``backward()``. ``B compiled`` is
  ``torch.compile`` (inductor) of that forward; Dynamo's counters are printed (graphs,
  graph breaks, frames compiled after the first step).

Printed per world size: CPU seconds per step (``time.process_time``, max over ranks;
min / median over ``--rounds``), wall seconds (median), Python calls per step (rank 0,
``sys.setprofile``), and the fp64 check: every route's output and every parameter gradient
against the one-device model (max abs error).

Usage: ``python scripts/spike_compile_local.py [--worlds 1 2 --width 64 --blocks 2
--image-h 32 --image-w 255 --rounds 7 --threads 1]``.
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
    key = hash((width, kernel, rank, parts))
    if key not in _PLANS:
        pad = kernel // 2
        wp = plan_window("spike conv", width, parts, kernel, 1, 1, pad, pad)
        split = plan_split(wp, rank, kernel, 1, 1, pad)
        _PLANS[key] = [wp, split, rank, group, ((1, 1), (pad,), (1, 1), 1), None]
    return key


def _halo_shapes(x: Tensor, key: int) -> list[tuple[int, ...]]:
    wp, _, rank = _PLANS[key][:3]
    pieces = [(s, e) for q, s, e in wp.exchange.pieces(rank) if q != rank]
    return [(*x.shape[:-1], e - s) for s, e in pieces]


@torch.library.custom_op("spike::halo_conv", mutates_args=())
def halo_conv_op(x: Tensor, w: Tensor, key: int) -> list[Tensor]:
    """The rank's output of the 'same' conv of strip ``x``, then the received halos."""
    wp, split, rank, group, geo, _ = _PLANS[key]
    ctx = SimpleNamespace(save_for_backward=lambda *t: setattr(ctx, "saved", t))
    out = _HaloConv.forward(ctx, x, w, None, wp, split, rank, group, geo)
    _PLANS[key][5] = (ctx.meta, ctx.corrections)
    return [out, *ctx.saved[2:]]


@halo_conv_op.register_fake
def _(x, w, key):
    out = x.new_empty((x.shape[0], w.shape[0], *x.shape[2:]))
    return [out, *(x.new_empty(s) for s in _halo_shapes(x, key))]


@torch.library.custom_op("spike::halo_conv_bwd", mutates_args=())
def halo_conv_bwd_op(g: Tensor, x: Tensor, w: Tensor, halos: list[Tensor], key: int) -> list[Tensor]:
    """(input gradient, weight gradient) by ``_HaloConv.backward`` on the saved halos."""
    meta, corrections = _PLANS[key][5]
    ctx = SimpleNamespace(saved_tensors=(x, w, *halos), meta=meta, corrections=corrections)
    ctx.needs_input_grad = (True, True, False)
    gx, gw = _HaloConv.backward(ctx, g.contiguous())[:2]
    return [gx, gw]


@halo_conv_bwd_op.register_fake
def _(g, x, w, halos, key):
    return [torch.empty_like(x), torch.empty_like(w)]


def _setup(ctx, inputs, output):
    x, w, key = inputs
    ctx.save_for_backward(x, w, *output[1:])
    ctx.key = key


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
    mean = sums[:c] / count
    var = sums[c:] / count - mean * mean
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
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


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
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(v.view_as(g))


def _routes(model, img, world, mesh):
    """name -> (model, step function returning the rank's output part) for each route."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    parallelize(a, mesh)
    width, group = img.shape[-1], dist.group.WORLD
    lo, hi = all_shard_bounds(width, world)[dist.get_rank()]
    strip = img[..., lo:hi].contiguous()
    dx = distribute_tensor(img, mesh, [Shard(3)])
    numel = img.numel()
    compiled = torch.compile(lambda t: forward_local(b, t, width, world, group))

    def step_a():
        y = a(dx)
        (y * y).mean().backward()
        return y.to_local()

    def step_b(fn):
        y = fn(strip)
        ((y * y).sum() / numel).backward()
        if world > 1:
            _reduce_grads(b)
        return y

    eager_b = lambda: step_b(lambda t: forward_local(b, t, width, world, group))  # noqa: E731
    return {"A eager": (a, step_a), "B eager": (b, eager_b), "B compiled": (b, lambda: step_b(compiled))}


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
        errs = [(out - y[..., lo:hi]).abs().max()]
        errs += [(p.grad - q.grad).abs().max() for p, q in zip(m.parameters(), ref.parameters(), strict=True)]
        err = torch.stack(errs).max().reshape(1)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        found[name] = err.item()
    return found


def _python_calls(fn) -> int:
    calls = [0]

    def prof(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    mesh = init_worker(rank, world, port, args)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
    img = torch.randn(1, args.width, args.image_h, args.image_w)
    out = {"errors": _errors(_routes(model.double(), img.double(), world, mesh), model, img.double(), world)}
    torch._dynamo.reset()
    model, img = model.float(), img.float()
    routes = _routes(model, img, world, mesh)
    torch._dynamo.utils.counters.clear()
    cpu, wall = {n: [] for n in routes}, {n: [] for n in routes}
    for r in range(args.rounds + 2):
        if r == 2:
            frames_after_warmup = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for name, (m, step) in routes.items():
            m.zero_grad(set_to_none=True)
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            t = torch.tensor([time.process_time() - c0, time.perf_counter() - w0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r >= 2:
                cpu[name].append(t[0].item())
                wall[name].append(t[1].item())
    c = torch._dynamo.utils.counters
    out["dynamo"] = {
        "graphs": c["stats"]["unique_graphs"],
        "graph breaks": sum(c["graph_break"].values()),
        "graphs after warm-up": c["stats"]["unique_graphs"] - frames_after_warmup,
    }
    out["calls"] = {n: _python_calls(s) for n, (_, s) in routes.items()}
    out["time"] = {n: (min(cpu[n]), statistics.median(cpu[n]), statistics.median(wall[n])) for n in routes}
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--image-h", type=int, default=32)
    ap.add_argument("--image-w", type=int, default=255)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    args.device = "cpu"
    for world in args.worlds:
        res = dict(spawn_ranks(_worker, world, args))[0]
        print(f"world {world}: fp64 max abs error vs one device: {res['errors']}")
        print(f"  dynamo: {res['dynamo']}")
        base = res["time"]["A eager"][1]
        for name, (cmin, cmed, wmed) in res["time"].items():
            line = f"cpu min {cmin:.4f} med {cmed:.4f} s ({cmed / base:.2f}x A) wall med {wmed:.4f} s"
            print(f"  {name:11s} {line}  python calls {res['calls'][name]}")


if __name__ == "__main__":
    main()
