"""``--geojson``: the predicted objects of every class (but class 0, the background) as a
GeoJSON FeatureCollection that QuPath opens (File > Import objects, or drag and drop).

Each connected region of a class is one feature: a ``Polygon`` (holes included) in the
full-resolution pixel coordinates of the input (x = column, y = row, along pixel edges),
``properties.objectType`` ``detection`` (QuPath draws many thousands of detections
quickly; annotations would each be editable shapes) and ``properties.classification``
``{"name", "color": [r, g, b]}``.

Polygons are built with shapely (GEOS), tile by tile: the pixel-edge boundary of a class's
region, as straight segments, is polygonized (holes included); regions that touch a tile's
cut are merged across it at the end (``unary_union``). The polygons therefore follow the
pixel edges exactly: their area is the class's pixel count. (Contour tracers, OpenCV's
``findContours`` or scikit-image's marching squares, trace pixel centres or iso-lines
that cut the corners, so their areas differ from the pixel counts; rasterio's
``features.shapes`` would be exact but brings GDAL.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ._errors import PredictError

__all__ = ["class_polygons", "write_geojson"]

#: Tile edge: the boundary segments of one tile are polygonized at once (polygonize slows
#: down more than linearly with the objects in one call).
TILE = 512


def _shapely():
    try:
        import shapely
    except ImportError:
        raise PredictError(
            "--geojson needs shapely: pip install 'spconv-train[slides]' (or pip install "
            "'shapely>=2')"
        ) from None
    return shapely


def _runs(edges: np.ndarray) -> np.ndarray:
    """``[n, 3]`` ``(line, first, end)`` of the runs of equal non-zero values along the
    rows of ``edges`` (+1 / -1: on which side the region lies). Splitting where the side
    changes keeps every junction of the boundary at a segment's end (at a checkerboard
    corner both lines change side), which is what ``polygonize`` needs."""
    pad = np.zeros((edges.shape[0], edges.shape[1] + 2), np.int8)
    pad[:, 1:-1] = edges
    found = []
    for side in (1, -1):
        step = np.diff((pad == side).astype(np.int8), axis=1)
        lines, first = np.nonzero(step == 1)  # row-major: the k-th start and end pair up
        _, end = np.nonzero(step == -1)
        found.append(np.stack([lines, first, end], axis=1))
    return np.concatenate(found)


def _regions(shapely, values: np.ndarray, c: int, row0: int, col0: int = 0) -> np.ndarray:
    """The polygons of the 4-connected regions of class ``c`` in ``values`` (its first
    pixel at row ``row0``, column ``col0``): the region's pixel-edge boundary, as merged
    straight segments, polygonized; of the faces, those whose interior lies on a pixel of
    class ``c`` (the others are holes). A face is a union of whole pixels, so any pixel
    touching an interior point of it lies in it."""
    inside = np.zeros((values.shape[0] + 2, values.shape[1] + 2), np.int8)
    inside[1:-1, 1:-1] = values == c
    across = _runs(np.diff(inside[:, 1:-1], axis=0))  # y = line, x from first to end
    down = _runs(np.diff(inside[1:-1, :], axis=1).T)  # x = line, y from first to end
    ends = np.concatenate(
        [
            np.stack([across[:, 1], across[:, 0], across[:, 2], across[:, 0]], axis=1),
            np.stack([down[:, 0], down[:, 1], down[:, 0], down[:, 2]], axis=1),
        ]
    ).astype(np.float64)
    ends[:, 0::2] += col0
    ends[:, 1::2] += row0
    faces = shapely.get_parts(shapely.polygonize(shapely.linestrings(ends.reshape(-1, 2, 2))))
    if not len(faces):
        return faces
    at = np.floor(shapely.get_coordinates(shapely.point_on_surface(faces))).astype(np.int64)
    return faces[values[at[:, 1] - row0, at[:, 0] - col0] == c]


def class_polygons(
    band: Callable[[int, int], np.ndarray],
    shape: tuple[int, int],
    classes: Sequence[int],
    rows: int = TILE,
    cols: int = TILE,
) -> dict[int, list]:
    """``{class: [shapely Polygon, ...]}`` of the connected regions of each of ``classes``
    in the ``shape = (H, W)`` mask whose rows ``band(r0, r1)`` gives (``[rows, W]``),
    polygonized in tiles of ``rows x cols``."""
    shapely = _shapely()
    h, w = shape
    done: dict[int, list] = {c: [] for c in classes}
    cut: dict[int, list] = {c: [] for c in classes}  # touching a tile's cut: merged last
    for r0 in range(0, h, rows):
        r1 = min(r0 + rows, h)
        values = np.asarray(band(r0, r1))
        for c0 in range(0, w, cols):
            c1 = min(c0 + cols, w)
            tile = values[:, c0:c1]
            for c in classes:
                if not (tile == c).any():
                    continue
                parts = _regions(shapely, tile, c, r0, c0)
                x0, y0, x1, y1 = shapely.bounds(parts).T
                edge = (y0 <= r0) & (r0 > 0) | (y1 >= r1) & (r1 < h)
                edge |= (x0 <= c0) & (c0 > 0) | (x1 >= c1) & (c1 < w)
                done[c] += list(parts[~edge])
                cut[c] += list(parts[edge])
    for c in classes:
        if cut[c]:
            done[c] += list(shapely.get_parts(shapely.unary_union(cut[c])))
    return done


def _scale(path: Path, level: int) -> tuple[float, float]:
    """Full-resolution pixels per pixel of ``level`` of ``path`` (1, 1 at level 0)."""
    if not level:
        return 1.0, 1.0
    import tifffile

    with tifffile.TiffFile(path) as tif:
        levels = tif.series[0].levels
        axes, full, shape = levels[0].axes, levels[0].shape, levels[level].shape
    x, y = axes.index("X"), axes.index("Y")
    return full[x] / shape[x], full[y] / shape[y]


def write_geojson(
    out: Path,
    band: Callable[[int, int], np.ndarray],
    shape: tuple[int, int],
    names: Sequence[str],
    colors: Sequence[tuple[int, int, int]],
    src: Path,
    level: int = 0,
) -> int:
    """Write the FeatureCollection of the regions of every class but 0 of the mask given
    by ``band`` to ``out`` (features streamed one by one); returns the feature count."""
    _shapely()
    from shapely import affinity, to_geojson
    from shapely.geometry.polygon import orient

    polygons = class_polygons(band, shape, range(1, len(names)))
    sx, sy = _scale(src, level)
    count = 0
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"type": "FeatureCollection", "features": [\n')
        for c, parts in polygons.items():
            props = {
                "objectType": "detection",
                "classification": {"name": names[c], "color": list(colors[c])},
            }
            head = '{"type": "Feature", "properties": ' + json.dumps(props) + ', "geometry": '
            for poly in parts:
                if (sx, sy) != (1.0, 1.0):
                    poly = affinity.scale(poly, sx, sy, origin=(0, 0))
                geometry = to_geojson(orient(poly))  # exterior counter-clockwise
                f.write(("" if count == 0 else ",\n") + head + geometry + "}")
                count += 1
        f.write("\n]}\n")
    tmp.replace(out)
    return count
