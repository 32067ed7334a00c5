"""``ParallelDims``: the one owner of the mesh dim names and what each shards."""

from __future__ import annotations

import pytest

from spconv_train.config._mesh import MESH_DIMS
from spconv_train.parallel import ParallelDims


class _Mesh:
    """What ``ParallelDims`` reads of a DeviceMesh: names and sizes."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
        self.mesh_dim_names, self._shape, self.ndim = names, shape, len(shape)

    def size(self, i: int) -> int:
        return self._shape[i]


def test_strips_tiles_and_blocks():
    strips = ParallelDims.of(2, 3)
    assert (strips.names, strips.shape) == (("dp", "sp"), (2, 3))
    tiles = ParallelDims.of(1, 6, (2, 3))
    assert (tiles.names, tiles.shape) == (("dp", "sp_h", "sp_w"), (1, 2, 3))
    blocks = ParallelDims.of(1, 4, {"sp_d": 2, "sp_w": 2})
    assert blocks.names == ("dp", "sp_d", "sp_w")
    for dims in (strips, tiles, blocks):
        assert ParallelDims.spatial_names_of(_Mesh(dims.names, dims.shape)) == dims.names[1:]
    assert ParallelDims.spatial_mesh_dim(_Mesh(("dp", "sp_h", "sp_w"), (1, 2, 2))) == 2
    assert ParallelDims.spatial_mesh_dim(_Mesh(("a", "b"), (2, 2))) is None


def test_bad_grids_are_refused():
    with pytest.raises(ValueError, match="does not hold sp=5"):
        ParallelDims.of(1, 5, (2, 3))
    for grid in ((("sp_w", 2), ("sp_h", 2)), (("sp_h", 2), ("sp_h", 2)), (("x", 4),)):
        with pytest.raises(ValueError, match="names must be among"):
            ParallelDims(1, 4, grid)


def test_config_spells_the_same_names():
    assert dict(ParallelDims.AXIS) == MESH_DIMS
    assert ParallelDims.GRID == ("sp_d", "sp_h", "sp_w")
