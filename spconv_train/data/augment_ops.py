"""The ``data.augment`` transforms as functions of *global* output coordinates.

Every geometric transform is written as its backward map: the float64 position in its input
that an output pixel ``(y, x)`` shows (``torchvision.transforms.v2`` resamples the same way,
through ``grid_sample``). Because a pixel's source position depends only on its own global
coordinates and the sample's drawn parameters, any rank can compute the source positions of
its strip or tile alone, read the bounding box of those positions (plus one pixel for the
bilinear taps) and resample exactly what the whole-crop transform gives there.

Point-wise intensity transforms act on ``u = (x - low) / (high - low)`` in ``[0, 1]``, the
image on the scale of its storage range (a uint16 value / 65535 under
``data.normalize.mode: dtype``), in float64, and clamp to it, so 16-bit images keep their
65536 levels. Gaussian noise comes from a counter-based hash of ``(seed, channel, y, x)``
in global coordinates, so each pixel gets the same noise on every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms.v2 import functional as F

__all__ = [
    "DrawnOp",
    "apply_intensity",
    "backward_map",
    "layout_noise",
    "resample",
]


@dataclass(frozen=True)
class DrawnOp:
    """One applied transform with its drawn parameters.

    Attributes:
        name: ``rot90``, ``transpose``, ``affine``, ``elastic``, ``brightness``,
            ``contrast``, ``gamma`` or ``noise``.
        values: the drawn numbers (rot90: ``(k,)``; affine: ``(angle, tx, ty, scale,
            shear)``, degrees and pixels; elastic: ``(alpha, sigma)``; intensity: the
            factor, gamma or sigma).
        in_hw: ``(H, W)`` of the transform's input.
        seed: the elastic control grid's / the noise's seed.
    """

    name: str
    values: tuple[float, ...]
    in_hw: tuple[int, int]
    seed: int = 0

    @property
    def out_hw(self) -> tuple[int, int]:
        """Size of the output: rot90 by an odd k and transpose swap H and W."""
        h, w = self.in_hw
        swap = self.name == "transpose" or (self.name == "rot90" and int(self.values[0]) % 2)
        return (w, h) if swap else (h, w)


def _affine_inverse(angle: float, tx: float, ty: float, scale: float, shear: float) -> list:
    """torchvision's inverse affine matrix about the image centre (``center=None``,
    ``shear=(shear, 0)``): output-to-input, on ``(x, y)`` relative to the centre."""
    rot, sx, sy = math.radians(angle), math.radians(shear), 0.0
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d / scale, -b / scale, 0.0, -c / scale, a / scale, 0.0]
    m[2] += m[0] * (-tx) + m[1] * (-ty)
    m[5] += m[3] * (-tx) + m[4] * (-ty)
    return m


def _elastic_grid(op: DrawnOp) -> tuple[Tensor, float]:
    """The control grid ``[2, gh, gw]`` of displacements (pixels, ``(dy, dx)``) of an
    elastic op and its spacing. Small (one node per ``sigma`` pixels), drawn whole on
    every rank from ``op.seed``, so every rank evaluates the same field."""
    alpha, sigma = op.values
    h, w = op.in_hw
    gh, gw = int((h - 1) // sigma) + 2, int((w - 1) // sigma) + 2
    g = torch.Generator().manual_seed(op.seed)
    grid = (torch.rand(2, gh, gw, generator=g, dtype=torch.float64) * 2 - 1) * alpha
    return grid, sigma


def _elastic_displacement(op: DrawnOp, y: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Displacement at ``(y, x)``: the control grid interpolated with smoothstep weights
    (continuous with a continuous derivative), element-wise in float64."""
    grid, step = _elastic_grid(op)
    gh, gw = grid.shape[1:]
    fy, fx = y / step, x / step
    iy = fy.floor().clamp(0, gh - 2)
    ix = fx.floor().clamp(0, gw - 2)
    ty, tx = fy - iy, fx - ix
    wy, wx = ty * ty * (3 - 2 * ty), tx * tx * (3 - 2 * tx)
    iy, ix = iy.long(), ix.long()
    out = []
    for comp in grid:
        v00, v01 = comp[iy, ix], comp[iy, ix + 1]
        v10, v11 = comp[iy + 1, ix], comp[iy + 1, ix + 1]
        out.append((v00 * (1 - wx) + v01 * wx) * (1 - wy) + (v10 * (1 - wx) + v11 * wx) * wy)
    return out[0], out[1]


def _backward_one(op: DrawnOp, y: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Input position of output positions ``(y, x)`` under ``op`` (pixel indices)."""
    h, w = op.in_hw
    if op.name == "transpose":
        return x, y
    if op.name == "rot90":  # torch.rot90(t, k, dims=(-2, -1)): counter-clockwise turns
        k = int(op.values[0]) % 4
        if k == 1:
            return x, (w - 1) - y
        if k == 2:
            return (h - 1) - y, (w - 1) - x
        if k == 3:
            return (h - 1) - x, y
        return y, x
    if op.name == "affine":
        m = _affine_inverse(*op.values)
        cy, cx = (h - 1) * 0.5, (w - 1) * 0.5
        xr, yr = x - cx, y - cy
        return m[3] * xr + m[4] * yr + m[5] + cy, m[0] * xr + m[1] * yr + m[2] + cx
    if op.name == "elastic":
        dy, dx = _elastic_displacement(op, y, x)
        return y + dy, x + dx
    raise ValueError(f"{op.name} is not a geometric transform")


def backward_map(
    ops: list[DrawnOp], rows: tuple[int, int], cols: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """float64 ``(y, x)`` in the crop (the input of the first op) shown by output rows
    ``[r0, r1)`` x columns ``[c0, c1)`` after the geometric ``ops`` (applied in order)."""
    y = torch.arange(rows[0], rows[1], dtype=torch.float64)[:, None]
    x = torch.arange(cols[0], cols[1], dtype=torch.float64)[None, :]
    y, x = torch.broadcast_tensors(y, x)
    for op in reversed(ops):
        y, x = _backward_one(op, y, x)
    return y, x


def source_box(
    y: Tensor, x: Tensor, crop_hw: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Rows and columns of the crop that resampling at ``(y, x)`` reads: the bounding box
    of the positions widened to whole pixels (the bilinear taps: a margin of up to one
    pixel; none for positions on the pixel grid, as rot90 / transpose give), clipped to the
    crop. None when every position lies outside it. A tap outside the box has weight 0."""
    if y.numel() == 0:
        return None
    r0 = max(int(math.floor(y.min())), 0)
    r1 = min(int(math.ceil(y.max())) + 1, crop_hw[0])
    c0 = max(int(math.floor(x.min())), 0)
    c1 = min(int(math.ceil(x.max())) + 1, crop_hw[1])
    if r0 >= r1 or c0 >= c1:
        return None
    return (r0, r1), (c0, c1)


def resample(
    image: Tensor,
    mask: Tensor,
    origin: tuple[int, int],
    y: Tensor,
    x: Tensor,
    crop_hw: tuple[int, int],
    fill: int,
) -> tuple[Tensor, Tensor]:
    """Image (bilinear, 0 outside the crop) and mask (nearest, ``fill`` outside) at the crop
    positions ``(y, x)``, from the loaded box ``image [C, h, w]`` / ``mask [h, w]`` whose
    top-left pixel is crop pixel ``origin``.

    As ``grid_sample`` (``align_corners=False``, zero padding; nearest rounds half to even),
    but element-wise in float64, so a pixel's value never depends on the layout.
    """
    hc, wc = crop_hw
    oy, ox = origin
    h, w = mask.shape
    flat_img, flat_mask = image.reshape(image.shape[0], -1).double(), mask.reshape(-1)

    def gather(yy: Tensor, xx: Tensor) -> tuple[Tensor, Tensor]:
        inside = (yy >= 0) & (yy < hc) & (xx >= 0) & (xx < wc)
        ly = (yy - oy).clamp(0, h - 1)
        lx = (xx - ox).clamp(0, w - 1)
        return (ly * w + lx).reshape(-1), inside

    y0, x0 = y.floor().long(), x.floor().long()
    wy, wx = y - y0, x - x0
    out = torch.zeros(image.shape[0], y.numel(), dtype=torch.float64)
    for dy, dx, wt in ((0, 0, (1 - wy) * (1 - wx)), (0, 1, (1 - wy) * wx),
                       (1, 0, wy * (1 - wx)), (1, 1, wy * wx)):  # fmt: skip
        idx, inside = gather(y0 + dy, x0 + dx)
        out += flat_img[:, idx] * (wt * inside).reshape(1, -1)
    ny, nx = torch.round(y).long(), torch.round(x).long()
    idx, inside = gather(ny, nx)
    out_mask = torch.where(inside.reshape(-1), flat_mask[idx], torch.tensor(fill))
    shape = tuple(y.shape)
    return out.float().reshape(image.shape[0], *shape), out_mask.reshape(shape)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a well-mixed 64-bit hash of each element (wrapping uint64)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _M64


def layout_noise(
    seed: int, channels: int, rows: tuple[int, int], cols: tuple[int, int], out_hw: tuple[int, int]
) -> Tensor:
    """Standard normal noise ``[C, r1 - r0, c1 - c0]`` (float64) of output pixels
    ``rows`` x ``cols`` of an ``out_hw`` sample: Box-Muller on two hashes of the pixel's
    global counter, so the noise of a pixel is the same for any strip or tile it is in."""
    c = np.arange(channels, dtype=np.uint64)[:, None, None]
    yy = np.arange(rows[0], rows[1], dtype=np.uint64)[None, :, None]
    xx = np.arange(cols[0], cols[1], dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        counter = ((c * np.uint64(out_hw[0]) + yy) * np.uint64(out_hw[1]) + xx) * np.uint64(2)
        key = _splitmix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        h1 = _splitmix(counter ^ key)
        h2 = _splitmix((counter + np.uint64(1)) ^ key)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
    u2 = ((h2 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
    return torch.from_numpy(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2))


def apply_intensity(
    image: Tensor,
    ops: list[DrawnOp],
    value_range: tuple[Tensor, Tensor],
    rows: tuple[int, int],
    cols: tuple[int, int],
    out_hw: tuple[int, int],
) -> Tensor:
    """The point-wise ``ops`` in order on this rank's ``image [C, h, w]`` (rows x cols of an
    ``out_hw`` sample), on the storage scale ``u`` in ``[0, 1]`` given by ``value_range``
    (per-channel ``(low, high)`` of the normalised values), clamped to it.

    brightness ``u * f`` and gamma ``u ** g`` are torchvision's ``adjust_brightness`` /
    ``adjust_gamma`` on ``u``; contrast ``(u - 0.5) * f + 0.5`` blends with the middle of
    the range instead of torchvision's image mean (a whole-image statistic no rank holds);
    noise adds ``sigma * layout_noise``.
    """
    if not ops:
        return image
    # float64 throughout: pow, log and cos may round the last bit differently on another
    # tensor shape (vectorised vs scalar code); in float64 that bit is lost in the float32
    # result, so a pixel's value does not depend on the layout.
    low, high = (v.view(-1, 1, 1).double() for v in value_range)
    span = high - low
    u = ((image.double() - low) / span).clamp_(0.0, 1.0)
    for op in ops:
        v = op.values[0]
        if op.name == "brightness":
            # [C, 1, h, w]: torchvision's kernel takes 1 or 3 channels, microscopy has any.
            u = F.adjust_brightness(u.unsqueeze(1), v).squeeze(1)
        elif op.name == "contrast":
            u = ((u - 0.5) * v + 0.5).clamp_(0.0, 1.0)
        elif op.name == "gamma":
            u = F.adjust_gamma(u.unsqueeze(1), v).squeeze(1)
        elif op.name == "noise":
            noise = layout_noise(op.seed, u.shape[0], rows, cols, out_hw)
            u = (u + v * noise).clamp_(0.0, 1.0)
        else:
            raise ValueError(f"{op.name} is not an intensity transform")
    return (u * span + low).to(image.dtype)
