"""The one stitcher of grid pieces (``spconv_train.data.stitch_grid``), used by predict
(numpy) and the training panels (torch)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from spconv_train.data import stitch_grid, strip_bounds
from spconv_train.train.panels import _stitch


def _cut(arr, counts, axes):
    """The pieces of ``arr`` over a grid of ``counts`` (``strip_bounds`` splits: uneven, the
    last pieces possibly empty) along ``axes``, listed row-major."""
    pieces = []
    for cell in itertools.product(*(range(n) for n in counts)):
        index = [slice(None)] * arr.ndim
        for axis, n, k in zip(axes, counts, cell, strict=True):
            a, b = strip_bounds(arr.shape[axis], n, k)
            index[axis] = slice(a, b)
        pieces.append(arr[tuple(index)])
    return pieces


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("shape", "counts", "axes"),
    [
        ((3, 10), (4,), (1,)),  # 1-D grid of uneven strips (3, 3, 3, 1 columns)
        ((2, 7, 11), (3,), (-1,)),  # negative axis
        ((2, 7, 11), (2, 3), (1, 2)),  # 2-D grid of tiles, uneven rows and columns
        ((9, 11), (4, 5), (0, 1)),  # an empty last row of tiles (ceil split)
        ((2, 5, 7, 6), (2, 3, 4), (1, 2, 3)),  # 3-D grid of blocks
        ((5, 7, 6), (3, 1, 2), (0, 1, 2)),  # a grid dim of one piece
    ],
)
def test_stitch_grid_reassembles_the_cut_array(kind, shape, counts, axes):
    rng = np.random.default_rng(len(shape) * 10 + len(counts))
    arr = rng.standard_normal(shape)
    if kind == "torch":
        arr = torch.from_numpy(arr)
    pieces = _cut(arr, counts, axes)
    out = stitch_grid(pieces, counts, axes)
    assert type(out) is type(arr)
    assert tuple(out.shape) == shape
    assert (np.asarray(out) == np.asarray(arr)).all()
    # the test can fail: two pieces swapped do not stitch back to the array
    swapped = [pieces[1], pieces[0], *pieces[2:]]
    try:
        wrong = np.asarray(stitch_grid(swapped, counts, axes))
    except (ValueError, RuntimeError):  # the pieces no longer fit
        return
    assert wrong.shape != shape or not (wrong == np.asarray(arr)).all()


def test_stitch_grid_checks_the_grid():
    parts = [np.zeros((2, 2))] * 6
    with pytest.raises(ValueError, match="needs 4 parts"):
        stitch_grid(parts, (2, 2), (0, 1))
    with pytest.raises(ValueError, match="one axis per grid dim"):
        stitch_grid(parts, (2, 3), (0,))


def test_panel_tiles_stitch_by_first_row_and_column():
    """Panel pieces arrive in any order, tiles keyed by their first (row, column)."""
    torch.manual_seed(0)
    img = torch.randn(3, 9, 10)
    tiles = []
    for r, c in itertools.product(range(2), range(3)):
        (r0, r1), (c0, c1) = strip_bounds(9, 2, r), strip_bounds(10, 3, c)
        tile = img[:, r0:r1, c0:c1]
        tiles.append(((r0, c0), None, [tile, tile[0], tile[1]]))
    shuffled = [tiles[k] for k in (4, 0, 5, 2, 1, 3)]
    assert torch.equal(_stitch(shuffled, 0), img)
    assert torch.equal(_stitch(shuffled, 2), img[1])
    strips = [(k, -1, [img[..., a:b]]) for k in (2, 0, 1) for a, b in [strip_bounds(10, 3, k)]]
    assert torch.equal(_stitch(strips, 0), img)
