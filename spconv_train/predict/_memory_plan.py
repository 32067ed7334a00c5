"""How big a piece of a slide each rank computes at once: the memory plan of ``predict``.

A rank's peak memory during band-streamed prediction is its fixed part (the process, the
model's weights: ``base_bytes``) plus a cost per pixel of the piece it runs through the
network at once (``bytes_per_pixel``: activations, the input read and the logits; measured
by ``_memory_probe``). The plan picks the largest pieces that keep this under the per-rank
budget (``--memory-gb``), because every piece also computes ``margin`` context rows (and
columns) on each side that it throws away (``_receptive``): the recompute factor, computed
pixels / kept pixels, falls as the pieces grow.

Two layouts (every piece is split over the ranks of one image as strips or H x W tiles,
``parallel.sp``):

* ``bands``: full-width row bands. Each band pays its context rows over the whole width,
  so on a wide slide a band that fits the budget may keep few rows (or none).
* ``tiles``: the slide is cut into tiles of ``tile_rows x tile_cols`` kept pixels first,
  each read with context on all four sides, and a tile's pieces go to the ranks. The
  context of a tile grows with its perimeter, not with the slide's width, so within the
  same memory a tile keeps more of what it computes on a wide slide (and on a tall one it
  is a band again: ``tile_cols`` = the width).

``choose_plan`` tries every tile width on the stride grid (the full width being the
bands layout) and keeps the lowest recompute factor that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._bands import band_layout

__all__ = ["RECOMPUTE_WARN", "MemoryPlan", "choose_plan", "recompute"]

#: Above this recompute factor the plan prints a warning with what lowers it.
RECOMPUTE_WARN = 2.0
GB = 1e9


@dataclass(frozen=True)
class _Geometry:
    stride: int
    margin: int


def recompute(n: int, kept: int, stride: int, margin: int) -> tuple[float, int]:
    """(computed / kept pixels along one axis of ``n`` pixels cut into pieces of ``kept``
    pixels (0 or >= n: one piece) with ``margin`` context on each side, the largest piece
    read)."""
    if kept <= 0 or kept >= n:
        return 1.0, n
    pieces = band_layout(n, kept, _Geometry(stride, margin))
    reads = [p.read[1] - p.read[0] for p in pieces]
    return sum(reads) / n, max(reads)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan for one ``height x width`` image on a ``grid`` (tile rows, tile columns) of
    ranks: ``tile_rows x tile_cols`` kept pixels per piece (``tile_cols == width``: full-width
    bands; both equal to the image: the whole image at once), ``margin`` context pixels on
    each side (a multiple of ``stride``), and the memory model it was chosen with."""

    height: int
    width: int
    grid: tuple[int, int]
    stride: int
    margin: int
    tile_rows: int
    tile_cols: int
    bytes_per_pixel: float
    base_bytes: int
    budget_bytes: int
    extra_bytes_per_pixel: float = 1.0  # the first rank's full-width output rows (1 B/px)

    @property
    def whole(self) -> bool:
        """One piece: the whole image."""
        return self.tile_rows >= self.height and self.tile_cols >= self.width

    @property
    def layout(self) -> str:
        """``"whole"``, ``"bands"`` (full-width row bands) or ``"tiles"``."""
        if self.whole:
            return "whole"
        return "bands" if self.tile_cols >= self.width else "tiles"

    @property
    def band_rows(self) -> int:
        """Kept rows per band (0: the whole height in one band)."""
        return 0 if self.tile_rows >= self.height else self.tile_rows

    @property
    def block_cols(self) -> int:
        """Kept columns per tile (0: full-width bands)."""
        return 0 if self.tile_cols >= self.width else self.tile_cols

    def _axis(self, n: int, kept: int) -> tuple[float, int]:
        return recompute(n, kept, self.stride, self.margin)

    @property
    def recompute_factor(self) -> float:
        """Computed pixels / kept pixels over the whole image."""
        return (
            self._axis(self.height, self.band_rows)[0] * self._axis(self.width, self.block_cols)[0]
        )

    @property
    def read_shape(self) -> tuple[int, int]:
        """The largest piece computed at once (rows, columns), context included."""
        return self._axis(self.height, self.band_rows)[1], self._axis(self.width, self.block_cols)[
            1
        ]

    @property
    def pixels_per_rank(self) -> int:
        """Pixels of the largest piece one rank computes at once."""
        (r, c), (p, q) = self.read_shape, self.grid
        return -(-r // p) * -(-c // q)

    @property
    def estimated_bytes(self) -> int:
        """Estimated peak memory of one rank (the first rank's output rows included)."""
        out_rows = self.width * min(self.tile_rows, self.height) * self.extra_bytes_per_pixel
        return int(self.base_bytes + self.bytes_per_pixel * self.pixels_per_rank + out_rows)

    @property
    def fits(self) -> bool:
        """Whether the estimate is within the budget."""
        return self.estimated_bytes <= self.budget_bytes

    def describe(self) -> str:
        """One line: layout, piece and context sizes, recompute factor, memory per rank."""
        (r, c), (p, q) = self.read_shape, self.grid
        ranks = f"{p}x{q} tiles" if p > 1 else f"{q} strip(s)"
        if self.layout == "whole":
            what = "whole image"
        elif self.layout == "bands":
            what = f"bands of {self.tile_rows} rows + {self.margin} context rows each side"
        else:
            what = (
                f"tiles of {self.tile_rows} x {self.tile_cols} px + {self.margin} context "
                "px each side"
            )
        return (
            f"plan {self.height}x{self.width}: {what} (pieces up to {r} x {c} px over {ranks}); "
            f"recompute factor {self.recompute_factor:.2f} (computed / kept pixels); "
            f"{self.pixels_per_rank / 1e6:.2f} Mpx and ~{self.estimated_bytes / GB:.2f} GB "
            f"per rank of a {self.budget_bytes / GB:.2f} GB budget "
            f"({self.bytes_per_pixel:.0f} B/px over {self.base_bytes / GB:.2f} GB fixed)"
        )

    def warnings(self) -> list[str]:
        """What is wrong with the plan (over budget, much recomputation) and what helps."""
        out = []
        if not self.fits:
            out.append(
                f"these pieces need ~{self.estimated_bytes / GB:.2f} GB per rank, over the "
                f"{self.budget_bytes / GB:.2f} GB budget: the ranks may be killed for memory; "
                "use more ranks (--nproc), more memory (--memory-gb) or, recomputing more, "
                "a smaller --band-rows"
            )
        if self.recompute_factor > RECOMPUTE_WARN:
            out.append(
                f"recompute factor {self.recompute_factor:.2f}: each piece computes its "
                f"{self.margin} context px per side again; more ranks (--nproc), more memory "
                "(--memory-gb) or tiles (--slide-tiles) make the pieces bigger and lower it"
            )
        return out


def choose_plan(
    height: int,
    width: int,
    grid: tuple[int, int],
    stride: int,
    margin: int,
    bytes_per_pixel: float,
    base_bytes: int,
    budget_bytes: int,
    *,
    band_rows: int | None = None,
    tiles: bool | None = None,
    extra_bytes_per_pixel: float = 1.0,
) -> MemoryPlan:
    """The plan for a ``height x width`` image (see the module docstring).

    ``band_rows`` (``--band-rows``): full-width bands of that many rows (0: the whole
    image), no choice made. ``tiles``: None picks the layout with the lower recompute
    factor, False allows only full-width bands, True only tiles narrower than the image.
    Without a plan that fits, pieces keeping twice their context (``fits`` False).
    """

    def plan(rows: int, cols: int) -> MemoryPlan:
        return MemoryPlan(
            height, width, grid, stride, margin, rows, cols,
            bytes_per_pixel, base_bytes, budget_bytes, extra_bytes_per_pixel,
        )  # fmt: skip

    if band_rows is not None:
        return plan(band_rows if 0 < band_rows < height else height, width)
    whole = plan(height, width)
    if whole.fits and not tiles:
        return whole
    p, q = grid
    free = max(0.0, budget_bytes - base_bytes)
    up = -(-width // stride) * stride
    widths = [width] if tiles is False else list(range(stride, up, stride))
    if tiles is None:
        widths.append(width)
    best = None
    for cols in widths:
        read_cols = min(width, cols + 2 * margin)
        per_row = -(-read_cols // q)
        # bytes per read row of a rank's piece; the first rank also holds the kept rows
        # over the full width (``extra_bytes_per_pixel``)
        row_bytes = per_row * bytes_per_pixel + width * extra_bytes_per_pixel / p
        read_rows = p * int(free // row_bytes)
        rows = read_rows - 2 * margin if read_rows < height else height
        rows -= rows % stride if rows < height else 0
        if rows < stride:
            continue
        candidate = plan(rows, cols)
        key = (round(candidate.recompute_factor, 6), -cols)  # ties: the wider piece
        if best is None or key < best[0]:
            best = (key, candidate)
    if best is not None:
        return best[1]
    # Nothing fits: pieces that keep twice their context (so that at most about half of
    # what they compute is context; smaller ones would multiply the work for little
    # memory), the layout with less memory.
    floor = -(-max(2 * margin, stride) // stride) * stride
    options = [plan(floor, width)] if tiles is not True else []
    options += [plan(floor, min(floor, width))] if tiles is not False else []
    return min(options, key=lambda candidate: candidate.estimated_bytes)
