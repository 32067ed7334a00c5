"""Tile-aware TIFF reads, crops that cost the crop, the Pillow limit and ``convert``."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile
from PIL import Image
from typer.testing import CliRunner

from spconv_train.cli import app
from spconv_train.data import DataError, FolderDataset, read_region, strip_bounds, tiff
from spconv_train.data._readers import image_header, read_image, read_mask
from spconv_train.data.convert import _halve, convert_to_tiff
from spconv_train.data.transforms import AugmentParams, load_strip

runner = CliRunner()


@pytest.fixture
def decoded(monkeypatch):
    """Records ``(page index in file, segment index)`` of every decoded tile/strip."""
    calls: list[int] = []
    real = tiff._decode_segment

    def counting(page, data, index):
        calls.append(index)
        return real(page, data, index)

    monkeypatch.setattr(tiff, "_decode_segment", counting)
    return calls


def _image(shape, dtype=np.uint16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype)


@pytest.mark.parametrize(
    "kind",
    ["tiled-zlib", "tiled-zstd-bigtiff", "stripped-lzw", "planar-rgb", "uncompressed"],
)
def test_strips_equal_full_read_and_decode_only_their_tiles(tmp_path, decoded, kind):
    h, w = 70, 100
    path = tmp_path / "img.tif"
    rgb = kind == "planar-rgb"
    full = _image((h, w, 3) if rgb else (h, w), seed=1)
    kw = {
        "tiled-zlib": {"tile": (16, 32), "compression": "zlib"},
        "tiled-zstd-bigtiff": {"tile": (16, 16), "compression": "zstd", "bigtiff": True},
        "stripped-lzw": {"rowsperstrip": 8, "compression": "lzw"},
        "planar-rgb": {"tile": (32, 16), "compression": "zlib", "planarconfig": "separate"},
        "uncompressed": {"tile": (16, 16)},
    }[kind]
    tifffile.imwrite(path, full.transpose(2, 0, 1) if rgb else full, **kw)
    assert np.array_equal(tifffile.imread(path), full.transpose(2, 0, 1) if rgb else full)
    page = tifffile.TiffFile(path).pages[0]
    planes = 3 if rgb else 1
    total = len(page.dataoffsets)
    for parts in (1, 3):
        for rank in range(parts):
            a, b = strip_bounds(w, parts, rank)
            decoded.clear()
            strip = read_region(path, None, (a, b))
            assert strip.dtype == np.uint16
            assert np.array_equal(strip, full[:, a:b])
            if page.is_tiled:
                tw, th = page.tilewidth, page.tilelength
                ncols = -(-w // tw)
                want = {
                    (p * -(-h // th) + ty) * ncols + tx
                    for p in range(planes)
                    for ty in range(-(-h // th))
                    for tx in range(a // tw, (b - 1) // tw + 1)
                }
                assert sorted(decoded) == sorted(want)
                if parts == 3:
                    assert len(decoded) < total
            else:
                assert len(decoded) == total  # strips span the width: all rows, once each
    # A crop of rows reads only the tiles or strips under it.
    decoded.clear()
    crop = read_region(path, (20, 37), (40, 61))
    assert np.array_equal(crop, full[20:37, 40:61])
    rows_per = page.tilelength if page.is_tiled else page.rowsperstrip
    row_segments = 37 // rows_per - 20 // rows_per + 1
    col_segments = (60 // page.tilewidth - 40 // page.tilewidth + 1) if page.is_tiled else 1
    assert len(decoded) == planes * row_segments * col_segments


def test_pyramid_level_and_jpeg(tmp_path):
    full = _image((64, 96, 3), np.uint8, seed=2)
    path = tmp_path / "slide.ome.tif"
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        tw.write(full, tile=(16, 16), subifds=1, compression="zlib", photometric="rgb")
        tw.write(full[::2, ::2], tile=(16, 16), subfiletype=1, compression="zlib")
    assert image_header(path, level=1) == (32, 48, 3)
    assert np.array_equal(read_region(path, None, (5, 30), level=1), full[::2, ::2][:, 5:30])
    with pytest.raises(DataError, match=r"data.level=2 but the file has 2 level"):
        read_region(path, level=2)
    jpeg = tmp_path / "jpeg.tif"
    tifffile.imwrite(jpeg, full, tile=(16, 16), compression="jpeg", photometric="rgb")
    assert np.array_equal(read_region(jpeg, (3, 41), (17, 60)), tifffile.imread(jpeg)[3:41, 17:60])


def _dataset(tmp_path, image, mask, ext=".tif", **kw):
    for kind in ("images", "masks"):
        (tmp_path / kind / "train").mkdir(parents=True, exist_ok=True)
    if ext == ".tif":
        tifffile.imwrite(tmp_path / "images/train/a.tif", image, tile=(16, 16), compression="zlib")
    else:
        Image.fromarray(image).save(tmp_path / f"images/train/a{ext}")
    tifffile.imwrite(tmp_path / "masks/train/a.tif", mask, tile=(16, 16), compression="zlib")
    return FolderDataset(tmp_path, "train", num_classes=3, **kw)


def test_training_crop_reads_only_the_crop_tiles(tmp_path, decoded):
    image = _image((96, 128), seed=3)
    mask = np.random.default_rng(4).integers(0, 3, (96, 128), dtype=np.uint8)
    ds = _dataset(tmp_path, image, mask)
    params = AugmentParams(
        source_hw=(96, 128), scaled_hw=(96, 128), out_hw=(20, 24), top=33, left=50
    )
    decoded.clear()
    img, msk = load_strip(ds, 0, (8, 24), params)  # the second of two strips of the crop
    assert torch_equal(img[0], image[33:53, 58:74] / 65535.0)
    assert np.array_equal(msk.numpy(), mask[33:53, 58:74])
    # rows 33..52 -> tile rows 2..3, columns 58..73 -> tile columns 3..4: 4 tiles each file
    assert len(decoded) == 2 * 4


def torch_equal(t, arr) -> bool:
    return np.allclose(t.numpy(), arr.astype(np.float32), atol=0, rtol=0)


def test_over_pillow_limit_png_fails_clearly_tiff_works(tmp_path):
    image = _image((40, 60), np.uint8, seed=5)
    mask = np.random.default_rng(6).integers(0, 3, (40, 60), dtype=np.uint8)
    png = tmp_path / "png"
    ds = _dataset(png, image, mask, ext=".png", max_image_pixels=1000)
    with pytest.raises(DataError) as err:
        ds.load(0)
    msg = str(err.value)
    assert str(png / "images/train/a.png") in msg and "data.max_image_pixels=1,000" in msg
    assert "spconv-train convert" in msg
    # Pillow's own guard (far below this file's size here) is not what stops it:
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 100
    try:
        ok = _dataset(tmp_path / "png2", image, mask, ext=".png", max_image_pixels=10_000)
        assert np.array_equal(ok.load(0)[0][0].numpy(), image / np.float32(255))
        # The same pixels as a (converted) TIFF have no whole-decode limit.
        result = runner.invoke(
            app,
            ["convert", str(png / "images/train/a.png"), str(tmp_path / "a.tif"), "--tile", "16"],
        )
        assert result.exit_code == 0, result.output
        assert Image.MAX_IMAGE_PIXELS == 100
    finally:
        Image.MAX_IMAGE_PIXELS = old
    converted = tifffile.TiffFile(tmp_path / "a.tif")
    assert converted.pages[0].is_tiled and converted.pages[0].compression == 8  # zlib
    assert len(converted.series[0].levels) >= 2
    converted.close()
    tif_ds = _dataset(tmp_path / "tif", image, mask, max_image_pixels=1000)
    assert np.array_equal(tif_ds.load(0)[0][0].numpy(), image / np.float32(255))
    assert np.array_equal(
        read_image(tmp_path / "a.tif", (0, 60))[0].numpy(), image / np.float32(255)
    )


def test_convert_command_errors(tmp_path):
    result = runner.invoke(app, ["convert", str(tmp_path / "missing.png"), str(tmp_path / "o.tif")])
    assert result.exit_code == 2 and "missing.png" in result.output


def test_palette_tiff_image_is_rgb_and_palette_mask_gives_indices(tmp_path):
    rng = np.random.default_rng(8)
    indices = rng.integers(0, 4, (20, 30)).astype(np.uint8)
    pal = Image.fromarray(indices, mode="L").convert("P")
    pal.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 756)
    pal.save(tmp_path / "p.tif")
    assert image_header(tmp_path / "p.tif") == (20, 30, 3)
    rgb = read_image(tmp_path / "p.tif", (4, 9))
    assert torch_equal(
        rgb, np.array(pal.convert("RGB"))[:, 4:9].transpose(2, 0, 1) / np.float32(255)
    )
    assert np.array_equal(read_mask(tmp_path / "p.tif", (4, 9)).numpy(), np.array(pal)[:, 4:9])


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_convert_streams_levels_equal_to_whole_image_halving(tmp_path, channels):
    full = _image((75, 101, channels), np.uint16 if channels != 3 else np.uint8, seed=9)
    np.save(tmp_path / "big.npy", full)
    sizes = convert_to_tiff(tmp_path / "big.npy", tmp_path / "big.tif", tile=16)
    assert sizes == [(75, 101), (38, 51), (19, 26), (10, 13)]
    level = full
    for k, hw in enumerate(sizes):
        if k:
            level = _halve(level, nearest=False)
        got = read_region(tmp_path / "big.tif", level=k)
        assert got.shape[:2] == hw
        assert np.array_equal(got, level[:, :, 0] if channels == 1 else level), k
