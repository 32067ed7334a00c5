"""The verify report: pass/fail verdict, rich tables and the ``--json`` file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ._compare import KINDS, Check

__all__ = ["VerifyReport"]

_LABELS = {
    "input": "input",
    "loss": "loss",
    "logits": "logits",
    "grad": "grads",
    "param": "params",
    "buffer": "buffers",
}
_MAX_FAILURES_SHOWN = 15


def _tol(x: float) -> str:
    return f"{x:.0e}" if x else "0"


def _fmt(x: float) -> str:
    if isinstance(x, str):
        return x
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


@dataclass
class VerifyReport:
    """Everything ``run_verify`` found; identical on every rank.

    ``checks`` holds one entry per compared tensor and step; ``comms`` one entry per step
    (collectives counted on each rank, ``max_per_rank`` summarises them); ``flagged`` lists
    activation-sized collectives (each one fails the verification); ``memory`` holds each
    rank's peak memory of both runs.
    """

    checks: list[Check]
    steps: int
    world_size: int
    dp: int
    sp: int
    model: str
    precision: str
    batch_shape: tuple[int, ...]
    reference: str
    tolerances: dict[str, tuple[float, float]]
    notes: list[str] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    comms: list[dict] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)
    grid: str = ""
    """The spatial layout for messages (``" (2x2 tiles)"``; empty for strips)."""

    @property
    def failed_checks(self) -> list[Check]:
        """Checks out of tolerance, worst first."""
        return sorted((c for c in self.checks if not c.passed), key=lambda c: -c.badness)

    @property
    def passed(self) -> bool:
        """Every tensor within tolerance and no activation-sized collective."""
        return bool(self.checks) and not self.failed_checks and not self.flagged

    def verdict(self) -> str:
        """The one-line verdict."""
        where = f"{self.model}, {self.world_size} rank(s) (dp={self.dp} x sp={self.sp}{self.grid})"
        if self.passed:
            return (
                f"PASS: sharded training equals one device within tolerance: {len(self.checks)} "
                f"tensors over {self.steps} step(s), {where}, {self.precision}"
            )
        parts = []
        if self.failed_checks:
            worst = self.failed_checks[0]
            parts.append(
                f"{len(self.failed_checks)} of {len(self.checks)} tensors out of tolerance "
                f"(worst: step {worst.step} {worst.kind} {worst.name}, rel err "
                f"{_fmt(worst.rel_err)} > rtol {worst.rtol:g})"
            )
        if self.flagged:
            parts.append(f"{len(self.flagged)} activation-sized collective(s)")
        if not self.checks:
            parts.append("nothing was compared")
        return f"FAIL: {'; '.join(parts)}; {where}, {self.precision}"

    def to_dict(self) -> dict:
        """The report as JSON-friendly data."""
        return {
            "passed": self.passed,
            "verdict": self.verdict(),
            "model": self.model,
            "steps": self.steps,
            "world_size": self.world_size,
            "mesh": {"dp": self.dp, "sp": self.sp},
            "grid": self.grid.strip(" ()"),
            "precision": self.precision,
            "batch_shape": list(self.batch_shape),
            "reference": self.reference,
            "tolerances": {k: {"rtol": r, "atol": a} for k, (r, a) in self.tolerances.items()},
            "notes": list(self.notes),
            "memory": self.memory,
            "comms": self.comms,
            "activation_sized_collectives": list(self.flagged),
            "failures": [c.to_dict() for c in self.failed_checks],
            "checks": [c.to_dict() for c in self.checks],
        }

    def write_json(self, path: str | Path) -> None:
        """Write ``to_dict()`` to ``path`` (atomically: temporary file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    # -- printing --------------------------------------------------------------------------
    def _rows(self) -> list[tuple[int, str, Check, int]]:
        """(step, kind, worst check, number of tensors) per step and kind."""
        rows = []
        for step in sorted({c.step for c in self.checks}):
            for kind in KINDS:
                group = [c for c in self.checks if c.step == step and c.kind == kind]
                if group:
                    rows.append((step, kind, max(group, key=lambda c: c.badness), len(group)))
        return rows

    def render(self, console: Console) -> None:
        """Print the comparison, memory and communication tables and the verdict."""
        table = Table(title="spconv-train verify: sharded vs one device", title_justify="left")
        for col, kw in (
            ("step", {"justify": "right"}),
            ("tensor", {}),
            ("max abs err", {"justify": "right"}),
            ("max rel err", {"justify": "right"}),
            ("tol", {"justify": "right"}),
            ("result", {}),
            ("worst tensor", {"overflow": "fold"}),
        ):
            table.add_column(col, **kw)
        for step, kind, worst, count in self._rows():
            tol = _tol(worst.rtol) + (f" / atol {_tol(worst.atol)}" if worst.atol else "")
            table.add_row(
                str(step),
                _LABELS[kind] + (f" ({count})" if count > 1 else ""),
                _fmt(worst.abs_err),
                _fmt(worst.rel_err),
                tol,
                "[green]pass[/]" if worst.passed else "[bold red]FAIL[/]",
                worst.name if count > 1 else "",
            )
        console.print(table)
        failed = self.failed_checks
        if failed:
            console.print(f"[bold red]Out of tolerance[/] ({len(failed)}, worst first):")
            for c in failed[:_MAX_FAILURES_SHOWN]:
                note = f" [{c.note}]" if c.note else ""
                spread = f", one-device noise {_fmt(c.spread)}" if c.spread else ""
                console.print(
                    f"  step {c.step} {c.kind} {c.name}: abs {_fmt(c.abs_err)}, rel "
                    f"{_fmt(c.rel_err)} (rtol {c.rtol:g}){spread}{note}",
                    highlight=False,
                )
            if len(failed) > _MAX_FAILURES_SHOWN:
                console.print(f"  ... and {len(failed) - _MAX_FAILURES_SHOWN} more (see --json)")
        self._render_memory(console)
        self._render_comms(console)
        for note in self.notes:
            console.print(f"[dim]note: {note}[/]", highlight=False)
        style = "bold green" if self.passed else "bold red"
        console.print(f"[{style}]{self.verdict()}[/]", highlight=False)

    def _render_memory(self, console: Console) -> None:
        if not self.memory:
            return
        table = Table(title=f"Peak memory per rank ({self.memory[0]['measure']})")
        for col in ("rank", "sharded run (MiB)", "reference run (MiB)"):
            table.add_column(col, justify="right")
        for m in self.memory:
            ref = "-" if m["reference_mb"] is None else f"{m['reference_mb']:.1f}"
            table.add_row(str(m["rank"]), f"{m['sharded_mb']:.1f}", ref)
        console.print(table)

    def _render_comms(self, console: Console) -> None:
        if not self.comms:
            return
        table = Table(title="Collectives per step (max over ranks: count / elements)")
        cols = ("step", "halo p2p", "reductions", "gathers", "FSDP parameters", "halo time (s)")
        for col in cols:
            table.add_column(col, justify="right")
        for c in self.comms:
            m = c["max_per_rank"]

            def cell(kind: str, m: dict = m) -> str:
                v = m.get(kind, {"count": 0, "elements": 0})
                return f"{v['count']} / {v['elements']:,}"

            table.add_row(
                str(c["step"]),
                cell("p2p"),
                cell("reduce"),
                cell("gather"),
                cell("param"),
                f"{c['halo_s']:.3f}",
            )
        console.print(table)
        for line in self.flagged:
            console.print(f"[bold red]activation-sized collective:[/] {line}", highlight=False)
