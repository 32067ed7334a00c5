"""Models we did not write (smp + timm EfficientNet/SE, smp FPN, a pad-and-crop decoder),
sharded at 2 and 3 ranks vs one device in fp64, with a no-gather audit.

``--build-first`` builds the models before seeding, so every rank starts from other
random weights (the harness's workers are not seeded alike): the check then also proves
that ``parallelize`` gives every rank mesh rank 0's state (compared on rank 0, whose
reference is its own model). Before that broadcast existed this mode was ~100 % wrong for
every model (the "tu-efficientnet_b0 finding" of 2026-11-23: only the first five failure
lines were printed, all from the first model).

Run: PYTHONPATH=. python scripts/check_foreign_models.py [--build-first]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spconv_train.parallel import parallelize  # noqa: E402
from tests.dist_harness import DistPool  # noqa: E402
from tests.op_check import check_fn  # noqa: E402
from tests.reference import check_close, seeded  # noqa: E402

TOL = 1e-10


class PadCropDecoder(nn.Module):
    """Valid convs (shrinking), centre-cropped skip, upsample then F.pad to the skip size."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 6, 3)
        self.down = nn.MaxPool2d(2, ceil_mode=True)
        self.mid = nn.Conv2d(6, 6, 3, padding=1)
        self.up = nn.ConvTranspose2d(6, 6, 2, stride=2)
        self.out = nn.Conv2d(12, 2, 1)

    def forward(self, x):
        s = torch.relu(self.enc(x))
        u = self.up(torch.relu(self.mid(self.down(s))))
        dh, dw = s.shape[-2] - u.shape[-2], s.shape[-1] - u.shape[-1]
        u = F.pad(u, [dw // 2, dw - dw // 2, dh // 2, dh - dh // 2])
        return self.out(torch.cat([s[..., 1:-1, 2:-2], u[..., 1:-1, 2:-2]], 1))


def _cases(world: int) -> list:
    wide = (1, 3, 32, 96 + 16 * world)
    return [
        ("smp Unet tu-efficientnet_b0", lambda: smp.Unet(
            "tu-efficientnet_b0", encoder_weights=None, encoder_depth=3,
            decoder_channels=(16, 8, 8), classes=2), wide),
        ("smp FPN resnet18 (no dropout)", lambda: smp.FPN(
            "resnet18", encoder_weights=None, encoder_depth=3, classes=2,
            decoder_dropout=0.0), wide),
        ("pad+crop decoder", PadCropDecoder, (1, 3, 14, 41 + world)),
    ]  # fmt: skip


def _check(label, model, shape, mesh, failures) -> int:
    ref, par = copy.deepcopy(model), parallelize(copy.deepcopy(model), mesh)
    shapes = {tuple(p.shape) for p in par.parameters()}

    def fwd(t):
        return (par if isinstance(t, DTensor) else ref)(t)

    x = seeded(1, *shape, dtype=torch.float64)
    check_fn(fwd, x, mesh, [Shard(3)], label, failures, TOL, shapes)
    compared = 0
    for (name, p), pr in zip(par.named_parameters(), ref.parameters(), strict=True):
        if pr.grad is None or p.grad is None:
            if (pr.grad is None) != (p.grad is None):
                failures.append(f"{label} {name}: gradient None on one side only")
            continue
        compared += 1
        check_close(f"{label} {name}.grad", p.grad, pr.grad, TOL, failures)
    return compared


def run(world: int, build_first: bool) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from spconv_train.parallel import gloo_threads_idle

    torch.set_default_dtype(torch.float64)
    with gloo_threads_idle():  # as a CPU run does (spconv_train/parallel/_comm_threads.py)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    cases = _cases(world)
    built = [make() for _, make, _ in cases] if build_first else [None] * len(cases)
    failures: list[str] = []
    for (label, make, shape), model in zip(cases, built, strict=True):
        torch.manual_seed(0)
        model = (model if model is not None else make()).double().train()
        n = _check(f"{label} @{world}", model, shape, mesh, failures)
        if torch.distributed.get_rank() == 0:
            print(f"{label} @{world}: {n} parameter gradients compared", flush=True)
    return failures


if __name__ == "__main__":
    pool = DistPool()
    for w in (2, 3):
        res = pool.run(w, run, w, "--build-first" in sys.argv)[0]
        print(
            f"{w} ranks:",
            f"{len(res)} FAILURES" if res else f"OK: exact to {TOL}, nothing gathered",
        )
        for line in res:
            print("  ", line)
    pool.close()
