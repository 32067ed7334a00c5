"""Review of the dispatch modules' second cut (issue 22): the cases it touched that no other
test pins. ``spatial_layout``'s one pass over every layout (strips on dims 2 / 3 / 4, H x W
tiles, volume blocks, replicated inputs) and each of its refusals; the ``extend``
registration functions as users see them (name, module, signature, pickling); ``install()``
racing in threads; the gather guard outside the forward on two meshes (strips and tiles) and
on a model parallelized twice, exact in fp64 against one device on uneven sizes;
``SpatialStats.restore`` of every counter."""

from __future__ import annotations

import inspect
import pickle
import textwrap

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import spconv_train.parallel.extend as extend
from spconv_train.parallel import SpatialShardingError, SpatialStats, parallelize
from spconv_train.parallel._errors import GATHER_EVENTS
from spconv_train.parallel._sharding import spatial_layout
from tests.dist_harness import mesh
from tests.op_check import check_fn
from tests.reference import check_close, seeded
from tests.test_public_api_surface import run_fresh

S, R = Shard, Replicate
#: (mesh shape, mesh dim names, placements, ndim, tiles) -> (sp_dim, dim, axes,
#: width_sharded), or a fragment of the refusal
LAYOUTS = [
    ((2,), ("sp",), (S(3),), 4, False, (0, 3, (), True)),
    ((1, 2), ("dp", "sp"), (S(0), S(-1)), 4, False, (1, 3, (), True)),
    ((2,), ("sp",), (S(2),), 3, False, (0, 2, (), True)),
    ((2,), ("sp",), (S(2),), 5, False, (0, 2, (), True)),
    ((2,), ("sp",), (S(3),), 5, False, (0, 3, (), True)),
    ((1, 2), ("dp", "sp"), (S(0), S(4)), 5, False, (1, 4, (), True)),
    ((2,), ("sp",), (S(2),), 4, False, "not supported on H x W tiles"),
    ((2,), ("sp",), (S(2),), 4, True, (0, 2, ((2, 0),), True)),
    ((1, 2), ("sp_h", "sp_w"), (S(2), S(3)), 4, True, (1, 3, ((2, 0), (3, 1)), True)),
    ((1, 2), ("sp_h", "sp_w"), (S(3), S(2)), 4, True, (0, 3, ((2, 1), (3, 0)), True)),
    ((1, 2), ("sp_h", "sp_w"), (S(2), S(3)), 4, False, "not supported on H x W tiles"),
    ((1, 2), ("sp_h", "sp_w"), (S(3), S(3)), 4, True, "over several mesh dimensions"),
    ((1, 2), ("sp_h", "sp_w"), (S(1), S(3)), 4, True, "only the batch (dim 0)"),
    ((1, 1, 2), ("dp", "sp_h", "sp_w"), (S(0), R(), S(3)), 4, True, (2, 3, (), True)),
    ((1, 1, 2), ("dp", "sp_h", "sp_w"), (S(1), S(2), S(3)), 4, True, "only the batch"),
    ((1, 1, 2), ("sp_d", "sp_h", "sp_w"), (S(2), S(3), S(4)), 5, True,
     (2, 4, ((2, 0), (3, 1), (4, 2)), True)),
    ((1, 1, 2), ("sp_d", "sp_h", "sp_w"), (S(4), R(), S(2)), 5, True,
     (0, 4, ((2, 2), (4, 0)), True)),
    ((1, 1, 2), ("sp_d", "sp_h", "sp_w"), (S(2), S(3), S(4)), 5, False, "volume sharded over"),
    ((1, 2), ("dp", "sp"), (S(1), S(3)), 4, False, "only the batch (dim 0)"),
    ((1, 2), ("dp", "sp"), (Partial(), S(3)), 4, False, "holds a Partial"),
    ((1, 2), ("dp", "sp"), (S(0), R()), 4, False, (1, 3, (), False)),
    ((1, 2), ("sp_h", "sp_w"), (R(), R()), 4, True, (1, 3, (), False)),
    ((1, 2), ("sp_h", "sp_w"), (S(1), R()), 4, True, "have no Shard(3)"),
    ((1, 2), ("dp", "sp"), (S(1), R()), 4, False, "only the batch (dim 0)"),
    ((1, 2), ("dp", "sp"), (Partial(), R()), 4, False, "holds a Partial"),
    ((1, 2), ("a", "b"), (R(), R()), 4, False, "have no Shard(3)"),
    ((2,), ("sp",), (R(),), 5, False, (0, 3, (), False)),
    ((2,), ("sp",), (S(1),), 5, False, "A volume (NCDHW) takes one of"),
    ((2,), ("sp",), (S(3),), 5, True, "expected an NCDHW volume"),  # a 4-D input
]  # fmt: skip


def read_layouts() -> list:
    """Every row's layout (or refusal) as ``spatial_layout`` reads it."""
    out = []
    for shape, names, placements, ndim, tiles, want in LAYOUTS:
        rank = 4 if want == "expected an NCDHW volume" else ndim
        local = torch.zeros((2, 4, 6, 8, 10)[:rank])
        x = DTensor.from_local(local, mesh(shape, names), placements, run_check=False)
        try:
            _, lay = spatial_layout(x, "op", ndim=ndim, tiles=tiles)
            out.append((lay.sp_dim, lay.dim, lay.axes, lay.width_sharded))
        except SpatialShardingError as exc:
            out.append(str(exc))
    return out


def test_spatial_layout_reads_every_layout_and_refuses_the_rest(dist_pool):
    for got in dist_pool.run(2, read_layouts):
        for row, seen in zip(LAYOUTS, got, strict=True):
            want = row[-1]
            ok = want in seen if isinstance(want, str) else seen == want
            assert ok, f"{row[:5]}: got {seen!r}, want {want!r}"


def test_extend_registration_functions_keep_their_public_names():
    """``help(extend.register_handler)``, tracebacks and pickle name extend's function, with
    the signature and docstring of the function it installs before calling."""
    signatures = {
        "register_handler": "(*functions, traced=False)",
        "refuse_handler": "(*functions, reason)",
        "register_spatial_module": "(base)",
        "refuse_module": "(base, reason)",
    }
    for name, want in signatures.items():
        fn = getattr(extend, name)
        assert (fn.__name__, fn.__qualname__, fn.__module__) == (name, name, extend.__name__)
        sig = inspect.signature(fn)
        bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
        assert str(sig.replace(parameters=bare, return_annotation=sig.empty)) == want, name
        assert pickle.loads(pickle.dumps(fn)) is fn, name
        assert len(inspect.getdoc(fn) or "") > 80, name


def _net() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3)).double()


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = _net(), nn.Conv2d(2, 3, 1).double()

    def forward(self, x):
        return self.head(self.inner(x))


def _refused_outside(y) -> str:
    try:
        y.mean()
    except SpatialShardingError as exc:
        return "refused" if "outside the parallelized model" in str(exc) else str(exc)
    return "let through"


def guard_paths() -> dict:
    """Strips and tiles meshes in one process, each guarded outside the forward with its
    own ``allow_gather`` (the last ``parallelize`` on a mesh sets it); a model parallelized
    on both meshes, and one whose child was parallelized first, exact on uneven sizes."""
    strips, tiles = mesh(2), mesh((2, 1), ("sp_h", "sp_w"))
    x = seeded(1, 2, 3, 7, 9, dtype=torch.float64)  # 7 rows, 9 columns: uneven on 2 ranks
    ref = _net()(x)
    ya = parallelize(_net(), strips)(distribute_tensor(x, strips, [Shard(3)]))
    yb = parallelize(_net(), tiles, allow_gather=True)(
        distribute_tensor(x, tiles, [Shard(2), Shard(3)])
    )
    out: dict = {"err": max((y.full_tensor() - ref).abs().max().item() for y in (ya, yb))}
    before = len(GATHER_EVENTS)
    out["lenient"] = abs(yb.mean().full_tensor().item() - ref.mean().item())
    out["events"] = [e.module for e in GATHER_EVENTS[before:]]
    out["strict"] = _refused_outside(ya)
    twice, failures = _net(), []
    parallelize(parallelize(twice, strips), tiles)  # tiles now strict too: the last one
    out["tiles_after"] = _refused_outside(yb)
    out["hooks"] = {len(m._forward_pre_hooks) for m in twice.modules()}
    x = seeded(2, 2, 3, 9, 11, dtype=torch.float64)
    nested = _Outer()
    parallelize(nested.inner, strips)
    parallelize(nested, strips)
    out["nested_hooks"] = {len(m._forward_pre_hooks) for m in nested.modules()}
    for label, model, plain, dmesh, placements in (
        ("twice", twice, _net(), tiles, [Shard(2), Shard(3)]),
        ("nested", nested, _Outer(), strips, [Shard(3)]),
    ):
        run = lambda t, m=model, p=plain: (m if isinstance(t, DTensor) else p)(t)  # noqa: E731
        check_fn(run, x, dmesh, placements, label, failures)
        for (name, p), pr in zip(model.named_parameters(), plain.parameters(), strict=True):
            check_close(f"{label} {name}.grad", p.grad, pr.grad, 1e-10, failures)
    out["failures"] = failures
    return out


def test_gather_guard_on_two_meshes_and_models_parallelized_twice(dist_pool):
    for out in dist_pool.run(2, guard_paths):
        assert out["err"] < 1e-12 and out["lenient"] < 1e-12, out
        assert out["events"] and set(out["events"]) == {"<outside the forward>"}, out
        assert (out["strict"], out["tiles_after"]) == ("refused", "refused"), out
        assert out["hooks"] == {1} and out["nested_hooks"] == {1}, out
        assert not out["failures"], out["failures"]


def test_stats_restore_sets_every_counter_and_shares_nothing():
    stats = SpatialStats(halo_bytes=5, halo_messages=2, gathers=1, gathered_ops={"aten.a": 1})
    stats.halo_seconds = 0.25
    saved = stats.snapshot()
    stats.halo_bytes, stats.halo_messages, stats.gathers = 50, 20, 10
    stats.gathered_ops["aten.b"] = 3
    stats.halo_seconds += 1.0
    stats.restore(saved)
    assert stats == saved and stats.halo_seconds == 0.25
    stats.gathered_ops["aten.c"] = 1  # restored into a copy: the snapshot stays as taken
    assert saved.gathered_ops == {"aten.a": 1} and stats._pending is not saved._pending
    stats.reset()
    assert stats == SpatialStats()


_THREADS = textwrap.dedent(
    """
    import threading

    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import ExplicitRedistributionContext as E

    from spconv_train.parallel import _errors, _mode, extend
    from spconv_train.parallel._runtime import DEFAULT_REGISTRY

    def mine(*args, **kwargs):
        return "mine"

    calls = [
        extend.install,
        extend.SpatialMode,
        lambda: extend.register_handler(F.pad)(mine),
        lambda: extend.refuse_handler(F.pad, reason="a handler keeps its function"),
        lambda: extend.register_handler(F.local_response_norm)(mine),
        lambda: extend.refuse_handler(torch.kthvalue, reason="mine"),
    ]
    start, errors = threading.Barrier(len(calls)), []

    def run(call):
        start.wait()
        try:
            call()
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert _mode._INSTALLED
    assert DEFAULT_REGISTRY.handler(F.pad) is mine, "a built-in or a refusal replaced it"
    assert DEFAULT_REGISTRY.handler(F.local_response_norm) is mine
    assert DEFAULT_REGISTRY.lookup(torch.kthvalue).refused == "mine"
    assert DEFAULT_REGISTRY.handler(F.conv2d) is not None
    assert DEFAULT_REGISTRY.lookup(F.fold).refused
    n = len(DEFAULT_REGISTRY.functions())
    extend.install()
    assert len(DEFAULT_REGISTRY.functions()) == n > 100
    assert E.observe_redistribution.__func__ is _errors._observe
    assert DTensor.redistribute is _errors._redistribute
    assert DTensor.full_tensor is _errors._full_tensor
    print("ok")
    """
)


def test_install_once_under_threads_keeps_the_users_handlers():
    """Registrations racing the first ``install()`` in six threads of a fresh process: one
    install, every user's handler and refusal kept over the built-ins, every guard on."""
    run_fresh(_THREADS)
