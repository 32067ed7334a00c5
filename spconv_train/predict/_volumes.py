"""``predict`` on volumes (``data.kind: volume``): each rank reads and predicts its block.

A volume ``[D, H, W]`` or ``[C, D, H, W]`` (``.npy`` through a memory map, a multi-page
TIFF stack page by page, NIfTI through nibabel: the readers of ``data/volume_folder.py``)
is split along ``parallel.shard_dim`` like DTensor's ``Shard`` (``strip_bounds``): each
rank reads only its block, the parallelized 3-D model runs on the NCDHW DTensor (halos come
from the neighbouring ranks), and the group's first rank receives the 1-byte class indices
of every block (never activations) and writes ``<stem>.npy`` (uint8, uint16 past 256
classes; ``[D, H, W]``), plus ``<stem>_probabilities.npy`` (``[D, H, W, K]`` uint8, softmax
x 255) with ``--probabilities``. Volumes are predicted whole (no bands): a rank's memory
follows its block; the first rank also holds the whole label volume (1 byte per voxel)
while writing it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import Shard

from spconv_train.config import empty_ranks, grid_mesh_dims
from spconv_train.data import AXES, DataError, check_mask_values, stitch_grid
from spconv_train.data.base import bad_file
from spconv_train.data.normalize import scale_by_dtype
from spconv_train.data.volume_folder import _open, volume_header
from spconv_train.parallel import ParallelDims, SpatialShardingError
from spconv_train.train.mesh_coords import to_dtensor
from spconv_train.train.val_check import is_geometry_error
from spconv_train.train.volume_feed import block_bounds, shard_axis

from ._errors import PredictError
from ._streamed import _gather

__all__ = ["VolumePredictor", "read_box"]


def read_box(path: Path, box: tuple[tuple[int, int], ...], mask: bool = False) -> torch.Tensor:
    """``box`` (``(start, stop)`` along D, H, W) of a stored volume: an image as float32
    ``[C, d, h, w]`` scaled by its dtype, a ``mask`` as int64 ``[d, h, w]``. Only the box
    is read (memory map / the slices' TIFF pages)."""
    s = tuple(slice(a, b) for a, b in box)
    try:
        arr = np.asarray(_open(path)[(Ellipsis, *s)])
    except DataError:
        raise
    except Exception as e:  # the file changed or broke since its header was read
        raise bad_file(path, f"cannot read the volume ({type(e).__name__}: {e})") from e
    if mask:
        return torch.from_numpy(arr.astype(np.int64))
    arr = arr[None] if arr.ndim == 3 else arr
    return scale_by_dtype(np.ascontiguousarray(arr), path)


class VolumePredictor:
    """One volume at a time on this rank's block (the volume counterpart of
    ``_run._Predictor``; called by ``run_predict`` with the same arguments)."""

    def __init__(self, cfg, model, space, device, stream, out_dir: Path, console) -> None:
        self.cfg, self.model, self.space, self.device = cfg, model, space, device
        self.sp, self.rank = space.size, space.rank
        # (axis, ranks) of every split axis (0, 1, 2 = D, H, W), in mesh-dim order (ranks
        # numbered row-major): one axis (parallel.shard_dim), or a block grid [d, h, w]
        dims = grid_mesh_dims(cfg)
        if dims:
            self.splits = [(ParallelDims.GRID.index(n), k) for n, k in dims.items()]
        else:
            self.splits = [(shard_axis(cfg), self.sp)]
        self.probabilities, self.out_dir = stream.probabilities, out_dir
        self.timing = {"read_s": 0.0, "forward_s": 0.0}

    def _sizes(self, path: Path, mask_path: Path | None) -> tuple[tuple[int, int, int], int]:
        """``((D, H, W), channels)`` from the headers, checked against the model."""
        shape, _ = volume_header(path)
        if len(shape) not in (3, 4):
            raise PredictError(f"{path}: expected a volume [D, H, W] or [C, D, H, W], got {shape}")
        size, c = tuple(shape[-3:]), 1 if len(shape) == 3 else shape[0]
        if c != self.cfg.model.in_channels:
            raise PredictError(
                f"{path}: {c} channels, the model takes {self.cfg.model.in_channels}"
            )
        if mask_path is not None and volume_header(mask_path)[0] != size:
            raise PredictError(
                f"{mask_path}: mask size {volume_header(mask_path)[0]} differs from volume "
                f"{path.name} ({'x'.join(map(str, size))}, DxHxW)"
            )
        return size, c  # type: ignore[return-value]

    def _box(self, size: tuple[int, int, int]) -> tuple[tuple[int, int], ...]:
        """This rank's ranges ``[a, b)`` along D, H, W (DTensor's chunking along every split
        axis), as the trainer's feed reads them."""
        return block_bounds(self.cfg, self.space.coords, size)

    def _logits(self, path: Path, size, c: int, box) -> torch.Tensor:
        """Logits ``[K, d, h, w]`` of this rank's block ``box`` (on the CPU)."""
        start = time.perf_counter()
        block = read_box(path, box)
        self.timing["read_s"] += time.perf_counter() - start
        placements = [Shard(2 + axis) for axis, _ in self.splits]
        x = to_dtensor(block[None].to(self.device), self.space.mesh, placements, (1, c, *size))
        bf16 = self.cfg.training.precision == "bf16"
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(self.device.type, torch.bfloat16, enabled=bf16):
            logits = self.model(x)
        self.timing["forward_s"] += time.perf_counter() - start
        return logits.to_local()[0].float().cpu()

    def _too_small(self, path: Path, size, why) -> SpatialShardingError:
        """The failure of a volume too small for the model over these ranks (``why``: the
        cause, e.g. the layer's error)."""
        dim = "/".join(AXES[axis] for axis, _ in self.splits)
        fix = f"the volume may be smaller than the model's down-sampling needs along {dim}"
        if self.sp > 1:
            fix = (
                f"use fewer ranks (--nproc, --set parallel.sp=<smaller>), another "
                f"parallel.shard_dim, or a {dim} extent divisible by sp x the model's total "
                f"stride; or {fix}"
            )
        return SpatialShardingError(
            f"{path}: volume {'x'.join(map(str, size))} (DxHxW) cannot be run by this model "
            f"split along {dim} over sp={self.sp} rank(s); {fix}. ({why})"
        )

    def __call__(self, stem: str, path: Path, mask_path: Path | None, cm) -> tuple:
        size, c = self._sizes(path, mask_path)
        for axis, parts in self.splits:  # known from the header: the same on every rank
            n = size[axis]
            if empty_ranks(n, parts)[1]:
                unit = ("slices", "rows", "columns")[axis]
                why = f"{n} {unit} over {parts} ranks leave a rank without any"
                raise self._too_small(path, size, why)
        box = self._box(size)
        try:
            logits = self._logits(path, size, c, box)
        except (SpatialShardingError, RuntimeError) as exc:
            if not is_geometry_error(exc, self.sp):
                raise
            raise self._too_small(path, size, exc) from exc
        piece, failure = None, None
        try:
            piece = self._labels(logits, mask_path, box, cm)
        except Exception as exc:  # noqa: BLE001 - every rank of the group raises in _gather
            failure, piece = exc, {"error": type(exc).__name__, "message": str(exc)}
        parts = _gather(self, piece, failure)
        summary = ""
        if self.rank == 0:
            summary = self._write(stem, size, parts)
        return stem, self.rank, None, summary, (size[-1], size[-1])

    def _labels(self, logits: torch.Tensor, mask_path: Path | None, box, cm) -> tuple:
        """(class indices [d, h, w], probabilities [d, h, w, K] uint8 or None) of the block;
        counts the block's voxels against its mask."""
        cls = logits.argmax(0)
        if mask_path is not None:
            mask = read_box(mask_path, box, mask=True)
            k, ignore = self.cfg.model.num_classes, self.cfg.data.ignore_index
            # rows of the message: D x H flattened; columns: W
            check_mask_values(mask.reshape(-1, mask.shape[-1]), mask_path, k, ignore)
            # as [1, d, h * w] labels: the matrix counts voxels like pixels
            cm.update(cls.reshape(1, cls.shape[0], -1), mask.reshape(1, mask.shape[0], -1))
        dtype = np.uint8 if self.cfg.model.num_classes <= 256 else np.uint16
        probs = None
        if self.probabilities:
            probs = (logits.softmax(0) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
        return cls.numpy().astype(dtype), probs

    def _write(self, stem: str, size, parts: list) -> str:
        """Stitch the blocks along the split axes and write the ``.npy`` outputs."""
        axes, counts = zip(*self.splits, strict=True)
        names = [f"{stem}.npy"]
        np.save(self.out_dir / names[0], stitch_grid([p[0] for p in parts], counts, axes))
        if self.probabilities:
            names.append(f"{stem}_probabilities.npy")
            np.save(self.out_dir / names[1], stitch_grid([p[1] for p in parts], counts, axes))
        along = " x ".join(f"{AXES[axis]}" for axis in axes)
        split = f"split along {along} over {'x'.join(map(str, counts))} rank(s)"
        return f"{'x'.join(map(str, size))} (DxHxW), {split} -> {', '.join(names)}"
