"""A sweep of models we did not write (timm encoders in smp decoders, MONAI 2-D nets),
sharded at 2 and 3 ranks on uneven W strips vs one device in fp64, with the no-gather audit.

Each case is built from a seed (the same weights on every rank), run in train mode on a
batch of 2 (BatchNorm after a global pool needs two values per channel), dropout off and
the same seed drawn before both forwards (stochastic depth draws the same masks); output
and every parameter gradient are compared (``tests/op_check.py``, ``check_strip_model``).
Widths are uneven at every stride: ``unit * (4 * world + 1)`` columns, ``unit`` the
encoder's total stride (and any window size it needs). One line per case and world size:

- ``OK``: exact to ``TOL``, no activation-sized collective;
- ``WRONG``: a value or gradient differs (the largest relative error, the first failure);
- ``GATHER``: values exact, but a collective over the audit's size ran (which, its shape)
  and grows with the image: a case so flagged runs again a few columns wider, and the
  collectives that run there again with the same op and shape are image-independent, not
  gathers (``spconv_train/parallel/_step_meters.py``, ``grows_with_image``);
- ``REFUSED``: ``SpatialShardingError`` with its message (a gather refused included);
- ``CRASH``: any other exception (type and message).

The table in ``docs/models.md`` is this script's output. ``--only WORD`` runs the cases whose
label contains WORD (``--only A,B``: any of them); ``--world N`` one world size.

Run: PYTHONPATH=. python scripts/sweep_foreign_models.py [--only WORD] [--world N]
"""

from __future__ import annotations

import ast
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.check_foreign_models import _outcome  # noqa: E402
from spconv_train.parallel import CommAudit  # noqa: E402
from spconv_train.parallel._step_meters import CommRecord, grows_with_image  # noqa: E402
from tests.dist_harness import DistPool, mesh  # noqa: E402
from tests.op_check import check_strip_model  # noqa: E402
from tests.reference import dropout_off, seeded  # noqa: E402

TOL = 1e-9
BATCH = 2


def _smp(arch: str, encoder: str, depth: int = 3, **kwargs):
    """An smp ``arch`` on the timm (``tu-``) or smp ``encoder``, random init, small decoder."""
    import segmentation_models_pytorch as smp

    if arch in ("Unet", "UnetPlusPlus"):
        kwargs.setdefault("decoder_channels", (8,) * depth)
    return getattr(smp, arch)(
        encoder, encoder_weights=None, encoder_depth=depth, classes=2, **kwargs
    )


def _monai(name: str, **kwargs):
    """A MONAI network in 2-D with 3 input channels and 2 classes."""
    from monai.networks import nets

    kwargs = {"spatial_dims": 2, "in_channels": 3, "out_channels": 2, **kwargs}
    return getattr(nets, name)(**kwargs)


def _tu(name: str, unit: int = 8, h: int = 32, depth: int = 3, arch: str = "Unet", **kw):
    return (f"smp {arch} tu-{name}", lambda: _smp(arch, f"tu-{name}", depth, **kw), h, unit)


# (label, builder, H, unit of W); timm models through smp's ``tu-`` encoders
CASES = [
    _tu("resnest14d"),  # split attention (grouped convs, radix softmax over a global pool)
    _tu("res2net50_14w_8s"),  # hierarchical channel splits
    _tu("regnety_002"),  # squeeze-excitation
    _tu("densenet121"),  # dense concatenation, avg-pool transitions
    # the timm EfficientNet family runs every stage whatever the depth: W / 32 >= 2 columns
    _tu("mobilenetv3_small_100", unit=32),  # hard-swish, SE with hard-sigmoid
    _tu("efficientnetv2_rw_t", unit=32),  # fused MBConv
    _tu("ghostnet_100"),  # ghost modules (cheap depthwise features), SE
    _tu("dpn68"),  # dual path (split residual / dense)
    _tu("hrnet_w18_small", unit=32),  # parallel branches fused by strided convs + upsampling
    _tu("xception41"),  # separable convs, strided separable convs
    _tu("mobilevit_xxs"),  # unfold into patches, transformer over patches, fold
    _tu("edgenext_xx_small"),  # split depthwise transposed attention (XCA)
    _tu("poolformer_s12"),  # avg-pool token mixer, GroupNorm(1)
    _tu("caformer_s18"),  # conv token mixer then attention at stride 16
    _tu("fastvit_t8"),  # reparameterisable blocks, large-kernel depthwise conv
    _tu("coatnet_nano_rw_224"),  # MBConv stages, relative-position attention at stride 16
    _tu("maxvit_pico_rw_256", unit=64, h=64),  # block + grid attention (window 8)
    _tu("repvit_m1"),  # reparameterised depthwise convs
    _tu("mobileone_s0"),  # over-parameterised branches
    _tu("lcnet_050", unit=32),  # hard-swish, 5x5 depthwise
    _tu("hgnetv2_b0"),  # light ConvBNAct stacks, learnable affine, stem with F.pad
    _tu("convnextv2_atto"),  # global response norm (an L2 norm over H x W)
    _tu("inception_next_atto"),  # 1 x 11 and 11 x 1 band depthwise kernels
    _tu("efficientvit_b0"),  # ReLU linear attention over all tokens, multi-scale tokens
    _tu("davit_tiny"),  # channel attention over all tokens, window attention
    _tu("efficientformerv2_s0"),  # pooling mixer, attention with a learned bias at stride 16
    _tu("rexnet_100"),  # SE, ReLU6 on part of the channels
    _tu("ese_vovnet19b_dw"),  # one-shot aggregation, effective SE
    _tu("cspresnet50"),  # cross-stage partial splits
    _tu("nf_regnet_b0"),  # weight standardisation (no norm layers), scaled activations
    _tu("mambaout_femto"),  # gated 7x7 depthwise CNN
    _tu("starnet_s1"),  # element-wise product of two branches
    _tu("fasternet_t0"),  # partial convolution (a slice of the channels)
    _tu("tiny_vit_5m_224"),  # window attention with padding at stride 16
    _tu("resnetv2_50x1_bit"),  # StdConv2d (weight standardisation), pre-activation
    _tu("skresnet18"),  # selective kernel (softmax over branches of a global pool)
    _tu("regnety_002", arch="UnetPlusPlus"),  # nested dense skip decoder
    _tu("regnety_002", unit=32, h=256, depth=5, arch="PAN", decoder_channels=8),
    _tu("mobilenetv3_small_100", unit=32, depth=5, arch="Linknet"),
    ("monai BasicUNet", lambda: _monai("BasicUNet", features=(4, 4, 8, 8, 16, 4)), 32, 16),
    ("monai UNet residual units", lambda: _monai(
        "UNet", channels=(4, 8, 16), strides=(2, 2), num_res_units=2), 32, 4),
    ("monai SegResNet", lambda: _monai(
        "SegResNet", init_filters=8, blocks_down=(1, 2, 2), blocks_up=(1, 1)), 32, 4),
    ("monai DynUNet", lambda: _monai(
        "DynUNet", kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
        filters=[4, 8, 16], res_block=True), 32, 4),
    ("monai AttentionUnet", lambda: _monai(
        "AttentionUnet", channels=(4, 8, 16), strides=(2, 2)), 32, 4),
    ("monai FlexibleUNet efficientnet-b0", lambda: _monai(
        "FlexibleUNet", backbone="efficientnet-b0", pretrained=False,
        decoder_channels=(16, 8, 8, 8, 8)), 32, 32),
    ("monai VNet", lambda: _monai(
        "VNet", in_channels=1, dropout_prob_down=0.0, dropout_prob_up=(0.0, 0.0)), 32, 16),
    ("monai HighResNet", lambda: _monai("HighResNet"), 32, 8),
]  # fmt: skip
LABELS = {c[0]: c for c in CASES}
_REL = re.compile(r"relative error ([0-9.e+-]+)")
#: the start of a line naming a flagged collective that the wider run repeated
CLEARED = "image-independent: "
_MOVED = re.compile(r"gathered activation: (\S+) (\([0-9, ]*\))")


def width(unit: int, world: int) -> int:
    """Uneven strips at every stride: ``4 * world + 1`` units of ``unit`` columns."""
    return unit * (4 * world + 1)


def verdict(failures: list[str]) -> tuple[str, str]:
    """The sweep line's verdict and detail from ``check_case``'s failures (or one exception
    line from ``_outcome``); ``OK`` lists the image-independent collectives it cleared."""
    notes = Counter(f[len(CLEARED) :] for f in failures if f.startswith(CLEARED))
    failures = [f for f in failures if not f.startswith(CLEARED)]
    if not failures:
        listed = "; ".join(f"{n} x {what}" for what, n in sorted(notes.items()))
        return "OK", f"{CLEARED}{listed}" if notes else ""
    first = failures[0]
    if first.startswith("SpatialShardingError"):
        return "REFUSED", first
    if re.match(r"^\w+(Error|Exception|Interrupt)\b", first) and ": " in first:
        return "CRASH", first
    moved = sorted({f.split(": ", 1)[1] for f in failures if "gathered activation" in f})
    wrong = [f for f in failures if "gathered activation" not in f]
    if not wrong:
        return "GATHER", "; ".join(moved)
    errs = [float(m.group(1)) for f in wrong if (m := _REL.search(f))]
    worst = f"max rel err {max(errs):.3g}; " if errs else ""
    return "WRONG", f"{worst}{len(wrong)} failures, first: {wrong[0]}"


def strip_check(build, h: int, w: int, world: int, **check) -> list[str]:
    """``check_strip_model`` of the model ``build()`` on a batch of ``h x w`` images at
    ``world`` ranks (``check``: its options); its failure lines."""
    torch.manual_seed(0)  # the same weights on every rank
    model = dropout_off(build()).double().train()
    in_ch = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    x = seeded(1, BATCH, in_ch, h, w, dtype=torch.float64)

    def gy(shape):
        return seeded(5, *shape, dtype=torch.float64)

    return check_strip_model(model, x, gy, mesh(world), world, traffic=None, tol=TOL, **check)


def _flagged(lines: list[str]) -> list[CommRecord]:
    """The collectives ``check_strip_model``'s "gathered activation" lines name."""
    found = (_MOVED.search(line) for line in lines)
    shapes = [(m.group(1), ast.literal_eval(m.group(2))) for m in found if m]
    return [CommRecord(op, "gather", math.prod(shape), shape) for op, shape in shapes]


def two_width_check(
    build, h: int, w: int, wider: int, world: int, cleared: list[str] | None = None, **check
) -> list[str]:
    """``strip_check`` at width ``w``; where its only failures are activation-sized
    collectives (on any rank), the same check at width ``wider`` under a ``CommAudit``,
    and the lines of the collectives that run there again with the same op and shape
    dropped (they do not grow with the image: ``_step_meters.grows_with_image``), each
    added to ``cleared`` as ``CLEARED`` + op and shape; the wider check's other failures are
    kept, prefixed with its width."""
    lines = strip_check(build, h, w, world, **check)
    only_moved = bool(lines) and all(_MOVED.search(line) for line in lines)
    flag = torch.tensor([float(only_moved)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank runs the wider check, or none
    if not flag.item():
        return lines
    with CommAudit() as audit:
        wider_lines = strip_check(build, h, wider, world, **check)
    flagged = {(r.op, r.shape) for r in _flagged(lines)}
    grown = {(r.op, r.shape) for r in grows_with_image(_flagged(lines), audit.records)}
    # the wider run's own failures count: a wrong value, or a collective flagged there
    # that the first width did not run with that op and shape (it grew with the image)
    kept = [
        f"at width {wider}: {line}"
        for line in wider_lines
        if not _MOVED.search(line) or any((r.op, r.shape) not in flagged for r in _flagged([line]))
    ]
    for line in lines:
        found = _flagged([line])
        if found and not any((r.op, r.shape) in grown for r in found):
            if cleared is not None:
                cleared.append(CLEARED + line.split(": ", 1)[1])
        else:
            kept.append(line)
    return kept


def check_case(world: int, label: str) -> list[str]:
    """``two_width_check`` of one case at ``world`` ranks, widths ``width`` and ``world``
    units more (the odd factor changed, strips still uneven); its failure lines."""
    _, build, h, unit = LABELS[label]
    w, cleared = width(unit, world), []
    return two_width_check(build, h, w, w + unit * world, world, cleared) + cleared


def sweep(pool: DistPool, worlds: tuple[int, ...], only: str) -> list[tuple]:
    """Run every case (label containing a comma-separated word of ``only``) at every world
    size; print and return ``(label, world, verdict, detail, seconds)`` rows."""
    rows = []
    for label, *_ in CASES:
        if not any(word in label for word in only.split(",")):
            continue
        for world in worlds:
            start = time.perf_counter()
            try:
                res = pool.run(world, _outcome, check_case, world, label)
                lines = next((r for r in res if r), [])
            except AssertionError as exc:  # a rank died or hung
                lines = [f"RankFailure: {' '.join(str(exc).split())[-400:]}"]
            kind, detail = verdict(lines)
            took = time.perf_counter() - start
            rows.append((label, world, kind, detail, took))
            print(f"{label} @{world}: {kind} ({took:.0f} s) {detail[:300]}", flush=True)
    return rows


if __name__ == "__main__":
    args = sys.argv
    only = args[args.index("--only") + 1] if "--only" in args else ""
    worlds = (int(args[args.index("--world") + 1]),) if "--world" in args else (2, 3)
    pool = DistPool()
    try:
        sweep(pool, worlds, only)
    finally:
        pool.close()
