"""From the data package to per-rank DTensor batches.

Every rank of a ``(dp, sp)`` mesh loads only its own column strip
``strip_bounds(W, sp, sp_rank)`` of the samples its data-parallel replica draws, and wraps
it into a DTensor of the global shape (``[Shard(0), Shard(3)]``) without communication.
The target stays the plain local mask strip (what ``losses.py`` expects). Sample order and
augmentation depend only on ``(seed, epoch, index)`` and the global position in the epoch
(``determinism.py``), so a feed restored from ``state_dict`` continues exactly where the
saved one stopped, on any ``(dp, sp)`` layout. On an H x W tile mesh (``parallel.sp: [p, q]``)
every rank loads only its tile (rows too) and the batch is ``[Shard(0), Shard(2), Shard(3)]``
(``MeshCoords.rows`` / ``cols``). Volumes (``data.kind: volume``) take the same
path with blocks along ``parallel.shard_dim``, or over several dims for a grid
``parallel.sp: [d, h, w]`` (``volume_feed.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, Dataset

from spconv_train.config import Config, ConfigError
from spconv_train.data import (
    AugmentParams,
    DataError,
    FolderDataset,
    SegmentationSource,
    SyntheticDataset,
    VolumeFolder,
    VolumeSource,
    load_strip,
)
from spconv_train.data.augment_feed import load_planned_strips
from spconv_train.data.prepare import prepare_splits
from spconv_train.parallel import ParallelDims
from spconv_train.train.bad_samples import agree_on_failures, training_failure
from spconv_train.train.determinism import epoch_order, replica_steps
from spconv_train.train.mesh_coords import MeshCoords, to_dtensor
from spconv_train.train.val_check import image_grid
from spconv_train.train.val_items import ValItem, make_val_item
from spconv_train.train.volume_feed import (
    load_train_blocks,
    spatial_placements,
    volume_sources,
    volume_val_items,
)

__all__ = [
    "Batch",
    "MeshCoords",
    "TrainFeed",
    "build_sources",
    "load_train_strips",
    "to_dtensor",
    "val_items",
]


def build_sources(cfg: Config) -> tuple[SegmentationSource, SegmentationSource, list[str]]:
    """Train and validation sources plus the class names, checked up front.

    Folder data is validated whole (``validate_all``: readable files, sizes, mask values);
    the image channels must equal ``model.in_channels``. Raises ``DataError`` naming the
    file or ``ConfigError`` naming the key.
    """
    d, m = cfg.data, cfg.model
    if d.kind == "volume":
        train, val = volume_sources(cfg)
    elif d.source == "synthetic":
        kw = dict(
            height=d.height,
            width=d.width,
            num_classes=m.num_classes,
            seed=d.synthetic_seed,
            in_channels=m.in_channels,
            ignore_index=d.ignore_index,
        )
        train = SyntheticDataset(d.num_train, **kw)
        val = SyntheticDataset(d.num_val, offset=d.num_train, **kw)
    else:
        kw = dict(
            num_classes=m.num_classes,
            ignore_index=d.ignore_index,
            split_list=d.split_list,
            class_names=d.class_names,
            on_bad_sample=d.on_bad_sample,
            level=d.level,
            max_image_pixels=d.max_image_pixels,
            normalize=d.normalize,
        )
        train = FolderDataset(d.root, d.train_split, **kw)
        val = FolderDataset(d.root, d.val_split, **kw)
        piece = {"grid": image_grid(cfg), "crop": (d.height, d.width)}  # sizes checked first
        dataset_range = prepare_splits(train, val, cfg.run_dir, **piece)  # cached in run_dir
        if dataset_range is not None:  # stored in the resolved config, for predict
            d.normalize.stats = [list(r) for r in dataset_range]
    for source in (train, val):
        if len(source) == 0:
            raise DataError(f"no samples in the {'train' if source is train else 'val'} split")
        if source.channels(0) != m.in_channels:
            raise ConfigError(
                "model.in_channels",
                f"is {m.in_channels} but the images have {source.channels(0)} channels "
                f"(e.g. {source.name(0)})",
            )
    names = list(d.class_names or getattr(train, "class_names", None) or [])
    if len(names) != m.num_classes:
        names = [f"class_{k}" for k in range(m.num_classes)]
    return train, val, names


@dataclass
class Batch:
    """One training step's input on this rank."""

    image: DTensor  # global [B * dp, C, H, W], [Shard(0), Shard(3)] (volumes: 5-D, Shard(2+axis))
    target: Tensor  # local mask strip [B, H, w]
    pixels: int  # pixels of the global batch (for throughput)
    samples: tuple[int, ...] = ()  # this replica's sample indices (error messages)


def load_train_strips(
    source: SegmentationSource, cfg: Config, coords: MeshCoords, epoch: int, indices: list[int]
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """This rank's strips of the samples ``indices`` augmented for ``epoch`` (crop, flips,
    scale, ``data.augment``, class oversampling: ``data.augment_feed``), and the global
    (H, W) of the augmented samples ((D, H, W) blocks of volumes: ``load_train_blocks``)."""
    if isinstance(source, VolumeSource):
        return load_train_blocks(source, cfg, coords, epoch, indices)
    return load_planned_strips(source, cfg, coords, epoch, indices)


class _BatchTask(Dataset):
    """Item ``k`` = batch ``k`` of an epoch, as this rank's strips. Holds only picklable
    state, since it runs in DataLoader workers when ``data.num_workers > 0``."""

    def __init__(
        self,
        source: SegmentationSource,
        cfg: Config,
        coords: MeshCoords,
        epoch: int,
        batches: list[list[int]],
    ) -> None:
        self.source, self.cfg, self.coords = source, cfg, coords
        self.epoch, self.batches = epoch, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> tuple:
        """``(image, mask, hw, [])``, or ``(None, None, None, [(file, reason)])`` when this
        rank cannot load its strips (every rank must learn of it: see ``bad_samples``)."""
        try:
            batch = load_train_strips(
                self.source, self.cfg, self.coords, self.epoch, self.batches[k]
            )
        except DataError as e:
            return None, None, None, [(e.path or "?", e.reason)]
        return (*batch, [])


class TrainFeed:
    """Endless iterator of training batches for this rank; epochs follow each other.

    ``state_dict()`` holds ``(epoch, offset)``: how many samples of the epoch's global order
    the whole mesh has consumed. It is the same on every rank and means the same on every
    layout, so a restored feed yields, from the same sample on, the batches of an
    uninterrupted run at its own ``(dp, sp)`` (step for step when ``dp`` is unchanged).
    """

    def __init__(
        self,
        source: SegmentationSource,
        cfg: Config,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        self.source, self.cfg, self.mesh, self.device = source, cfg, mesh, device
        self.coords = MeshCoords.of(mesh)
        self.batch_size = cfg.data.batch_size
        # offset: samples of the epoch's global order consumed by the whole mesh;
        # position: batches this rank handed out in the epoch (verify's step records).
        self.epoch, self.offset, self.position = 0, 0, 0
        d = cfg.data
        self.fixed_size = d.height is not None and d.width is not None
        # Files skipped while iterating, drained by the training loop (``pop_skipped``).
        self.skipped: list[tuple[str, str]] = []
        self._known_bad: set[str] = set()

    def state_dict(self) -> dict[str, int]:
        """The data position, rank- and layout-independent: the epoch and the number of
        samples of its global order consumed."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by ``state_dict`` on any layout.

        The per-rank ``{"epoch", "position"}`` of format-1 checkpoints counted this
        replica's batches; the checkpoint layer only lets those load on the world size they
        were saved with, where ``dp`` is the same as now.
        """
        self.epoch = int(state["epoch"])
        if "offset" in state:
            self.offset = int(state["offset"])
        else:
            self.offset = int(state["position"]) * self.batch_size * self.coords.dp
        self.offset = min(self.offset, len(self.source))
        self.position = -(-self.offset // (self.batch_size * self.coords.dp))

    def _epoch_steps(self) -> list[tuple[list[int], int]]:
        order = epoch_order(len(self.source), self.cfg.training.seed, self.epoch)
        c = self.coords
        return replica_steps(order, self.offset, self.batch_size, c.dp, c.dp_rank)

    def _loader(self, task: _BatchTask) -> Iterator:
        if self.cfg.data.num_workers == 0:
            return (task[k] for k in range(len(task)))
        loader = DataLoader(
            task,
            batch_size=None,
            sampler=range(len(task)),
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        # Starting the workers draws a seed from the global generator: leave it untouched,
        # so that the step's RNG (seeded by step) does not depend on where an epoch started.
        with torch.random.fork_rng(devices=[]):
            return iter(loader)

    def _check_same_size(self, hw: tuple[int, int]) -> None:
        """Without a fixed crop, data-parallel replicas may draw images of different sizes,
        which cannot form one global batch: detect it (one tiny all-gather) and say why."""
        if self.fixed_size or self.coords.dp == 1:
            return
        sizes: list = [None] * self.coords.dp
        dist.all_gather_object(sizes, hw, group=self.mesh.get_group(ParallelDims.DP))
        if len(set(sizes)) > 1:
            raise DataError(
                f"data-parallel replicas drew images of different sizes {sizes} (HxW) for one "
                "step; set data.height and data.width (a crop size) when parallel.sp is "
                "smaller than the world size"
            )

    def _to_batch(self, image: Tensor, mask: Tensor, hw: tuple, samples: list[int]) -> Batch:
        self._check_same_size(hw)
        b, c = image.shape[:2]
        shape = (b * self.coords.dp, c, *hw)
        non_blocking = self.device.type == "cuda"
        local = image.to(self.device, non_blocking=non_blocking)
        spatial = spatial_placements(self.cfg, self.coords)
        x = to_dtensor(local, self.mesh, [Shard(0), *spatial], shape)
        target = mask.to(self.device, non_blocking=non_blocking)
        return Batch(x, target, shape[0] * math.prod(hw), tuple(samples))

    def pop_skipped(self) -> list[tuple[str, str]]:
        """``(file, reason)`` of the files first skipped since the last call."""
        out, self.skipped = self.skipped, []
        return out

    def _skip(self, failures: list[tuple[str, str]], in_a_row: int, per_epoch: int) -> None:
        """Every rank together: skip the batch (remember new bad files) or raise."""
        if self.cfg.data.on_bad_sample != "skip":
            raise training_failure(failures)
        if in_a_row > per_epoch:
            raise DataError(
                f"every training batch of a whole epoch had a bad sample (last: "
                f"{failures[0][0]}: {failures[0][1]})",
                path=failures[0][0],
            )
        new = [(f, r) for f, r in failures if f not in self._known_bad]
        self._known_bad.update(f for f, _ in new)
        self.skipped += new

    def __iter__(self) -> Iterator[Batch]:
        # Folder data can fail to load on some rank only; every rank must then agree.
        agree = isinstance(self.source, (FolderDataset, VolumeFolder))
        in_a_row = 0
        while True:
            steps = self._epoch_steps()
            batches = [indices for indices, _ in steps]
            task = _BatchTask(self.source, self.cfg, self.coords, self.epoch, batches)
            for (image, mask, hw, failed), (indices, offset) in zip(
                self._loader(task), steps, strict=True
            ):
                # counted before handing out: the state is what has been consumed
                self.offset, self.position = offset, self.position + 1
                failed = agree_on_failures(failed, self.device) if agree else failed
                if failed:  # on every rank together: the whole step's batch is skipped
                    in_a_row += 1
                    self._skip(failed, in_a_row, len(steps))
                    continue
                in_a_row = 0
                yield self._to_batch(image, mask, hw, indices)
            self.epoch, self.offset, self.position = self.epoch + 1, 0, 0


def val_items(
    source: SegmentationSource,
    cfg: Config,
    coords: MeshCoords,
    sp_mesh: DeviceMesh,
    device: torch.device,
) -> Iterator[ValItem]:
    """Every validation image once, un-augmented: image ``i`` on replica ``i % dp``.

    The image lives on the ``sp`` sub-mesh (its collectives stay inside the spatial group),
    so replicas may see images of different sizes and counts; in eval mode nothing talks
    across replicas until the metrics are reduced. A piece that fails to load: ``failure``.
    """
    if isinstance(source, VolumeSource):
        yield from volume_val_items(source, cfg, coords, sp_mesh, device)
        return
    ignore, placements = cfg.data.ignore_index, coords.spatial_placements
    for index in range(coords.dp_rank, len(source), coords.dp):
        params = AugmentParams.identity(source.size(index))
        h, w = params.out_hw
        cols, rows = coords.cols(w), coords.rows(h) if coords.tiled else None
        try:
            image, mask = load_strip(source, index, cols, params, ignore_index=ignore, rows=rows)
        except DataError as e:  # its other ranks may have loaded theirs: validate() agrees
            yield ValItem(index, None, None, cols, rows, failure=(e.path or "?", e.reason))
            continue
        yield make_val_item(index, image, mask, (h, w), sp_mesh, placements, device, cols, rows)
