"""Slide-ready outputs of ``spconv-train predict``: pyramidal OME-TIFF masks and
probabilities with the input's pixel size, class names and colours, a ``classes.json`` a
slide viewer can take, and (``--geojson``) the predicted objects as GeoJSON.

The pyramid is ``convert``'s (``data.convert.write_pyramid``): masks are reduced by
picking pixels (class ids are never averaged), probabilities by 2x2 means. Band-streamed
outputs are first written as single-level tiled TIFFs band by band, then read back band
by band into the OME-TIFF (memory: a few bands; the reduced levels live in temporary
memory-mapped files), so nothing ever holds a whole slide.

What QuPath reads (through Bio-Formats): the OME-XML ``PhysicalSizeX/Y`` (the pixel size,
in µm) and, of the probabilities, each channel's ``Name`` and ``Color`` (one channel per
class). A class map's names and colours have no place in OME's pixel model: they are in a
``MapAnnotation`` (namespace ``spconv-train/classes``, index -> ``name #rrggbb``) and in
``OUT/classes.json``, whose ``pathClasses`` list is QuPath's own ``classes.json`` format
(name, packed ARGB colour: copy it to ``PROJECT/classifiers/classes/classes.json``).
"""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spconv_train.data import image_header
from spconv_train.data.convert import source_bands, write_pyramid
from spconv_train.logging import class_colors

from ._errors import PredictError

__all__ = [
    "FORMATS",
    "SlideOptions",
    "finish_streamed",
    "input_pixel_size",
    "slide_options",
    "write_whole",
]

#: ``--format`` values: ``auto`` is PNG for images predicted whole in memory and OME-TIFF
#: for band-streamed ones; ``png`` keeps single-level tiled TIFFs for band-streamed ones
#: (a PNG cannot be written band by band).
FORMATS = ("auto", "ome-tiff", "tiff", "png")
TILE = 256  # tile edge of every written TIFF, as the band writer's
_NO_LIMIT = 1 << 62  # the outputs were written by this tool: any size
_UM = {"µm": 1.0, "um": 1.0, "micron": 1.0, "nm": 1e-3, "mm": 1e3, "cm": 1e4, "m": 1e6}


@dataclass(frozen=True)
class SlideOptions:
    """``--format`` (one of ``FORMATS``), ``--geojson`` and the class names (index order)."""

    format: str = "auto"
    geojson: bool = False
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise PredictError(f"--format {self.format}: expected one of {', '.join(FORMATS)}")

    def names(self, k: int) -> list[str]:
        """The ``k`` class names (``class_i`` where none are known)."""
        given = list(self.class_names)
        return given if len(given) == k else [f"class_{i}" for i in range(k)]


def _ome_pixel_size(xml: str) -> tuple[float, float] | None:
    pixels = next((e for e in ET.fromstring(xml).iter() if e.tag.endswith("Pixels")), None)
    if pixels is None or pixels.get("PhysicalSizeX") is None:
        return None
    size = []
    for axis in ("X", "Y"):
        value = pixels.get(f"PhysicalSize{axis}") or pixels.get("PhysicalSizeX")
        unit = _UM.get(pixels.get(f"PhysicalSize{axis}Unit", "µm"))
        if unit is None:
            return None
        size.append(float(value) * unit)
    return size[0], size[1]


def input_pixel_size(path: Path, level: int = 0) -> tuple[float, float] | None:
    """``(x, y)`` pixel size in µm of ``level`` of an input image: its OME-XML
    ``PhysicalSizeX/Y``, an SVS description's ``MPP``, or its resolution tags (unit inch or
    centimetre); None when the file states none (resolution unit NONE, PNG, .npy)."""
    import tifffile
    from tifffile.tifffile import svs_description_metadata

    from spconv_train.data.tiff import is_tiff

    if not is_tiff(path):
        return None
    with tifffile.TiffFile(path) as tif:
        page, size = tif.pages[0], None
        if tif.is_ome and tif.ome_metadata:
            size = _ome_pixel_size(tif.ome_metadata)
        if size is None and tif.is_svs:
            mpp = svs_description_metadata(page.description).get("MPP")
            size = (float(mpp), float(mpp)) if mpp else None
        unit = {2: 25400.0, 3: 1e4}.get(int(page.resolutionunit))  # µm per inch / cm
        if size is None and unit is not None and all(page.resolution):
            size = (unit / page.resolution[0], unit / page.resolution[1])
        if size is None or not all(math.isfinite(s) and s > 0 for s in size):
            return None
        levels = tif.series[0].levels
        if level and level < len(levels):  # the level's pixels are that much bigger
            axes, full, shape = levels[0].axes, levels[0].shape, levels[level].shape
            x, y = axes.index("X"), axes.index("Y")
            size = (size[0] * full[x] / shape[x], size[1] * full[y] / shape[y])
    return size


def _ome_color(rgb: tuple[int, int, int]) -> int:
    """OME's colour: RGBA packed in a signed 32-bit integer."""
    v = (rgb[0] << 24) | (rgb[1] << 16) | (rgb[2] << 8) | 255
    return v - (1 << 32) if v >= 1 << 31 else v


def _qupath_color(rgb: tuple[int, int, int]) -> int:
    """QuPath's colour: ARGB packed in a signed 32-bit integer (alpha 255)."""
    v = (255 << 24) | (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]
    return v - (1 << 32)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _mask_ome(names: list[str]) -> dict:
    colors = class_colors(len(names))
    table = {str(i): f"{n} {_hex(c)}" for i, (n, c) in enumerate(zip(names, colors, strict=True))}
    return {
        "axes": "YX",
        "Channel": {"Name": ["class"]},
        "Description": "class index per pixel (spconv-train predict)",
        "MapAnnotation": {"Namespace": "spconv-train/classes", **table},
    }


def _probability_ome(names: list[str]) -> dict:
    colors = [_ome_color(c) for c in class_colors(len(names))]
    return {
        "axes": "CYX",
        "Channel": {"Name": names, "Color": colors},
        "Description": "softmax probability x 255 per class (spconv-train predict)",
    }


def write_classes_json(out_dir: Path, names: list[str], pixel_size) -> Path:
    """``OUT/classes.json``: QuPath's ``pathClasses`` list plus each class's index and RGB
    (written whole, then renamed: replicas writing it at once leave one whole file)."""
    table = list(zip(names, class_colors(len(names)), strict=True))
    doc = {
        "pathClasses": [{"name": n, "color": _qupath_color(c)} for n, c in table],
        "classes": [{"index": i, "name": n, "rgb": list(c)} for i, (n, c) in enumerate(table)],
        "pixel_size_um": list(pixel_size) if pixel_size else None,
    }
    path = out_dir / "classes.json"
    tmp = out_dir / f".classes.json.{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _ome_name(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".tif") + ".ome.tif")


def _geojson(band, h: int, w: int, path: Path, level: int, names, out: Path) -> str:
    from ._geojson import write_geojson

    n = write_geojson(out, band, (h, w), names, class_colors(len(names)), path, level)
    return f"{out.name} ({n} objects)"


def finish_streamed(
    written: list[Path], src: Path, level: int, k: int, opts: SlideOptions
) -> list[str]:
    """Turn the band writer's single-level TIFFs (``written``: mask, then probabilities)
    into the outputs ``opts`` asks for; returns the names of the files written."""
    mask = written[0]
    size = input_pixel_size(src, level)
    names = opts.names(k)
    with_ome = opts.format in ("auto", "ome-tiff")
    done = []
    h, w, _ = image_header(mask, max_pixels=_NO_LIMIT)
    geo = None
    if opts.geojson:  # from the single-level mask, before it is replaced
        band = source_bands(mask, w)
        out = mask.with_name(mask.name.removesuffix(".tif") + ".geojson")
        geo = _geojson(lambda r0, r1: band(r0, r1)[:, :, 0], h, w, src, level, names, out)
    for i, path in enumerate(written):
        if not with_ome:
            done.append(path.name)
            continue
        hh, ww, c = image_header(path, max_pixels=_NO_LIMIT)
        band = source_bands(path, ww)
        dtype = band(0, 1).dtype
        ome = _mask_ome(names) if i == 0 else _probability_ome(names)
        dst = _ome_name(path)
        write_pyramid(
            dst, band, (hh, ww, c), dtype, tile=TILE, nearest=i == 0, ome=ome, pixel_size=size
        )
        path.unlink()
        done.append(dst.name)
    write_classes_json(mask.parent, names, size)
    return done + ([geo] if geo else [])


def write_whole(
    out_dir: Path, stem: str, pred: np.ndarray, src: Path, level: int, k: int, opts: SlideOptions
) -> list[str]:
    """Write the mask ``pred`` (``[H, W]`` class indices) of an image predicted whole in
    the format ``opts`` asks for (``auto`` / ``png``: PNG); returns the file names."""
    from PIL import Image

    from ._writers import TiledTiffWriter

    names, done = opts.names(k), []
    if pred.dtype != np.uint8:  # more than 256 classes: 16-bit in every format
        pred = pred.astype(np.uint16)
    if opts.format in ("auto", "png"):
        Image.fromarray(pred).save(out_dir / f"{stem}.png")  # uint8: L, uint16: I;16
        done.append(f"{stem}.png")
    elif opts.format == "tiff":
        writer = TiledTiffWriter(out_dir / f"{stem}.tif", pred.shape, pred.dtype, tile=TILE)
        writer.put(pred)
        writer.close()
        done.append(f"{stem}.tif")
    size = input_pixel_size(src, level)
    if opts.format == "ome-tiff":
        dst = out_dir / f"{stem}.ome.tif"
        band = lambda r0, r1: pred[r0:r1, :, None]  # noqa: E731
        write_pyramid(
            dst, band, (*pred.shape, 1), pred.dtype, tile=TILE, nearest=True,
            ome=_mask_ome(names), pixel_size=size,
        )  # fmt: skip
        done.append(dst.name)
    if opts.geojson:
        geo = out_dir / f"{stem}.geojson"
        done.append(_geojson(lambda r0, r1: pred[r0:r1], *pred.shape, src, level, names, geo))
    if opts.format in ("ome-tiff", "tiff") or opts.geojson:  # a plain PNG set: none
        write_classes_json(out_dir, names, size)
    return done


def slide_options(output_format: str, geojson: bool, volumes: bool):
    """The checked ``SlideOptions`` of ``--format`` / ``--geojson`` (PredictError when they
    cannot apply: volumes, or --geojson without shapely)."""
    slide = SlideOptions(output_format, geojson)
    if volumes and (geojson or output_format != "auto"):
        raise PredictError(
            f"--format {output_format}{' --geojson' if geojson else ''}: volumes are written "
            "as <stem>.npy label volumes; leave --format and --geojson out"
        )
    if geojson:
        from ._geojson import _shapely

        _shapely()  # before any image is predicted
    return slide
