"""Review of the second cut of pooling / resize / norms: the cases no other test covered.

The routes only reached by name (``torch._C._nn`` pools, ``torch.group_norm``, ``stride=[]``),
the resize tables of one output size reached by ``size``, by ``scale_factor`` and by a
recomputed scale in one process (one cache key per resized dim), the norms' refusals in
torch's order with the route's name, channels-last volumes through every norm, and every
spatial pool / resize / norm class found by its name (pickle) and on every route."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded

F64 = torch.float64
CL3 = torch.channels_last_3d
_nn = torch._C._nn

#: every torch function the pooling and norm modules route (by the module's own names)
ROUTES = [
    getattr(ns, f"{name}{n}d{tail}")
    for n in (2, 3)
    for ns, name, tail in (
        (F, "max_pool", ""), (torch, "max_pool", ""), (F, "max_pool", "_with_indices"),
        (_nn, "max_pool", "_with_indices"), (F, "avg_pool", ""), (F, "adaptive_avg_pool", ""),
        (_nn, "adaptive_avg_pool", ""), (F, "adaptive_max_pool", ""),
        (F, "adaptive_max_pool", "_with_indices"), (_nn, "adaptive_max_pool", ""),
    )  # fmt: skip
] + [F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm, F.group_norm,
     torch.group_norm, F.interpolate]  # fmt: skip

#: (module, class names) of the spatial classes the cut builds in loops or moved
CLASSES = {
    "spconv_train.parallel._pool": [
        f"Spatial{kind}Pool{n}d" for n in (2, 3) for kind in ("Max", "Avg", "AdaptiveMax",
                                                              "AdaptiveAvg")
    ],
    "spconv_train.parallel._norm": [
        "SpatialBatchNorm2d", "SpatialBatchNorm3d", "SpatialSyncBatchNorm", "SpatialGroupNorm",
        "SpatialInstanceNorm2d", "SpatialInstanceNorm3d",
    ],
    "spconv_train.parallel._interpolate": ["SpatialUpsample", "SpatialUpsamplingNearest2d",
                                           "SpatialUpsamplingBilinear2d"],
}  # fmt: skip


def test_classes_by_name_and_every_route_registered():
    """Each spatial class is its module's attribute of its own name (pickle finds it), a
    subclass of the torch class; every route has a handler."""
    import importlib

    from spconv_train.parallel._mode import install
    from spconv_train.parallel._runtime import DEFAULT_REGISTRY

    install()
    for module, names in CLASSES.items():
        mod = importlib.import_module(module)
        for name in names:
            cls = getattr(mod, name)
            assert (cls.__name__, cls.__qualname__, cls.__module__) == (name, name, module)
            assert pickle.loads(pickle.dumps(cls)) is cls, name
            assert issubclass(cls, getattr(nn, name.removeprefix("Spatial"))), name
    missing = [fn.__name__ for fn in ROUTES if DEFAULT_REGISTRY.handler(fn) is None]
    assert not missing, missing


class _GroupNormTorch(nn.Module):
    """``torch.group_norm`` (the route no other test calls) with its own affine."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(seeded(3, 6, dtype=F64) + 1)
        self.b = nn.Parameter(seeded(4, 6, dtype=F64))

    def forward(self, x):
        return torch.group_norm(x, 3, self.w, self.b, 1e-4, False)


class _ChannelsLast3d(nn.Module):
    """``norm`` of the channels-last copy of a volume (locally channels-last when sharded)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x):
        x = x.contiguous(memory_format=CL3)
        local = x.to_local() if isinstance(x, DTensor) else x
        assert local.is_contiguous(memory_format=CL3) and not local.is_contiguous()
        return self.norm(x)


def _resizes() -> dict[str, dict]:
    """One output width (10 of 7, 4 of 7) reached by size, scale and a recomputed scale:
    different source tables behind the same output size."""
    cases = {}
    for out, sf in ((10, 1.5), (4, 0.6)):
        for mode, ac in (("nearest", None), ("nearest-exact", None), ("bilinear", False),
                         ("bilinear", True), ("bilinear", None), ("area", None)):  # fmt: skip
            geoms = (dict(size=(5, out)), dict(scale_factor=(1.0, sf)),
                     dict(scale_factor=(1.0, sf), recompute_scale_factor=True))  # fmt: skip
            for g in geoms:
                cases[f"{mode} align={ac} {g}"] = dict(mode=mode, align_corners=ac, **g)
    return cases


def pool_resize_norm_cases(world: int) -> list[str]:
    """fp64 against one device (values, every gradient, no gather) on uneven strips."""
    dmesh, failures = mesh(world), []
    x = seeded(1, 2, 6, 5, 4 * world - 1, dtype=F64)  # 2 ranks: 4 + 3 columns
    fns = {
        "_nn.adaptive_avg_pool2d": lambda t: _nn.adaptive_avg_pool2d(t, (4, 3)),
        "_nn.adaptive_max_pool2d": lambda t: _nn.adaptive_max_pool2d(t, (2, 3)),
        "_nn.adaptive_max_pool2d global": lambda t: _nn.adaptive_max_pool2d(t, 1),
        "_nn.max_pool2d_with_indices": lambda t: _nn.max_pool2d_with_indices(t, 3, 2, 1, 1, True),
        "F.max_pool2d stride=[]": lambda t: F.max_pool2d(t, 2, []),
        "F.avg_pool2d stride=[]": lambda t: F.avg_pool2d(t, 3, [], 1, True, False),
    }
    for name, fn in fns.items():
        check_fn(fn, x, dmesh, [Shard(3)], name, failures)
    for name, kw in _resizes().items():  # one process: a merged cache key would show
        for pl in ([Shard(3)], [Replicate()]):
            fn = lambda t, kw=kw: F.interpolate(t, **kw)  # noqa: E731
            check_fn(fn, x, dmesh, pl, f"{name} {pl}", failures)
    check_module(_GroupNormTorch(), x, dmesh, [Shard(3)], "torch.group_norm", failures)
    v = seeded(2, 2, 6, 5, 3, 2 * world + 1, dtype=F64)  # D 3 + 2, W 3 + 2
    eval_bn = nn.BatchNorm3d(6).double()
    with torch.no_grad():
        eval_bn.running_mean.copy_(seeded(5, 6, dtype=F64))
        eval_bn.running_var.copy_(seeded(6, 6, dtype=F64).abs() + 0.5)
    norms = (nn.BatchNorm3d(6, momentum=None), nn.GroupNorm(3, 6), eval_bn.eval(),
             nn.InstanceNorm3d(6, affine=True, track_running_stats=True))  # fmt: skip
    for norm in norms:
        for dim in (2, 4):
            model = _ChannelsLast3d(norm.double())
            check_module(model, v, dmesh, [Shard(dim)], f"CL3 {norm} Shard({dim})", failures)
    return failures


def test_pool_resize_norm_cases(dist_pool):
    failures = dist_pool.run(2, pool_resize_norm_cases, 2)[0]
    assert not failures, "\n".join(failures[:40])


def refusals(world: int) -> None:
    """The norms check as torch does (channels divisible by num_groups first, then each
    per-channel tensor, named), the pools refuse volume indices; each names its route."""
    dmesh = mesh(world)
    xs = distribute_tensor(seeded(1, 2, 6, 5, 7, dtype=F64), dmesh, [Shard(3)])
    vs = distribute_tensor(seeded(2, 2, 6, 4, 3, 5, dtype=F64), dmesh, [Shard(2)])
    one, five = torch.ones(6, dtype=F64), torch.ones(5, dtype=F64)
    cases = [
        (
            RuntimeError,
            "F.group_norm: Expected number of channels in input to be divisible",
            lambda: F.group_norm(xs, 4, five),
        ),
        (
            ValueError,
            "F.group_norm: weight has 5 elements for 6 channels",
            lambda: F.group_norm(xs, 3, five),
        ),
        (
            ValueError,
            "F.group_norm: bias has 5 elements",
            lambda: torch.group_norm(xs, 3, one, five),
        ),
        (
            ValueError,
            "F.batch_norm: mean has 5 elements",
            lambda: F.batch_norm(xs, five, one, training=True),
        ),
        (ValueError, "F.batch_norm: var has 5 elements", lambda: F.batch_norm(xs, one, five)),
        (
            ValueError,
            "torch.batch_norm: weight has 5",
            lambda: torch.batch_norm(xs, five, None, None, None, True, 0.1, 1e-5, False),
        ),
        (ValueError, "F.instance_norm: weight has 5", lambda: F.instance_norm(xs, weight=five)),
        (
            ValueError,
            "torch.instance_norm: bias has 5",
            lambda: torch.instance_norm(xs, None, five, None, None, True, 0.1, 1e-5, False),
        ),
        (
            SpatialShardingError,
            "F.max_pool3d: return_indices",
            lambda: F.max_pool3d_with_indices(vs, 2),
        ),
        (
            SpatialShardingError,
            "F.max_pool3d: return_indices",
            lambda: _nn.max_pool3d_with_indices(vs, 2, 2, 0, 1, False),
        ),
        (
            SpatialShardingError,
            "F.adaptive_max_pool3d: return_indices",
            lambda: _nn.adaptive_max_pool3d(vs, 2),
        ),
        # stride 0 is no default stride: torch refuses it (as the modules' stride=0)
        (RuntimeError, "stride should not be zero", lambda: F.max_pool2d(xs, 2, 0)),
        (RuntimeError, "stride should not be zero", lambda: F.avg_pool2d(xs, 2, 0)),
        (RuntimeError, "stride should not be zero", lambda: F.max_pool3d(vs, 2, 0)),
        (RuntimeError, "stride should not be zero", lambda: nn.AvgPool3d(2, 0)(vs)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message.replace(".", r"\.")), SpatialMode():
            call()


def test_refusals_in_torch_order_name_the_route(dist_pool):
    dist_pool.run(2, refusals, 2)


def test_cl_format_is_channels_last_of_4d_and_5d_only():
    """The layouts on which CUDA's bf16 batch norm takes the fused kernels (``_fused``) and
    its backward's ``dy`` is laid out: channels-last 4-D and 5-D tensors, nothing else."""
    from spconv_train.parallel._norm_stats import _cl_format

    cl, t4, t5 = torch.channels_last, torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 5, 6)
    assert _cl_format(t4.contiguous(memory_format=cl)) is cl
    assert _cl_format(t5.contiguous(memory_format=CL3)) is CL3
    others = (t4, t5, t4.transpose(2, 3), t4.contiguous(memory_format=cl)[..., :2],
              t5.contiguous(memory_format=CL3)[:, :, :2], torch.zeros(2, 3, 4),
              torch.zeros(2, 3, 4, 5, 6, 2))  # fmt: skip
    assert [_cl_format(t) for t in others] == [None] * len(others)
