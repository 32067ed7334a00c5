"""The ``data.augment`` list: parsing and checking the declared augmentations.

Each item is a mapping with a ``name`` and that transform's keys, e.g.::

    augment:
      - {name: rot90, p: 0.5}
      - {name: affine, p: 0.5, degrees: 15, translate: [0.05, 0.05], scale: [0.9, 1.1]}
      - {name: gamma, p: 0.3, gamma: [0.7, 1.5]}

Errors name the item and key (``data.augment[1].degrees``) and say what was expected. The
transforms themselves are in ``augment_v2``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GEOMETRIC", "INTENSITY", "AugmentSpec", "AugmentSpecError", "parse_augment"]

GEOMETRIC = ("rot90", "transpose", "affine", "elastic")
"""Transforms that move pixels (applied first, in list order, as one resampling)."""
INTENSITY = ("brightness", "contrast", "gamma", "noise")
"""Point-wise transforms of the image values (applied after the geometric ones)."""

# name -> {key: (default, kind)}; kind: "prob", "range" (a number n means [-n, n] or a
# [lo, hi] pair), "factor" (a number n means [1 - n, 1 + n] or a [lo, hi] pair), "pair"
# (two non-negative numbers), "positive", "ks" (a list of rot90 turns).
_KEYS: dict[str, dict[str, tuple[Any, str]]] = {
    "rot90": {"p": (0.5, "prob"), "k": ([1, 2, 3], "ks")},
    "transpose": {"p": (0.5, "prob")},
    "affine": {
        "p": (0.5, "prob"),
        "degrees": (0.0, "range"),
        "translate": ([0.0, 0.0], "pair"),
        "scale": ([1.0, 1.0], "factor"),
        "shear": (0.0, "range"),
    },
    "elastic": {"p": (0.5, "prob"), "alpha": (8.0, "positive"), "sigma": (16.0, "positive")},
    "brightness": {"p": (0.5, "prob"), "factor": (0.1, "factor")},
    "contrast": {"p": (0.5, "prob"), "factor": (0.1, "factor")},
    "gamma": {"p": (0.5, "prob"), "gamma": ([0.7, 1.5], "factor")},
    "noise": {"p": (0.5, "prob"), "sigma": ([0.0, 0.01], "sigma")},
}


class AugmentSpecError(ValueError):
    """A bad ``data.augment`` item; ``key`` is the dotted key to fix."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class AugmentSpec:
    """One declared transform: its ``name``, probability ``p`` and checked ``args``.

    ``args`` holds ranges as ``(lo, hi)`` tuples (``degrees``, ``shear``, ``scale``,
    ``factor``, ``gamma``, ``sigma``), ``translate`` as ``(fx, fy)`` fractions of the width
    and height (torchvision's ``RandomAffine`` order), ``k`` as a tuple of quarter turns,
    and elastic's ``alpha`` / ``sigma`` as numbers of pixels.
    """

    name: str
    p: float
    args: tuple[tuple[str, Any], ...]

    def arg(self, key: str) -> Any:
        """The checked value of ``key``."""
        return dict(self.args)[key]

    @property
    def geometric(self) -> bool:
        """Whether the transform moves pixels."""
        return self.name in GEOMETRIC


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pair(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_number, value))


def _check(name: str, key: str, value: Any, kind: str, where: str) -> Any:
    """The typed value of ``key``, or ``AugmentSpecError`` naming ``where``."""

    def fail(expected: str) -> AugmentSpecError:
        return AugmentSpecError(where, f"{name}: expected {expected}, got {value!r}")

    if kind == "prob":
        if not _number(value) or not 0 <= value <= 1:
            raise fail("a probability in [0, 1]")
        return float(value)
    if kind == "positive":
        if not _number(value) or value <= 0:
            raise fail("a positive number")
        return float(value)
    if kind == "ks":
        ok = isinstance(value, (list, tuple)) and value and all(v in (0, 1, 2, 3) for v in value)
        if not ok or any(isinstance(v, bool) for v in value):
            raise fail("a non-empty list of quarter turns among 0, 1, 2, 3")
        return tuple(int(v) for v in value)
    if kind == "pair":
        if not _pair(value) or not all(0 <= v <= 1 for v in value):
            raise fail("[fx, fy]: two fractions in [0, 1] of the width and height")
        return (float(value[0]), float(value[1]))
    if kind == "range":  # degrees: n -> [-n, n]
        if _number(value):
            if value < 0:
                raise fail("a non-negative number n (meaning [-n, n]) or a [min, max] pair")
            return (-float(value), float(value))
        if not _pair(value) or value[0] > value[1]:
            raise fail("a number n (meaning [-n, n]) or a [min, max] pair with min <= max")
        if key == "shear" and max(abs(v) for v in value) >= 90:
            raise fail("shear angles strictly between -90 and 90 degrees")
        return (float(value[0]), float(value[1]))
    # factor / sigma: n -> [1 - n, 1 + n] (factor) or [0, n] (sigma), or a [lo, hi] pair
    if _number(value):
        lo, hi = (1.0 - value, 1.0 + value) if kind == "factor" else (0.0, float(value))
    elif _pair(value):
        lo, hi = float(value[0]), float(value[1])
    else:
        raise fail("a number or a [min, max] pair")
    floor_ok = lo > 0 if kind == "factor" else lo >= 0
    if not (floor_ok and lo <= hi):
        low = "min > 0" if kind == "factor" else "min >= 0"
        raise fail(
            f"a [min, max] range with {low} and min <= max (a number n means "
            + ("[1 - n, 1 + n], so n < 1)" if kind == "factor" else "[0, n])")
        )
    return (lo, hi)


def parse_augment(items: list[Any] | None, key: str = "data.augment") -> list[AugmentSpec]:
    """Check the ``data.augment`` list and return one ``AugmentSpec`` per item.

    Raises:
        AugmentSpecError: naming ``key[i]`` or ``key[i].<field>`` and what was expected.
    """
    specs: list[AugmentSpec] = []
    for i, item in enumerate(items or []):
        where = f"{key}[{i}]"
        if not isinstance(item, Mapping):
            raise AugmentSpecError(where, f"expected a mapping with a 'name', got {item!r}")
        name = item.get("name")
        if name not in _KEYS:
            choices = ", ".join(_KEYS)
            raise AugmentSpecError(f"{where}.name", f"expected one of {choices}, got {name!r}")
        table = _KEYS[name]
        unknown = sorted(str(k) for k in item if k != "name" and k not in table)
        if unknown:
            valid = ", ".join(["name", *table])
            raise AugmentSpecError(
                f"{where}.{unknown[0]}", f"unknown key for {name}; valid keys: {valid}"
            )
        args = []
        for field_name, (default, kind) in table.items():
            value = item.get(field_name, default)
            args.append(
                (field_name, _check(name, field_name, value, kind, f"{where}.{field_name}"))
            )
        checked = dict(args)
        specs.append(AugmentSpec(name, checked.pop("p"), tuple(checked.items())))
    return specs
