"""Slide-ready ``predict`` outputs: pyramidal OME-TIFF masks (nearest-neighbour levels)
and probabilities (2x2 means) with the input's pixel size, class names and colours,
``classes.json`` for QuPath, and the GeoJSON of the predicted objects (exact pixel-edge
polygons: areas equal the mask's pixel counts)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import shapely
import tifffile
from PIL import Image
from shapely.geometry import shape as to_shape

from spconv_train.data import synthetic_class_names
from spconv_train.data.convert import _halve, pyramid_sizes
from spconv_train.logging import class_colors
from spconv_train.predict._geojson import class_polygons
from spconv_train.predict._slide import (
    SlideOptions,
    finish_streamed,
    input_pixel_size,
    write_whole,
)
from spconv_train.predict._writers import TiledTiffWriter

NAMES = ("background", "nucleus", "boundary", "stroma")


def _blobs(h: int, w: int, seed: int, k: int = 4) -> np.ndarray:
    """A seeded class map: discs and rings (holes) of classes 1..k-1 on class 0."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((h, w), np.uint8)
    yy, xx = np.mgrid[:h, :w]
    for _ in range(40):
        cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(3, 30)
        d = (yy - cy) ** 2 + (xx - cx) ** 2
        ring = (d < r * r) & (d >= (r // 2) ** 2) if rng.random() < 0.4 else d < r * r
        mask[ring] = rng.integers(1, k)
    return mask


def _input_tif(path: Path, h: int, w: int, um: float) -> Path:
    """A TIFF input (RGB discs on noise) whose resolution tags say ``um`` µm per pixel."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 80, (h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[:h, :w]
    for _ in range(12):
        cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(4, 20)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r, rng.integers(0, 3)] = 255
    tifffile.imwrite(path, img, resolution=(1e4 / um, 1e4 / um), resolutionunit="CENTIMETER")
    return path


def _ome(path: Path) -> tuple[list[np.ndarray], ET.Element]:
    """Every level of series 0 and the parsed OME-XML."""
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome and tif.pages[0].is_tiled and tif.pages[0].compression != 1
        levels = [level.asarray() for level in tif.series[0].levels]
        return levels, ET.fromstring(tif.ome_metadata)


def _find(root: ET.Element, tag: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.tag.endswith(tag)]


def test_mask_pyramid_nearest_levels_pixel_size_and_class_names(tmp_path):
    mask = _blobs(600, 700, 0)
    src = _input_tif(tmp_path / "slide.tif", 600, 700, 0.25)
    names = write_whole(tmp_path, "slide", mask, src, 0, 4, SlideOptions("ome-tiff", False, NAMES))
    assert names == ["slide.ome.tif"] and not (tmp_path / "slide.png").exists()
    levels, root = _ome(tmp_path / "slide.ome.tif")
    sizes = pyramid_sizes(600, 700, 256)
    assert [lv.shape for lv in levels] == sizes == [(600, 700), (300, 350), (150, 175)]
    for k, level in enumerate(levels):  # picked pixels, never averaged class ids
        np.testing.assert_array_equal(level, mask[:: 2**k, :: 2**k])
        assert set(np.unique(level)) <= {0, 1, 2, 3}
    pixels = _find(root, "Pixels")[0]
    assert float(pixels.get("PhysicalSizeX")) == pytest.approx(0.25)
    assert float(pixels.get("PhysicalSizeY")) == pytest.approx(0.25)
    assert pixels.get("PhysicalSizeXUnit") == "µm"
    table = {m.get("K"): m.text for m in _find(root, "M")}
    colors = class_colors(4)
    assert table == {str(i): f"{n} #{bytes(colors[i]).hex()}" for i, n in enumerate(NAMES)}
    with tifffile.TiffFile(tmp_path / "slide.ome.tif") as tif:  # per level, in pixels / cm
        res = [level.pages[0].resolution for level in tif.series[0].levels]
    assert res[0] == pytest.approx((4e4, 4e4)) and res[2] == pytest.approx((1e4, 1e4))
    doc = json.loads((tmp_path / "classes.json").read_text())
    assert [c["name"] for c in doc["pathClasses"]] == list(NAMES)
    assert doc["pathClasses"][1]["color"] == -(1 << 32) + (255 << 24 | 31 << 16 | 119 << 8 | 180)
    assert doc["pixel_size_um"] == pytest.approx([0.25, 0.25])


def test_unknown_pixel_size_stays_unset(tmp_path):
    mask = _blobs(64, 80, 1)
    png = tmp_path / "plain.png"
    Image.fromarray(mask).save(png)
    write_whole(tmp_path, "plain", mask, png, 0, 4, SlideOptions("ome-tiff"))
    _, root = _ome(tmp_path / "plain.ome.tif")
    assert _find(root, "Pixels")[0].get("PhysicalSizeX") is None
    with tifffile.TiffFile(tmp_path / "plain.ome.tif") as tif:
        assert int(tif.pages[0].resolutionunit) == 1  # NONE: no physical size
    assert json.loads((tmp_path / "classes.json").read_text())["pixel_size_um"] is None
    # class names default to class_i when the given ones do not fit the class count
    assert [m.text.split()[0] for m in _find(root, "M")] == [f"class_{i}" for i in range(4)]


def test_pixel_size_from_ome_svs_tags_and_levels(tmp_path):
    img = np.zeros((64, 96), np.uint8)
    ome = tmp_path / "a.ome.tif"
    meta = {"axes": "YX", "PhysicalSizeX": 500, "PhysicalSizeXUnit": "nm"}
    meta |= {"PhysicalSizeY": 0.6, "PhysicalSizeYUnit": "µm"}
    tifffile.imwrite(ome, img, metadata=meta)
    assert input_pixel_size(ome) == pytest.approx((0.5, 0.6))
    inch = tmp_path / "inch.tif"
    tifffile.imwrite(inch, img, resolution=(2540, 1270), resolutionunit="INCH")
    assert input_pixel_size(inch) == pytest.approx((10.0, 20.0))
    svs = tmp_path / "a.svs"
    about = "Aperio Image Library v10.0.51\r\n96x64 (256x256) JPEG/RGB Q=30|AppMag = 20|MPP = 0.499"
    tifffile.imwrite(svs, img, description=about, metadata=None)
    assert input_pixel_size(svs) == pytest.approx((0.499, 0.499))
    plain = tmp_path / "plain.tif"
    tifffile.imwrite(plain, img)  # tifffile's default: (1, 1), unit NONE
    assert input_pixel_size(plain) is None
    np.save(tmp_path / "a.npy", img)
    assert input_pixel_size(tmp_path / "a.npy") is None
    pyramid = tmp_path / "pyr.tif"  # level 1 of a converted slide: pixels twice the size
    with tifffile.TiffWriter(pyramid) as tif:
        kw = {"tile": (16, 16), "resolutionunit": "CENTIMETER"}
        tif.write(img, subifds=1, resolution=(4e4, 4e4), **kw)
        tif.write(img[::2, ::2], subfiletype=1, resolution=(2e4, 2e4), **kw)
    assert input_pixel_size(pyramid, level=1) == pytest.approx((0.5, 0.5))


def test_streamed_outputs_become_ome_pyramids(tmp_path):
    """The band writer's single-level TIFFs -> ``.ome.tif`` mask (nearest) and
    probabilities (2x2 means, one named, coloured channel per class)."""
    mask = _blobs(300, 280, 2, k=3)
    probs = np.random.default_rng(3).integers(0, 256, (300, 280, 3), dtype=np.uint8)
    written = []
    for name, data in (("s.tif", mask), ("s_probabilities.tif", probs)):
        writer = TiledTiffWriter(tmp_path / name, data.shape, np.uint8)
        for r in range(0, 300, 70):  # bands of any height
            writer.put(data[r : r + 70])
        writer.close()
        written.append(tmp_path / name)
    src = _input_tif(tmp_path / "in.tif", 300, 280, 0.5)
    opts = SlideOptions("auto", class_names=NAMES[:3])
    assert finish_streamed(written, src, 0, 3, opts) == ["s.ome.tif", "s_probabilities.ome.tif"]
    assert not any(p.exists() for p in written)
    levels, _ = _ome(tmp_path / "s.ome.tif")
    assert [lv.shape for lv in levels] == [(300, 280), (150, 140)]
    np.testing.assert_array_equal(levels[1], mask[::2, ::2])
    levels, root = _ome(tmp_path / "s_probabilities.ome.tif")
    assert [lv.shape for lv in levels] == [(3, 300, 280), (3, 150, 140)]
    np.testing.assert_array_equal(levels[0], probs.transpose(2, 0, 1))
    np.testing.assert_array_equal(levels[1], _halve(probs, nearest=False).transpose(2, 0, 1))
    channels = _find(root, "Channel")
    assert [c.get("Name") for c in channels] == list(NAMES[:3])
    assert int(channels[1].get("Color")) == 31 << 24 | 119 << 16 | 180 << 8 | 255  # RGBA
    assert int(channels[2].get("Color")) == (255 << 24 | 127 << 16 | 14 << 8 | 255) - (1 << 32)
    assert float(_find(root, "Pixels")[0].get("PhysicalSizeX")) == pytest.approx(0.5)


def _check_geojson(path: Path, mask: np.ndarray, names) -> dict:
    """Per class: the features' polygons are valid, disjoint, and cover exactly the
    class's pixels (area = pixel count); returns {class name: feature count}."""
    doc = json.loads(path.read_text())
    assert doc["type"] == "FeatureCollection"
    by_class: dict[str, list] = {}
    for f in doc["features"]:
        cls = f["properties"]["classification"]
        assert f["properties"]["objectType"] == "detection" and f["geometry"]["type"] == "Polygon"
        i = names.index(cls["name"])
        assert cls["color"] == list(class_colors(len(names))[i])
        by_class.setdefault(cls["name"], []).append(to_shape(f["geometry"]))
    assert "background" not in by_class
    for i, name in enumerate(names[1:], 1):
        polys = by_class.get(name, [])
        assert all(p.is_valid for p in polys)
        area = sum(p.area for p in polys)
        assert area == (mask == i).sum(), name  # exact, not approximately
        assert shapely.union_all(polys).area == area  # disjoint
    return {n: len(p) for n, p in by_class.items()}


def test_geojson_polygons_are_exact_across_band_cuts(tmp_path):
    mask = _blobs(130, 150, 4)
    mask[35:85, 35:85] = 0
    mask[40:80, 40:80] = 1  # a square ring with a hole of class 2, cut by the bands
    mask[50:70, 50:70] = 2
    mask[55:60, 55:60] = 1  # an island in the hole
    mask[:4, :8] = 0
    mask[0, :3], mask[1, 3:5] = 3, 3  # touching at a corner only: two objects
    names = list(NAMES)
    write_whole(tmp_path, "m", mask, tmp_path / "m.png", 0, 4, SlideOptions("png", True, NAMES))
    assert (tmp_path / "m.png").is_file()
    counts = _check_geojson(tmp_path / "m.geojson", mask, names)
    whole = class_polygons(lambda a, b: mask[a:b], mask.shape, [1, 2, 3], 1000, 1000)
    for rows, cols in ((7, 1000), (16, 9), (1000, 13)):  # cuts through ring, hole, island
        cut = class_polygons(lambda a, b: mask[a:b], mask.shape, [1, 2, 3], rows, cols)
        for c in (1, 2, 3):
            assert len(cut[c]) == len(whole[c]) == counts[names[c]]
            assert shapely.union_all(cut[c]).equals(shapely.union_all(whole[c]))
    ring = [p for p in whole[1] if p.bounds == (40.0, 40.0, 80.0, 80.0)]
    assert len(ring) == 1 and len(ring[0].interiors) == 1 and ring[0].area == 1600 - 400
    corner = [p.bounds for p in whole[3] if p.bounds[2] <= 8 and p.bounds[3] <= 4]
    assert sorted(corner) == [(0, 0, 3, 1), (3, 1, 5, 2)]


# --- end to end: predict writes them ------------------------------------------------------


def _predict(weights: str, inputs: list[str], out: str, **stream):
    """``run_predict`` with the class names ``predict`` takes from the saved config;
    (status, console text or error)."""
    import io

    from rich.console import Console

    from spconv_train.predict._checkpoint import _load_config
    from spconv_train.predict._inputs import _class_names, _collect
    from spconv_train.predict._run import run_predict
    from spconv_train.predict._streamed import StreamOptions

    cfg = _load_config("export", Path(weights), None, [], None)
    text = io.StringIO()
    try:
        run_predict(
            cfg, "export", weights, _collect(inputs, None), out,
            class_names=_class_names(cfg, None), console=Console(file=text, width=400),
            stream=StreamOptions(**stream),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the test shows the message
        return "error", f"{type(exc).__name__}: {exc}"
    return "ok", text.getvalue()


def test_predict_writes_ome_tiff_and_geojson(dist_pool, tmp_path):
    """A band-streamed predict (``--format auto``: OME-TIFF, ``--geojson``) of a TIFF with
    a pixel size at 2 ranks: a pyramid with the input's pixel size and the config's class
    names, and a GeoJSON whose areas are the mask's pixel counts."""
    from tests.test_predict_bands import UNET, _export

    weights, _ = _export(tmp_path / "unet.pt", UNET, steps=10)
    images = tmp_path / "images"
    images.mkdir()
    _input_tif(images / "slide.tif", 320, 64, 0.5)
    slide = SlideOptions("auto", geojson=True)
    out = tmp_path / "out"
    [(status, text), _] = dist_pool.run(
        2, _predict, weights, [str(images)], str(out), band_rows=64, slide=slide
    )
    assert status == "ok" and "slide.ome.tif, slide.geojson (" in text, text
    levels, root = _ome(out / "slide.ome.tif")
    assert [lv.shape for lv in levels] == [(320, 64), (160, 32)]
    np.testing.assert_array_equal(levels[1], levels[0][::2, ::2])
    assert len(np.unique(levels[0])) > 1
    assert float(_find(root, "Pixels")[0].get("PhysicalSizeX")) == pytest.approx(0.5)
    names = synthetic_class_names(3)  # the saved config's classes
    assert [m.text.split()[0] for m in _find(root, "M")] == names
    assert not (out / "slide.tif").exists()
    assert json.loads((out / "classes.json").read_text())["pixel_size_um"] == [0.5, 0.5]
    _check_geojson(out / "slide.geojson", levels[0], names)


def test_cli_format_and_geojson_options(tmp_path, monkeypatch):
    """``--format`` / ``--geojson`` are documented (the extra's name survives rich markup),
    passed on to the torchrun ranks, and a wrong value exits 2 naming the choices."""
    from typer.testing import CliRunner

    import spconv_train.predict._command as predict
    from spconv_train.cli import app
    from tests.test_predict_bands import UNET, _export

    result = CliRunner().invoke(app, ["predict", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--format" in result.output and "spconv-train[slides]" in result.output
    weights, _ = _export(tmp_path / "m.pt", UNET)
    image = tmp_path / "x.png"
    Image.fromarray(_blobs(32, 32, 5)).save(image)
    seen = []
    monkeypatch.setattr(
        predict, "run_torchrun", lambda n, cmd, args, *_, **__: seen.append(args) or 0
    )
    kw = {"output_format": "ome-tiff", "geojson": True}
    assert predict.predict_command(weights, [image], tmp_path / "o", 2, **kw) == 0
    assert seen[0][-3:] == ["--format", "ome-tiff", "--geojson"]
    bad = CliRunner().invoke(
        app, ["predict", weights, str(image), "--out", str(tmp_path / "o"), "--format", "jpeg"]
    )
    assert bad.exit_code == 2 and "--format jpeg: expected one of auto, ome-tiff" in bad.output


@pytest.mark.parametrize("fmt", ["png", "ome-tiff", "tiff"])
def test_more_than_256_classes_are_written_16_bit(tmp_path, fmt):
    pred = np.array([[0, 300], [511, 2]], np.int32)  # the whole-image path's int32 classes
    [name] = write_whole(tmp_path, "k", pred, tmp_path / "k.png", 0, 512, SlideOptions(fmt))
    path = tmp_path / name
    saved = np.array(Image.open(path)) if fmt == "png" else tifffile.imread(path)
    assert saved.dtype == np.uint16
    np.testing.assert_array_equal(saved, pred)
