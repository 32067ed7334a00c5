"""Error measures and tolerances for the sharded-versus-one-device comparison.

For every compared tensor (reference ``b``, sharded ``a``):

* ``abs_err = max |a - b|`` (in float64) over every element on every rank;
* ``rel_err = abs_err / max(max |b|, floor)``, where ``floor = FLOOR[precision] * (the
  largest reference magnitude of that kind in the model)`` (``PARAM_FLOOR`` for
  parameters after the optimizer step): e.g. for gradients the largest gradient
  entry over all parameters. Some gradients are mathematically zero (a BatchNorm bias
  whose output only feeds another BatchNorm) and hold pure rounding noise on both sides;
  measuring them against their own noise would report a meaningless relative error of ~1.
* a tensor passes when ``abs_err <= atol`` or ``rel_err <= rtol`` (NaN never passes);
* in the training precision (``verify --dtype config``) it also passes when
  ``rel_err <= SPREAD_FACTOR * noise``: ``noise`` is how far the one-device run ``r``
  itself is from the same step recomputed in float64 (``max |r - r64| / scale``), worst
  over the tensors of the same kind at the same step: the rounding noise of one device in
  that precision (``Check.spread`` holds ``noise * scale``; for parameters after the
  optimizer step at least the largest absolute spread of any parameter, since AdamW moves
  a parameter by ~lr when rounding flips the sign of a near-zero gradient, whatever the
  parameter's size). Sharding only reorders sums,
  so a correct sharded run is about as far from ``r64`` as ``r`` is, and ``|a - r| <=
  |a - r64| + |r64 - r|`` stays within a small multiple of the noise; a real bug (a wrong
  halo column) is orders of magnitude above it. A fixed fp32 ``rtol`` cannot tell the two
  apart on deep BatchNorm nets, where AdamW's first step turns rounding noise in
  near-zero gradients into updates of ``lr`` (relative errors of 1e-2 on a correct run).

Each rank measures its own part (its logits strip, its copy of every gradient) and one
all-reduce (MAX) per step combines them, so a rank whose copy of a gradient differs from the
others' (a missing all-reduce) fails too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_TOLERANCES",
    "FLOOR",
    "KINDS",
    "PARAM_FLOOR",
    "SPREAD_FACTOR",
    "Check",
    "Collector",
    "floors",
    "max_abs_diff",
    "resolve_tolerances",
]

#: Relative floor (times the largest magnitude of a kind) below which a reference value is
#: treated as rounding noise, per compute precision. bf16 keeps 8 mantissa bits: values
#: below ~1 % of the largest of their kind are mostly noise there.
FLOOR = {"fp64": 1e-6, "fp32": 1e-6, "bf16": 1e-2}
#: Parameters after an optimizer step get a larger floor: AdamW divides by sqrt(v) + eps,
#: which turns a gradient of pure rounding noise (mathematically zero) into an update of up
#: to lr * noise / eps (~1e5 times the noise), and makes every small parameter (a BatchNorm
#: bias starting at 0) move by ~lr per step whatever its gradient's size, so its relative
#: rounding error grows step by step. Gradient bugs are caught on the gradients (floor
#: 1e-6) before they reach the parameters.
PARAM_FLOOR = 1e-2


def floors(precision: str) -> dict[str, float]:
    """``{kind: floor factor}`` for ``precision``."""
    base = FLOOR.get(precision, FLOOR["fp32"])
    return {kind: max(base, PARAM_FLOOR) if kind == "param" else base for kind in KINDS}


#: Compared kinds, in table order.
KINDS = ("input", "loss", "logits", "grad", "param", "buffer")

#: Default (rtol, atol) per compute precision. Sharding reorders sums (strip-wise partial
#: sums, reduced statistics), so the two runs differ by rounding. fp64 (the default of
#: ``verify``): ~1e-13 relative on plain nets, up to ~1e-9 where AdamW's first steps or deep
#: ResNet/MobileNet stacks amplify it (measured on every registry model at 2 and 3 ranks);
#: a real bug (a wrong halo column, a statistic over the wrong count) shows 1e-4 .. 1,
#: so 1e-6 separates the two by orders of magnitude either way. fp32: ~1e-6 on small
#: nets, but rounding may flip a ReLU or max-pool decision at a value within ~1e-7 of a tie,
#: which changes that pixel's gradient outright: on real data, gradients then differ by
#: ~1e-3 .. 1e-2 at isolated tensors and the runs drift apart over steps (AdamW amplifies
#: the noise of near-zero gradients). Deep MobileNet-style nets with BatchNorm on tiny
#: images show ~1e-3 as well. Raise ``--rtol`` there, or check in fp64. bf16 autocast
#: rounds every activation to 8 mantissa bits: gradients summed over a strip or over the
#: whole image differ by a few percent, so a bf16 check only catches gross errors.
DEFAULT_TOLERANCES = {"fp64": (1e-6, 0.0), "fp32": (1e-4, 0.0), "bf16": (1e-1, 0.0)}


#: A sharded tensor in the training precision passes when its error is at most this many
#: times the one-device run's own rounding noise (``Check.spread``). Measured on correct
#: runs (the README's U-Net at 3 ranks, 5 steps, fp32): at most ~6x; a dropped halo
#: column: > 1e3x.
SPREAD_FACTOR = 10.0


def resolve_tolerances(
    precision: str, overrides: dict | None = None
) -> dict[str, tuple[float, float]]:
    """``{kind: (rtol, atol)}`` for ``precision`` (``fp32``/``bf16``), with ``overrides``:
    ``{"rtol": x, "atol": y}`` for every kind and/or ``{kind: {"rtol": x, "atol": y}}``
    for one kind (``None`` values are ignored)."""
    rtol, atol = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp32"])
    overrides = dict(overrides or {})
    unknown = set(overrides) - {"rtol", "atol", *KINDS}
    if unknown:
        raise ValueError(f"unknown tolerance keys {sorted(unknown)}; use rtol, atol or {KINDS}")
    if overrides.get("rtol") is not None:
        rtol = float(overrides["rtol"])
    if overrides.get("atol") is not None:
        atol = float(overrides["atol"])
    out = {}
    for kind in KINDS:
        own = overrides.get(kind) or {}
        r = own.get("rtol")
        a = own.get("atol")
        out[kind] = (rtol if r is None else float(r), atol if a is None else float(a))
    for kind, (r, a) in out.items():
        if not (r >= 0 and a >= 0):
            raise ValueError(f"tolerances must be >= 0, got rtol={r}, atol={a} for {kind}")
    return out


@dataclass
class Check:
    """One compared tensor at one step (``step`` is 1-based)."""

    step: int
    kind: str
    name: str
    abs_err: float
    ref_max: float
    scale: float
    rtol: float
    atol: float
    note: str = ""
    spread: float = 0.0  # one device's rounding noise (see the module docstring); 0: none

    @property
    def by_spread(self) -> float:
        """``abs_err / (SPREAD_FACTOR * spread)`` (inf when no spread was measured)."""
        if self.spread > 0 and math.isfinite(self.spread):
            return self.abs_err / (SPREAD_FACTOR * self.spread)
        return math.inf

    @property
    def rel_err(self) -> float:
        """``abs_err / scale`` (``scale = max(max |ref|, floor)``)."""
        if math.isnan(self.abs_err):
            return math.nan
        if self.scale > 0:
            return self.abs_err / self.scale
        return 0.0 if self.abs_err == 0 else math.inf

    @property
    def badness(self) -> float:
        """How far out of tolerance: <= 1 passes (the smaller of abs/atol and rel/rtol)."""
        if math.isnan(self.abs_err):
            return math.inf
        by_abs = (
            self.abs_err / self.atol if self.atol > 0 else (0.0 if self.abs_err == 0 else math.inf)
        )
        rel = self.rel_err
        by_rel = rel / self.rtol if self.rtol > 0 else (0.0 if rel == 0 else math.inf)
        return min(by_abs, by_rel, self.by_spread)

    @property
    def passed(self) -> bool:
        """Within tolerance: ``abs_err <= atol`` or ``rel_err <= rtol``."""
        return self.badness <= 1.0

    def to_dict(self) -> dict:
        """JSON-friendly (non-finite numbers as strings)."""
        return {
            "step": self.step,
            "kind": self.kind,
            "name": self.name,
            "max_abs_err": _num(self.abs_err),
            "max_rel_err": _num(self.rel_err),
            "ref_max_abs": _num(self.ref_max),
            "scale": _num(self.scale),
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
            **({"fp64_spread": _num(self.spread)} if self.spread else {}),
            **({"note": self.note} if self.note else {}),
        }


def max_abs_diff(a: Tensor | None, b: Tensor | None) -> float:
    """``max |a - b|`` in float64 (0 for missing or empty tensors, inf on a shape mismatch)."""
    if a is None or b is None or a.numel() == 0:
        return 0.0
    if a.shape != b.shape:
        return math.inf
    return (
        (a.detach().to(torch.float64) - b.detach().to(a.device, torch.float64)).abs().max().item()
    )


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


class Collector:
    """Gathers this rank's local error measures of one step; ``reduce`` combines all ranks.

    Every rank must ``add`` the same names in the same order (they compare the same model).
    """

    def __init__(
        self, step: int, tolerances: dict[str, tuple[float, float]], floor: dict[str, float]
    ) -> None:
        self.step, self.tolerances, self.floor = step, tolerances, floor
        self.items: list[tuple[str, str, float, float, str]] = []
        self.spreads: list[float] = []  # one per item: 0 where not measured on this rank

    def add(
        self,
        kind: str,
        name: str,
        got: Tensor | None,
        want: Tensor | None,
        spread: float = 0.0,
    ) -> None:
        """Measure ``got`` (sharded) against ``want`` (reference) on this rank. ``spread``:
        the reference's own distance from float64 (``max_abs_diff``), where measured."""
        self.spreads.append(spread)
        if got is None or want is None:
            note = "missing on the sharded side" if got is None else "missing in the reference"
            if got is None and want is None:
                note = ""
            self.items.append((kind, name, 0.0 if not note else math.inf, 0.0, note))
            return
        if tuple(got.shape) != tuple(want.shape):
            note = f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
            self.items.append((kind, name, math.inf, 0.0, note))
            return
        if want.numel() == 0:
            self.items.append((kind, name, 0.0, 0.0, ""))
            return
        b = want.detach().to(torch.float64)
        a = got.detach().to(device=b.device, dtype=torch.float64)
        err = (a - b).abs().max().item()
        ref = b.abs().max().item()
        self.items.append((kind, name, err, ref, ""))

    def reduce(self, device: torch.device) -> list[Check]:
        """Max over all ranks of every measure (collective); returns the step's checks."""
        n = len(self.items)
        vec = torch.tensor(
            [i[2] for i in self.items] + [i[3] for i in self.items] + self.spreads,
            dtype=torch.float64,
            device=device,
        )
        vec = torch.nan_to_num(vec, nan=math.inf)  # NaN never wins a MAX reduction
        if dist.is_initialized() and dist.get_world_size() > 1 and n:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        values = vec.tolist()
        largest: dict[str, float] = {}
        for (kind, *_), ref in zip(self.items, values[n : 2 * n], strict=True):
            if math.isfinite(ref):
                largest[kind] = max(largest.get(kind, 0.0), ref)
        checks = []
        scales = [
            max(ref, self.floor[kind] * largest.get(kind, 0.0))
            for (kind, *_), ref in zip(self.items, values[n : 2 * n], strict=True)
        ]
        # The one-device run's relative rounding noise, worst over the tensors of a kind:
        # per tensor it is heavy-tailed (a max-pool or ReLU tie flips in one run and not in
        # the other), per kind and step the sharded run's worst error stays within a few
        # times of it (measured: <= 6x on the README's U-Net example).
        # Parameters after an AdamW step: a near-zero gradient whose sign rounding flips
        # moves its parameter by ~lr whatever the tensor's size, so their noise is absolute
        # (the worst over all parameters), not relative to each tensor.
        noise: dict[str, float] = {}
        noise_abs: dict[str, float] = {}
        for (kind, *_), spread, scale in zip(self.items, values[2 * n :], scales, strict=True):
            if scale > 0 and math.isfinite(spread):
                noise[kind] = max(noise.get(kind, 0.0), spread / scale)
                noise_abs[kind] = max(noise_abs.get(kind, 0.0), spread)
        for (kind, name, _, _, note), err, ref, scale in zip(
            self.items, values[:n], values[n : 2 * n], scales, strict=True
        ):
            rtol, atol = self.tolerances[kind]
            spread = noise.get(kind, 0.0) * scale
            if kind == "param":
                spread = max(spread, noise_abs.get(kind, 0.0))
            checks.append(Check(self.step, kind, name, err, ref, scale, rtol, atol, note, spread))
        return checks
