"""Review of the dispatch modules' third cut (issue 22): the cases it touched that no other
test pins, in fp64 against one device on uneven strips (2 and 3 ranks).

- DTensor's own rule on tokens behind prefix (class / register) tokens: ops whose result
  is a ``torch.return_types`` tuple (``sort``, ``frexp``, ``kthvalue``, ``cummax``) gave
  ``_StridedShard`` values without the prefix, silently wrong (``_errors.run_dtensor_op``
  read only plain tuples and lists); now refused like ``t ** 2``, also when the tokens come
  as keyword arguments. The same ops on pixel tokens or on the map stay exact.
- DTensor's errors name every sharded input, positional or keyword (``_errors._dtensors``).
- ``_sharding.enter``'s notes (``input_share``: one rank's share of the largest spatial
  input, the same on every rank; ``last_image``: the last NCHW one) on strips, tiles and
  volumes, and the computed-plain-tensor guard that reads it.
- The bounded caches of ``_dims`` (specs, gradient specs, mesh axes) clear at their bound;
  one layout wrapped in several dtypes is what the public ``DTensor.from_local`` builds.
- ``addcmul`` / ``addcdiv`` with plain operands on strips, tiles, rows, volumes and a rank
  holding no column.
- The gather guard's module names: ``<model>`` for the root's own op, a child's path, and
  ``Spatial<Root>`` for a parallelized model inside another (its class made by ``_mode``).
- ``import spconv_train.parallel`` and ``extend`` patch and swap nothing; a module swap
  registered through ``extend`` before ``install()`` wins over the built-in one.
"""

from __future__ import annotations

import copy
import math
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, _dims, parallelize, runtime_of
from spconv_train.parallel.extend import SpatialMode
from tests.dist_harness import mesh
from tests.meshes import placements as grid_placements
from tests.op_check import check_module
from tests.reference import check_close, seeded
from tests.test_public_api_surface import run_fresh

TOL = 1e-12

#: ops with a ``torch.return_types`` result, on tokens ``(B, L, C)`` along the channels
SEVERAL_OUTPUTS = [
    ("sort", lambda t: torch.sort(t, 2)),
    ("frexp", lambda t: torch.frexp(t)),
    ("kthvalue", lambda t: torch.kthvalue(t, 2, 2)),
    ("cummax", lambda t: torch.cummax(t, dim=2)),
    ("sort keyword", lambda t: torch.sort(input=t, dim=2, descending=True)),
]
#: DTensor's own element-wise rules with the prefixed tokens as keyword arguments only
KEYWORD_ONLY = [
    ("maximum", lambda t: torch.maximum(input=t, other=t * 2)),
    ("lerp", lambda t: torch.lerp(input=t, end=t * 2, weight=0.5)),
]


def _tokens(x, front):
    """Pixel tokens of the map ``x`` behind the ``front`` (prefix) tokens, and without."""
    pixels = x.flatten(2).transpose(1, 2)
    return torch.cat([front.expand(x.shape[0], -1, -1), pixels], 1), pixels


def several_outputs_failures() -> list[str]:
    world, failures = dist.get_world_size(), []
    x = seeded(45, 2, 3, 5, 2 * world + 1, dtype=torch.float64)  # uneven strips
    front = seeded(46, 1, 2, 3, dtype=torch.float64)
    xs = distribute_tensor(x, mesh(world), [Shard(3)])
    for name, op in SEVERAL_OUTPUTS + KEYWORD_ONLY:
        try:
            with SpatialMode():
                out = op(_tokens(xs, front)[0])
            failures.append(f"{name}: not refused ({[o.placements for o in out]})")
        except SpatialShardingError as e:
            if "drops the prefix" not in str(e):
                failures.append(f"{name}: {e}")
        # the pixel tokens alone (no prefix) and the map: DTensor's rule, exact
        with SpatialMode():
            pixels, on_map = op(_tokens(xs, front)[1]), op(xs.transpose(1, 3))
        for label, got, want in (
            ("pixels", pixels, op(_tokens(x, front)[1])),
            ("map", on_map, op(x.transpose(1, 3))),
        ):
            got, want = (v if isinstance(v, tuple) else (v,) for v in (got, want))
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                got_i = g.full_tensor().double()
                check_close(f"{name} {label} [{i}]", got_i, w.double(), TOL, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_several_outputs_behind_prefix_refused_and_exact_without(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, several_outputs_failures)):
        assert not failures, (rank, failures)


def dtensor_error_failures() -> list[str]:
    dmesh, failures = mesh(2), []
    xs = distribute_tensor(seeded(1, 2, 3, 4, 5, dtype=torch.float64), dmesh, [Shard(3)])
    a = distribute_tensor(seeded(2, 3, 6, 5, dtype=torch.float64), dmesh, [Shard(2)])
    sv, x_in = torch.tensor([0.0, 1.0], dtype=torch.float64), "(2, 3, 4, 5) (Shard(dim=3),)"
    calls = {  # name: (call, the inputs it names)
        "torch.renorm": (lambda: torch.renorm(input=xs, p=2, dim=3, maxnorm=1.0), x_in),
        "torch.searchsorted": (lambda: torch.searchsorted(sv, input=xs), x_in),
        "torch.cdist": (lambda: torch.cdist(a, xs[0]), "(3, 6, 5) (Shard(dim=2),); (3, 4, 5) ("),
    }
    for name, (call, inputs) in calls.items():
        try:
            with SpatialMode():
                call()
            failures.append(f"{name}: not refused")
        except SpatialShardingError as e:
            head = f"{name} in module '<model>' is not supported on these sharded inputs ({inputs}"
            if not str(e).startswith(head) or "DTensor has no local rule for it" not in str(e):
                failures.append(str(e))
    return failures


def test_dtensor_errors_name_the_op_and_every_sharded_input(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, dtensor_error_failures)):
        assert not failures, (rank, failures)


class _Net(nn.Module):
    """Two convs (the second one's input is the larger: 4 channels), then, with ``plain``,
    a tensor the model computes from a parameter added: ``"narrow"`` ``(1, 1, 1, W)``, far
    under an eighth of the input share; ``"wide"`` ``(1, 2, H, W)``, the activation's size."""

    def __init__(self, conv: type = nn.Conv2d, plain: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.a, self.b = conv(3, 4, 3, padding=1), conv(4, 2, 3, padding=1)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.plain = plain

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        if self.plain is None:
            return y
        h, w = y.shape[2:]
        shape = (1, 2, h, w) if self.plain == "wide" else (1, 1, 1, w)
        ramp = torch.arange(math.prod(shape), dtype=y.dtype).reshape(shape)
        return y + ramp * self.scale  # computed: has a grad_fn


def _placements(names: tuple[str, ...], ndim: int) -> list[Shard]:
    return [Shard(ndim - 1)] if names == ("sp",) else grid_placements(names, ndim)


def runtime_notes(specs) -> list:
    world, out = dist.get_world_size(), []
    for shape, names, label in specs:
        for conv, size in ((nn.Conv2d, (2, 3, 5, 2 * world + 1)), (nn.Conv3d, (1, 3, 3, 4, 5))):
            dmesh, placements = mesh(shape, names), _placements(names, len(size))
            model = parallelize(_Net(conv).double(), dmesh)
            x = seeded(3, *size, dtype=torch.float64)
            model(distribute_tensor(x, dmesh, placements))
            rt = runtime_of(model)
            share = 4 * x.numel() // 3 // world  # the second conv's input: 4 channels
            seen = rt.last_image and (rt.last_image[0] is dmesh, *rt.last_image[1:])
            want = (True, tuple(placements), (size[0], 4, *size[2:])) if len(size) == 4 else None
            out.append((label, len(size), rt.input_share, share, seen, want))
    return out


MESHES = [((2,), ("sp",), "strips"), *(((p, 3 - p), ("sp_h", "sp_w"), "grid") for p in (1, 2))]


def test_enter_notes_the_input_share_and_last_image(dist_pool):
    for rank, notes in enumerate(dist_pool.run(2, runtime_notes, MESHES)):
        for label, ndim, share, want_share, seen, want in notes:
            assert share == want_share and seen == want, (rank, label, ndim, notes)


def computed_plain_failures() -> list[str]:
    """The narrow computed plain tensor: exact, every gradient; the wide one: refused."""
    world, failures = dist.get_world_size(), []
    x = seeded(4, 2, 3, 5, 2 * world + 1, dtype=torch.float64)
    gy = seeded(5, 2, 2, 5, 2 * world + 1, dtype=torch.float64)
    plain = _Net(plain="narrow").double()
    ref = plain(x)
    ref.backward(gy)
    model = parallelize(copy.deepcopy(plain), mesh(world))
    y = model(distribute_tensor(x, mesh(world), [Shard(3)]))
    y.backward(distribute_tensor(gy, mesh(world), [Shard(3)]))
    check_close("output", y.full_tensor(), ref, TOL, failures)
    for (name, p), pr in zip(model.named_parameters(), plain.parameters(), strict=True):
        check_close(f"grad {name}", p.grad, pr.grad, TOL, failures)
    try:
        parallelize(_Net(plain="wide").double(), mesh(world))(
            distribute_tensor(x, mesh(world), [Shard(3)])
        )
        failures.append("wide: not refused")
    except SpatialShardingError as e:
        if "plain tensor (1, 2, 5," not in str(e) or "allow_gather=True" not in str(e):
            failures.append(f"wide: {e}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_computed_plain_tensor_exact_when_small_refused_when_activation_sized(dist_pool, world):
    for rank, failures in enumerate(dist_pool.run(world, computed_plain_failures)):
        assert not failures, (rank, failures)


def bounded_caches() -> list[str]:
    """Each cache, filled to its bound with keys no call uses, holds only the new entry
    after the next miss; the results equal the public API's."""
    dmesh, failures = mesh(2), []
    x = seeded(6, 2, 3, 4, 5, dtype=torch.float64)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    bounds = ((_dims._SPECS, 4096), (_dims._GRAD_SPECS, 4096), (_dims._MESH_AXES, 256))
    for cache, bound in bounds:
        cache.clear()
        cache.update({("unused", i): None for i in range(bound)})
    local = xs.to_local().clone().requires_grad_()
    wrapped = _dims.wrap_local(local, dmesh, [Shard(3)], xs.shape)
    _dims.local_of(wrapped * 2).sum().backward()
    size, rank, _ = _dims.mesh_axis(dmesh, 0)
    for (cache, _), name in zip(bounds, ("specs", "grad specs", "mesh axes"), strict=True):
        if len(cache) != 1:
            failures.append(f"{name}: {len(cache)} entries after a miss at the bound")
    if (size, rank) != (2, dist.get_rank()) or wrapped.placements != (Shard(3),):
        failures.append(f"mesh axis {(size, rank)}, placements {wrapped.placements}")
    check_close("grad", local.grad, torch.full_like(local, 2.0), 0.0, failures)
    check_close("wrapped", wrapped.full_tensor(), x, 0.0, failures)
    return failures


def test_bounded_caches_clear_at_their_bound(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, bounded_caches)):
        assert not failures, (rank, failures)


def wrap_dtypes() -> list[str]:
    """One layout wrapped in fp64, bf16, fp32 and int64 (each a miss, then a hit of the spec
    cache) is what the public ``DTensor.from_local`` builds: dtype, shape, strides; the
    floating ones' gradients through ``local_of`` keep their dtype and placements."""
    dmesh, failures = mesh(2), []
    x = seeded(9, 2, 3, 4, 5, dtype=torch.float64)
    xs = distribute_tensor(x, dmesh, [Shard(3)])
    for dtype in (torch.float64, torch.bfloat16, torch.float32, torch.int64, torch.float64):
        local = (xs.to_local() * 4).to(dtype)
        want = DTensor.from_local(
            local, dmesh, [Shard(3)], run_check=False, shape=xs.shape, stride=xs.stride()
        )
        for attempt in ("miss", "hit"):
            floating = dtype.is_floating_point
            leaf = local.clone().requires_grad_(floating)
            got = _dims.wrap_local(leaf, dmesh, [Shard(3)], xs.shape)
            meta = (got.dtype, got.shape, got.stride(), got.placements, got.requires_grad)
            if meta != (dtype, want.shape, want.stride(), want.placements, floating):
                failures.append(f"{dtype} {attempt}: {meta}")
            if not floating:
                continue
            _dims.local_of(got * 3).sum().backward()
            if leaf.grad.dtype != dtype or not bool((leaf.grad == 3).all()):
                failures.append(f"{dtype} {attempt}: gradient {leaf.grad.dtype}")
    return failures


def test_wrap_local_per_dtype_matches_the_public_api(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, wrap_dtypes)):
        assert not failures, (rank, failures)


_FRESH = textwrap.dedent(
    """
    import sys

    from torch import nn
    from torch.distributed.tensor import DTensor

    redistribute, full_tensor = DTensor.redistribute, DTensor.full_tensor
    import spconv_train.parallel
    from spconv_train.parallel import _mode, extend

    assert DTensor.redistribute is redistribute and DTensor.full_tensor is full_tensor
    assert not _mode._SPATIAL_MODULES and not _mode._SPATIAL_MIXINS, "swaps on import"
    ops = ("_pointwise", "_conv", "_channels", "_norm", "_tokens", "_token_prefix")
    loaded = [m for m in ops if f"spconv_train.parallel.{m}" in sys.modules]
    assert not loaded, f"op modules imported on import: {loaded}"

    class MyGroupNorm(nn.GroupNorm):
        pass

    assert extend.register_spatial_module(nn.GroupNorm)(MyGroupNorm) is MyGroupNorm
    assert _mode._INSTALLED, "not installed first"
    assert _mode._SPATIAL_MODULES[nn.GroupNorm] is MyGroupNorm, "the built-in swap won"
    assert _mode._SPATIAL_MODULES[nn.BatchNorm2d].__name__ == "SpatialBatchNorm2d"
    assert DTensor.redistribute is not redistribute and DTensor.full_tensor is not full_tensor
    extend.install()
    assert _mode._SPATIAL_MODULES[nn.GroupNorm] is MyGroupNorm
    print("ok")
    """
)


def test_import_swaps_nothing_and_an_extend_swap_wins_over_the_built_in():
    run_fresh(_FRESH)


class _CumNet(nn.Module):
    """A conv, then ``logcumsumexp`` along the sharded width (no handler: DTensor would
    gather it) in the root's own forward or in a child's."""

    def __init__(self, in_child: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 2, 3, padding=1).double()
        self.head = _LogCumSumExp() if in_child else None

    def forward(self, x):
        y = self.conv(x)
        return self.head(y) if self.head is not None else y.logcumsumexp(3)


class _LogCumSumExp(nn.Module):
    def forward(self, x):
        return x.logcumsumexp(3)


def guard_labels() -> list:
    """The module the guard names for the root's own op, a child's, and the root's own op
    of a parallelized model inside another (named by its class, ``Spatial<Root>``)."""
    x = seeded(7, 2, 3, 4, 5, dtype=torch.float64)
    inner = parallelize(_CumNet(False), mesh(2))
    models = [_CumNet(False), _CumNet(True), nn.Sequential(inner)]
    found = [(type(inner).__qualname__, repr(inner).split("(")[0])]
    for model in models:
        try:
            parallelize(model, mesh(2))(distribute_tensor(x, mesh(2), [Shard(3)]))
            found.append("not refused")
        except SpatialShardingError as e:
            found.append(str(e).split(" has no spatial")[0])
    return found


def test_guard_names_the_module_of_a_refused_op(dist_pool):
    op = "(aten.logcumsumexp.default)"
    for found in dist_pool.run(2, guard_labels):
        assert found == [
            ("Spatial_CumNet", "Spatial_CumNet"),
            f"an op in module '<model>' {op}",  # the root's own forward: no module around it
            f"an op in module 'head' {op}",
            f"an op in module 'Spatial_CumNet' {op}",
        ], found


class _Addc(nn.Module):
    """``addcmul`` / ``addcdiv`` with a plain parameter as ``input``, ``tensor1`` or
    ``tensor2``, ``value`` other than 1, function and method forms, after a conv or not."""

    def __init__(self, conv: type | None = nn.Conv2d) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = conv(3, 4, 3, padding=1) if conv else nn.Identity()  # None: any width
        lead = (1, 4 if conv else 3) + (1,) * (3 if conv is nn.Conv3d else 2)
        self.w, self.b = nn.Parameter(torch.randn(lead)), nn.Parameter(torch.randn(lead[1:]))

    def forward(self, x):
        y = self.conv(x)
        z = torch.addcmul(y, self.w, y, value=-0.5)
        z = z.addcdiv(y, self.b.abs() + 1, value=0.25)
        z = torch.addcdiv(z, self.w, y * y + 1)
        return torch.addcmul(self.b, z, y)


ADDC_MESHES = [  # (mesh shape, None: all ranks; names; ndim)
    (None, ("sp",), 4),
    ((1, 2), ("sp_h", "sp_w"), 4),
    ((2, 1), ("sp_h", "sp_w"), 4),
    (None, ("sp",), 5),
    ((1, 2), ("sp_d", "sp_w"), 5),
]


def addc_failures(specs) -> list[str]:
    world, failures = dist.get_world_size(), []
    for shape, names, ndim in specs:
        conv = nn.Conv2d if ndim == 4 else nn.Conv3d
        size = (2, 3, 5, 2 * world + 1) if ndim == 4 else (1, 3, 3, 4, 2 * world + 1)
        dmesh, placements = mesh(shape or world, names), _placements(names, ndim)
        x = seeded(8, *size, dtype=torch.float64)
        check_module(_Addc(conv).double(), x, dmesh, placements, f"{names} {ndim}-D", failures)
    x = seeded(9, 2, 3, 4, world - 1, dtype=torch.float64)  # the last rank holds nothing
    check_module(_Addc(None).double(), x, mesh(world), [Shard(3)], "no conv", failures)
    return failures


@pytest.mark.parametrize("world, specs", [(2, ADDC_MESHES), (3, ADDC_MESHES[:1])])
def test_addcmul_addcdiv_with_plain_operands_exact(dist_pool, world, specs):
    for rank, failures in enumerate(dist_pool.run(world, addc_failures, specs)):
        assert not failures, (rank, failures)
