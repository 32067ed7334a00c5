"""Phase 2 of ``run_verify``: the one-device reference steps and the comparison.

A plain copy of the model (plain ``F.cross_entropy`` / Dice on full tensors) is trained on
the FULL images of the same samples with the same augmentation parameters, on every rank
(``reference="all"``) or on rank 0 only (``"rank0"``: it then sends each rank the blocks of
the input and logits matching that rank's strip, and broadcasts gradients, parameters and
buffers). Every rank compares its own part; one all-reduce per step gives the maxima.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from spconv_train.config import Config
from spconv_train.data import make_dp_sampler
from spconv_train.parallel.extend import block_slices
from spconv_train.train.data_feed import load_train_strips
from spconv_train.train.losses import dice_loss_reference
from spconv_train.train.mesh_coords import MeshCoords
from spconv_train.train.optim import build_optimizer, build_scheduler
from spconv_train.train.step import train_step

from ._compare import Check, Collector, floors, max_abs_diff
from ._sharded import StepRecord, autocast, low

__all__ = ["reference_run"]


def _coords_of(mesh, rank: int) -> list[tuple[int, int]]:
    where = (mesh.mesh == rank).nonzero()[0].tolist()
    return [(mesh.size(i), where[i]) for i in range(mesh.ndim)]


def _reference_loss(cfg: Config, device: torch.device):
    """The single-device definition of ``training.loss`` on full tensors."""
    t, ignore = cfg.training, cfg.data.ignore_index
    weight = None if t.class_weights is None else torch.tensor(t.class_weights, device=device)

    def ce(y: Tensor, target: Tensor) -> Tensor:
        w = None if weight is None else weight.to(low(y).dtype)
        return F.cross_entropy(low(y), target, ignore_index=ignore, weight=w)

    def dice(y: Tensor, target: Tensor) -> Tensor:
        return dice_loss_reference(low(y), target, ignore_index=ignore)

    if t.loss == "ce":
        return ce
    if t.loss == "dice":
        return dice
    return lambda y, target: ce(y, target) + dice(y, target)


def _reference_batch(source, cfg: Config, dp: int, epoch: int, position: int):
    """The whole global batch of one training step: the FULL augmented images and masks of
    every data-parallel replica's samples, replica after replica (the batch order of the
    sharded ``[Shard(0), Shard(3)]`` DTensor)."""
    images, masks, bs = [], [], cfg.data.batch_size
    for r in range(dp):
        sampler = make_dp_sampler(len(source), dp=dp, dp_rank=r, seed=cfg.training.seed)
        sampler.set_epoch(epoch)
        indices = list(sampler)[position * bs : (position + 1) * bs]
        image, mask, _ = load_train_strips(source, cfg, MeshCoords(dp, 1, r, 0), epoch, indices)
        images.append(image)
        masks.append(mask)
    return torch.cat(images), torch.cat(masks)


def _send_block(full: Tensor | None, mine: Tensor, placements, mesh, device) -> Tensor:
    """Rank 0 holds the full reference tensor ``full``; every rank gets the block matching
    its own sharded local tensor ``mine`` (rank 0 sends the others theirs, in ``mine``'s
    dtype, which is the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shape = tuple(full.shape)
        for r in range(1, world):
            block = full[block_slices(shape, placements, _coords_of(mesh, r))]
            dist.send(block.to(device, mine.dtype).contiguous(), dst=r)
        return full[block_slices(shape, placements, _coords_of(mesh, 0))]
    buf = torch.empty(mine.shape, dtype=mine.dtype, device=device)
    dist.recv(buf, src=0)
    return buf


def _bcast_dict(values: dict | None, shapes: dict[str, torch.Size], device) -> dict:
    """Rank 0's ``values`` (tensors or None) on every rank, shapes from ``shapes``."""
    names = list(shapes)
    missing = [[n for n in names if values[n] is None] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(missing, src=0)
    present = [n for n in names if n not in missing[0]]
    if dist.get_rank() == 0:
        parts = [values[n].detach().double().flatten().to(device) for n in present]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    else:
        total = sum(shapes[n].numel() for n in present)
        flat = torch.empty(total, dtype=torch.float64, device=device)
    dist.broadcast(flat, src=0)
    out: dict = dict.fromkeys(names)
    offset = 0
    for n in present:
        k = shapes[n].numel()
        out[n] = flat[offset : offset + k].view(shapes[n])
        offset += k
    return out


def _resync(ref: nn.Module, optimizer, rec: StepRecord) -> None:
    """Put the reference into the sharded run's state after step ``rec`` (cast to the
    reference's dtype: the optimizer casts its state to the parameters' dtype)."""
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(rec.params[n])
        for n, b in ref.named_buffers():
            b.copy_(rec.buffers[n])
    optimizer.load_state_dict(rec.optimizer)


class _OneDevice:
    """A plain model trained like the trainer does (loss, clipping, optimizer, schedule)."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device) -> None:
        self.model = model.train()
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.schedule, cfg.training.steps, cfg.optimizer.lr
        )
        self.loss_fn = _reference_loss(cfg, device)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.grad_clip = cfg.optimizer.grad_clip
        self.steps = 0

    def step(self, image: Tensor, mask: Tensor, grad_names, precision: str, device) -> tuple:
        """One training step (the trainer's own ``train_step``): ``(logits, loss, grads
        before clipping, params, buffers)``."""
        grads: dict = {}

        def copy_grads() -> None:  # copies: clipping scales the gradients in place
            for n, p in self.model.named_parameters():
                if n in grad_names:
                    grads[n] = None if p.grad is None else p.grad.detach().clone()

        done = train_step(
            self.model,
            image,
            mask,
            self.loss_fn,
            self.optimizer,
            self.scheduler,
            params=self.trainable,
            grad_clip=self.grad_clip,
            step=self.steps,
            autocast=autocast(precision, device),
            after_backward=copy_grads,
        )
        self.steps += 1
        params = {n: p.detach() for n, p in self.model.named_parameters()}
        logits = done.logits.detach()
        return logits, done.loss, grads, params, dict(self.model.named_buffers())


def _spreads(low: tuple, exact: tuple) -> dict:
    """``{(kind, name): max |low - exact|}`` between two ``_OneDevice.step`` results: the
    one-device run in the training precision and the same step in float64."""
    (logits, loss, grads, params, buffers), (logits64, loss64, grads64, params64, buf64) = (
        low,
        exact,
    )
    out = {
        ("loss", "loss"): abs(loss - loss64),
        ("logits", "logits"): max_abs_diff(logits, logits64),
    }
    for kind, a, b in (
        ("grad", grads, grads64),
        ("param", params, params64),
        ("buffer", buffers, buf64),
    ):
        out.update({(kind, n): max_abs_diff(t, b.get(n)) for n, t in a.items()})
    return out


def reference_run(
    ref, cfg, mesh, device, source, records, tols, reference, precision, resync, noise=False
):
    """Phase 2: the same steps on one device; returns every check (collective). With
    ``resync`` every step from the second on starts from the sharded run's state after the
    previous step, so each step's errors are its own (not amplified by earlier steps).
    With ``noise`` (in the training precision) a float64 copy of the reference runs the
    same steps too, to measure the one-device rounding noise (``_compare.py``)."""
    rank, dp = dist.get_rank(), mesh.size(0)
    me = _coords_of(mesh, rank)
    one = exact = None
    if ref is not None:
        if noise and precision != "fp64":
            exact = _OneDevice(copy.deepcopy(ref).double(), cfg, device)
        one = _OneDevice(ref, cfg, device)
    checks: list[Check] = []
    for step, rec in enumerate(records, 1):
        image = logits = None
        loss, grads, params, buffers, spreads = 0.0, {}, {}, {}, {}
        if one is not None:
            if resync and step > 1:
                for run in (one, exact) if exact is not None else (one,):
                    _resync(run.model, run.optimizer, records[step - 2])
            image, mask = _reference_batch(source, cfg, dp, rec.epoch, rec.position)
            dtype = torch.float64 if precision == "fp64" else image.dtype
            image, mask = image.to(device, dtype), mask.to(device)
            result = one.step(image, mask, rec.grads, precision, device)
            logits, loss, grads, params, buffers = result
            if exact is not None:
                spreads = _spreads(
                    result, exact.step(image.double(), mask, rec.grads, "fp64", device)
                )
        if reference == "rank0":
            image = _send_block(image, rec.input, rec.input_placements, mesh, device)
            if rec.placements:
                logits = _send_block(logits, rec.logits, rec.placements, mesh, device)
            else:  # unsharded output: every rank needs the whole tensor
                logits = _bcast_dict(
                    {"x": logits} if rank == 0 else None, {"x": rec.logits.shape}, device
                )["x"]
            scalar = torch.tensor([loss], dtype=torch.float64, device=device)
            dist.broadcast(scalar, src=0)
            loss = scalar.item()
            shapes = {n: rec.params[n].shape for n in rec.grads}
            grads = _bcast_dict(grads or None, shapes, device)
            params = _bcast_dict(
                params or None, {n: t.shape for n, t in rec.params.items()}, device
            )
            buffers = _bcast_dict(
                buffers or None, {n: t.shape for n, t in rec.buffers.items()}, device
            )
        else:
            image = image[block_slices(tuple(image.shape), rec.input_placements, me)]
            if rec.placements:
                logits = logits[block_slices(tuple(logits.shape), rec.placements, me)]
        col = Collector(step, tols, floors(precision))
        spread = spreads.get  # the ranks without a reference add 0: the all-reduce takes MAX
        col.add("input", "input", rec.input, image)
        col.add(
            "loss",
            "loss",
            torch.tensor(rec.loss),
            torch.tensor(loss),
            spread(("loss", "loss"), 0.0),
        )
        col.add("logits", "logits", rec.logits, logits, spread(("logits", "logits"), 0.0))
        for kind, got, want in (
            ("grad", rec.grads, grads),
            ("param", rec.params, params),
            ("buffer", rec.buffers, buffers),
        ):
            for n in got:
                col.add(kind, n, got[n], want.get(n), spread((kind, n), 0.0))
        checks += col.reduce(device)
    return checks
