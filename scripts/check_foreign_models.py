"""Models we did not write (smp + timm EfficientNet/SE, smp FPN, a pad-and-crop decoder),
sharded at 2 and 3 ranks vs one device in fp64, with a no-gather audit.

``--build-first`` builds the models before seeding, so every rank starts from other
random weights (the harness's workers are not seeded alike): the check then also proves
that ``parallelize`` gives every rank mesh rank 0's state (compared on rank 0, whose
reference is its own model). Before that broadcast existed this mode was ~100 % wrong for
every model (the "tu-efficientnet_b0 finding" of 2026-11-23: only the first five failure
lines were printed, all from the first model).

``--transformers`` checks the transformer models instead, each too slow for the suite
(which runs a smaller case of each): ``verify`` from YAML at 2 and 3 ranks of smp Unet on a
timm Swin encoder, MONAI UNETR and SwinUNETR; MONAI UNETR and SwinUNETR in 3-D split along
W, H and D; smp Segformer on ``mit_b1`` and ``mit_b2``; the other smp architectures that
take ``mit_*`` encoders on ``mit_b0``. Each line says OK or what failed (a refusal with
its message). ``--only WORD`` runs the checks whose label contains WORD.

Run: PYTHONPATH=. python scripts/check_foreign_models.py [--build-first | --transformers]
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


SWIN_UNET = (
    "{encoder_name: tu-swin_tiny_patch4_window7_224, img_size: [64, %d], embed_dim: 8, "
    "depths: [1, 1, 1, 1], num_heads: [1, 1, 1, 1], window_size: 4, "
    "decoder_channels: [16, 16, 8, 8, 8], drop_path_rate: 0.0}"
)
UNETR = "{img_size: [32, %d], feature_size: 4, hidden_size: 32, mlp_dim: 64, num_heads: 2}"
UNETR_3D = (
    "{spatial_dims: 3, img_size: [16, 16, %d], feature_size: 4, hidden_size: 24, mlp_dim: 32, "
    "num_heads: 2, norm_name: instance}"
)
VOLUME = ["data.kind=volume", "data.depth=16", "data.height=16", "model.in_channels=1"]
VIT_DPT = (
    "{encoder_name: tu-vit_tiny_patch16_224, class_token: false, img_size: [32, 112], "
    "embed_dim: 16, num_heads: 2, encoder_depth: 2, decoder_intermediate_channels: [8, 8], "
    "decoder_fusion_channels: 8}"
)
# (label, world, registry name, model.kwargs, overrides); widths uneven at every stage
YAML_CASES = [
    ("verify smp.Unet tu-swin @2", 2, "smp.Unet", SWIN_UNET % 96, ["data.height=64"]),
    ("verify smp.Unet tu-swin @3", 3, "smp.Unet", SWIN_UNET % 128,
     ["data.height=64", "data.width=128"]),
    ("verify monai.UNETR @2", 2, "monai.UNETR", UNETR % 112, ["data.width=112"]),
    ("verify monai.UNETR @3", 3, "monai.UNETR", UNETR % 112, ["data.width=112"]),
    ("verify monai.SwinUNETR @2", 2, "monai.SwinUNETR", None, []),
    ("verify monai.SwinUNETR @3", 3, "monai.SwinUNETR", None, ["data.width=160"]),
    ("verify monai.UNETR 3-D @2", 2, "monai.UNETR", UNETR_3D % 48, [*VOLUME, "data.width=48"]),
    ("verify monai.UNETR 3-D @3", 3, "monai.UNETR", UNETR_3D % 80, [*VOLUME, "data.width=80"]),
    ("verify smp.DPT tu-vit @2", 2, "smp.DPT", VIT_DPT, ["data.width=112"]),
    ("verify smp.DPT tu-vit @3", 3, "smp.DPT", VIT_DPT, ["data.width=112"]),
]  # fmt: skip
# (label, world, kind of tests/test_swin_models.py, H, W[, H x W tiles])
LIBRARY_CASES = [
    ("smp.DPT tu-vit @3", 3, "smp_vit", 32, 80),
    ("smp.Unet tu-swin @3", 3, "smp", 64, 128),
    ("smp.Unet tu-swin tiles 2 x 2 @4", 4, "smp", 64, 96, (2, 2)),
    ("smp.Unet tu-swin rows @2", 2, "smp", 96, 64, (2, 1)),
]
#: labels of the checks expected to be refused with SpatialShardingError naming the op and
#: the module (docs/attention.md, "Models"); every check here runs
REFUSED: set[str] = set()
# (label, world, kind, volume D x H x W, split tensor dim)
VOLUME_CASES = [
    ("UNETR 3-D W @2", 2, "UNETR", (32, 32, 48), 4),
    ("UNETR 3-D H @2", 2, "UNETR", (32, 64, 32), 3),
    ("UNETR 3-D H uneven @2", 2, "UNETR", (32, 48, 32), 3),
    ("UNETR 3-D H uneven @3", 3, "UNETR", (32, 80, 32), 3),
    ("UNETR 3-D W @3", 3, "UNETR", (16, 32, 80), 4),
    ("UNETR 3-D D @3", 3, "UNETR", (80, 16, 16), 2),
    ("SwinUNETR 3-D W @2", 2, "SwinUNETR", (32, 32, 96), 4),
    ("SwinUNETR 3-D H @2", 2, "SwinUNETR", (32, 96, 32), 3),
    ("SwinUNETR 3-D D @2", 2, "SwinUNETR", (96, 32, 32), 2),
]
# the smp architectures that take mit_* encoders (smp 0.6 refuses UnetPlusPlus and
# Linknet; the registry refuses MAnet and DPT for their decoders), small decoders; PAN
# pools the W / 32 map down 8 times more, so it needs images of 256 x 256 and more
MIT_ARCHS = {
    "PSPNet": ("smp.PSPNet", {"psp_out_channels": 16}),
    "DeepLabV3": ("smp.DeepLabV3", {"decoder_channels": 16}),
    "DeepLabV3Plus": ("smp.DeepLabV3Plus", {"decoder_channels": 16}),
    "UPerNet": ("smp.UPerNet", {"decoder_channels": 16}),
}
# (label, world, width, labels, encoder)
MIT_CASES = [
    ("Segformer mit_b1 @2", 2, 96, ("Segformer",), "mit_b1"),
    ("Segformer mit_b2 @2", 2, 96, ("Segformer",), "mit_b2"),
    ("Unet, FPN mit_b1 @2", 2, 96, ("Unet", "FPN"), "mit_b1"),
    ("other architectures mit_b0 @2", 2, 96, tuple(MIT_ARCHS), "mit_b0"),
]
MIT_BATCH = 2  # the pooled branches' BatchNorm needs two values per channel in training


def _outcome(fn, *args) -> list[str]:
    """``fn(*args)``'s failures, or its exception as one failure line."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        return [f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"]


def yaml_check(name: str, kwargs: str | None, overrides: list[str]) -> list[str]:
    import tempfile

    from tests.test_segformer import verify_yaml
    from tests.test_swinunetr import MONAI_YAML, SWINUNETR

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.yaml"
        path.write_text(MONAI_YAML.format(name=name, kwargs=kwargs or SWINUNETR))
        report = verify_yaml(str(path), overrides, 2, True)
    bad = [report["verdict"], *map(str, report["failures"][:5])] if not report["passed"] else []
    moved = report["activation_sized_collectives"]
    return bad + [f"activation-sized collective {c}" for c in moved]


def mit_check(world: int, width: int, labels: tuple[str, ...], encoder: str) -> list[str]:
    import tests.test_segformer as seg

    seg.CASES.update(MIT_ARCHS)
    return seg.mit_checks(world, width, labels, encoder, MIT_BATCH)


def transformer_checks(pool: DistPool, only: str) -> None:
    import time

    from tests.test_monai_3d import volume_failures
    from tests.test_swin_models import model_failures

    jobs = [(c[0], c[1], yaml_check, c[2:]) for c in YAML_CASES]
    jobs += [(c[0], c[1], volume_failures, c[2:]) for c in VOLUME_CASES]
    jobs += [(c[0], c[1], model_failures, c[2:]) for c in LIBRARY_CASES]
    jobs += [(c[0], c[1], mit_check, (c[1], *c[2:])) for c in MIT_CASES]
    for label, world, fn, args in jobs:
        if only not in label:
            continue
        start = time.perf_counter()
        try:
            res = pool.run(world, _outcome, fn, *args)
        except AssertionError as exc:  # a rank died or hung
            res = [[str(exc)[-600:]]]
        bad = sorted({line for rank in res for line in rank})
        took = time.perf_counter() - start
        refused = label in REFUSED and all(b.startswith("SpatialShardingError") for b in bad)
        verdict = "REFUSED as expected" if bad and refused else "FAILED" if bad else "OK"
        print(f"{label}: {verdict} ({took:.0f} s)", flush=True)
        for line in bad[:8]:
            print("   ", line, flush=True)
    if only in "mit grid":
        mit_grid()


def mit_grid() -> None:
    """Every mit_b* encoder in every smp architecture that takes them, built through the
    registry on the meta device (as tests/test_smp_mit_registry.py does for a part)."""
    from unittest import mock

    from segmentation_models_pytorch.encoders import mix_transformer

    from spconv_train.models.smp_models import MIT_ENCODERS, mit_architectures
    from tests.test_smp_mit_registry import built_encoders

    linspace = torch.linspace
    on_cpu = mock.patch.object(torch, "linspace", lambda *a, **k: linspace(*a, device="cpu"))
    no_init = mock.patch.object(mix_transformer, "trunc_normal_", lambda t, **k: t)
    with on_cpu, no_init, torch.device("meta"):
        built = built_encoders(mit_architectures(), MIT_ENCODERS)
    print(f"mit grid: {len(built)} models built ({', '.join(mit_architectures())} on", end=" ")
    print(f"{', '.join(MIT_ENCODERS)})", flush=True)


if __name__ == "__main__":
    pool = DistPool()
    if "--transformers" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
        transformer_checks(pool, only)
        pool.close()
        sys.exit()
    for w in (2, 3):
        res = pool.run(w, run, w, "--build-first" in sys.argv)[0]
        print(
            f"{w} ranks:",
            f"{len(res)} FAILURES" if res else f"OK: exact to {TOL}, nothing gathered",
        )
        for line in res:
            print("  ", line)
    pool.close()
