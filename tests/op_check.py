"""Check a function on a sharded DTensor against the plain op: value, input gradient, and
that no activation moved by gather (``CommAudit``), in fp64."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.parallel import CommAudit, parallelize
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import device
from tests.reference import check_close, full, grad_dtensor, seeded

TOL = 1e-10


def _first(y):
    return y[0] if isinstance(y, (tuple, list)) else y


def check_fn(
    fn,
    x: torch.Tensor,
    dmesh,
    placements,
    label,
    failures,
    tol=TOL,
    param_shapes=frozenset(),
    grad: str = "shard",
    out_placements=None,
):
    """Run ``fn`` on ``x`` and on ``x`` distributed with ``placements`` (under
    ``SpatialMode``), backward a seeded upstream gradient through both, and append every
    mismatch (output, input gradient, output placements not plain or not ``out_placements``
    when given, a gather-like collective) to ``failures``. Tuple outputs: every element is
    compared, the first is differentiated. ``grad``: the upstream gradient's placements
    ("shard": the output's, "replicate" or "partial"; ``tests/reference.grad_dtensor``);
    only a "shard" gradient's backward is audited (DTensor first redistributes the others,
    a ``Partial`` one by a reduction of the output's size)."""
    x = x.to(device())  # SPCONV_TEST_DEVICE (tests/dist_harness.py)
    xr = x.clone().requires_grad_()
    yr = fn(xr)
    shape = _first(yr).shape
    g = seeded(99, max(shape.numel(), 1), dtype=x.dtype)[: shape.numel()].reshape(shape)
    g = g.to(x.device)
    _first(yr).backward(g)
    xs = distribute_tensor(x.clone(), dmesh, placements).requires_grad_()
    with CommAudit() as audit, SpatialMode():
        ys = fn(xs)
    outs = ys if isinstance(ys, (tuple, list)) else (ys,)
    if not all(isinstance(o, DTensor) for o in outs):
        failures.append(f"{label}: output is not a DTensor")
        return
    if out_placements is not None and list(outs[0].placements) != list(out_placements):
        failures.append(f"{label}: output placements {outs[0].placements} != {out_placements}")
    gs = grad_dtensor(g, dmesh, grad, outs[0].placements)
    with CommAudit() as back:
        outs[0].backward(gs)
    if grad == "shard":  # DTensor redistributes another gradient first (Partial: a reduce)
        audit.records += back.records
    refs = yr if isinstance(yr, (tuple, list)) else (yr,)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        check_close(f"{label} output[{i}]", full(o), r, tol, failures)
    check_close(f"{label} input grad", xs.grad, xr.grad, tol, failures)
    # an activation moved (tiny gathers of per-sample statistics are not flagged)
    moved = audit.activation_sized(max(8, xs.to_local().numel() // 4), param_shapes)
    if moved:
        failures.append(f"{label}: activation-sized collectives {moved}")


def check_module(model, x: torch.Tensor, dmesh, placements, label: str, failures, tol=TOL, **check):
    """``check_fn`` for a module: the plain copy against a ``parallelize``d copy, and every
    parameter gradient too; ``check``: ``check_fn``'s ``grad`` and ``out_placements``."""
    model = model.to(device())
    ref = copy.deepcopy(model)
    par = parallelize(copy.deepcopy(model), dmesh)
    shapes = {tuple(p.shape) for p in par.parameters()}

    def run(t):
        return (par if isinstance(t, DTensor) else ref)(t)

    check_fn(run, x, dmesh, placements, label, failures, tol, shapes, **check)
    for (name, p), pr in zip(par.named_parameters(), ref.parameters(), strict=True):
        check_close(f"{label} {name}.grad", p.grad, pr.grad, tol, failures)


def check_model_audited(
    model,
    x: torch.Tensor,
    gy,
    dmesh,
    placements,
    *,
    gather_numel: int | None = None,
    param_shapes=frozenset(),
    grad_floor: float = 0.0,
    buffers: bool = False,
    traffic: str | None = "ring",
    seed: int | None = None,
    same_placements: bool = False,
    label: str = "",
    tol: float = 1e-12,
) -> list[str]:
    """A ``parallelize``d copy of ``model`` against ``model`` on one device, backward of
    ``gy`` (a tensor, or a function of the output shape that returns one): output, every
    parameter gradient (relative to ``grad_floor`` times the largest one when given:
    mathematically zero gradients are rounding noise), buffers with ``buffers``; no
    collective over ``gather_numel`` elements (default: a quarter of the rank's strip of one
    sample; parameter-shaped ones and ``param_shapes`` aside) and, unless ``traffic`` is
    None, point-to-point messages recorded (``traffic`` names them: ring, re-chunk).
    ``seed``: drawn before each forward (stochastic depth and drop-connect draw the same
    masks); ``same_placements``: the output keeps the input's placements. Failures start
    with ``label``; returns them."""
    par = parallelize(copy.deepcopy(model), dmesh)
    if seed is not None:
        torch.manual_seed(seed)
    ref = model(x)
    gy = gy(ref.shape) if callable(gy) else gy
    ref.backward(gy)
    xs, gys = (distribute_tensor(t, dmesh, placements) for t in (x, gy))
    with CommAudit() as audit:
        if seed is not None:
            torch.manual_seed(seed)
        y = par(xs)
        y.backward(gys)
    failures: list[str] = []
    if same_placements and tuple(y.placements) != tuple(placements):
        failures.append(f"{label}output placements {y.placements}")
    check_close(f"{label}output", y, ref, tol, failures)
    grads = {n: p.grad for n, p in model.named_parameters()}
    floor = grad_floor * max(float(g.abs().max()) for g in grads.values() if g is not None)
    got = dict(par.named_parameters())
    for name, g in grads.items():
        if g is not None or not grad_floor:
            check_close(f"{label}grad {name}", got[name].grad, g, tol, failures, floor)
    if buffers:
        for (name, b), br in zip(par.named_buffers(), model.buffers(), strict=True):
            check_close(f"{label}buffer {name}", b, br, tol, failures)
    shapes = {tuple(p.shape) for p in model.parameters()} | set(param_shapes)
    if gather_numel is None:
        gather_numel = xs.to_local()[0].numel() // 4
    moved = audit.activation_sized(max(1, gather_numel), shapes)
    failures += [f"{label}gathered activation: {r.op} {r.shape}" for r in moved]
    if traffic and audit.summary().get("p2p", {}).get("count", 0) == 0:
        failures.append(f"{label}no point-to-point ({traffic}) traffic recorded")
    return failures


def check_strip_model(model, x: torch.Tensor, gy, dmesh, world: int, **check) -> list[str]:
    """``check_model_audited`` on W strips with the defaults of the library-model tests:
    no collective over an eighth of a rank's strip, mathematically zero gradients (a bias
    before a norm) compared against 1e-4 of the largest (``grad_floor``), the same seed
    before each forward (stochastic depth, drop-connect); ``check`` overrides them."""
    opts = {
        "gather_numel": x[..., : x.shape[-1] // world].numel() // 8,
        "grad_floor": 1e-4,
        "seed": 7,
        **check,
    }
    return check_model_audited(model, x, gy, dmesh, [Shard(3)], **opts)
