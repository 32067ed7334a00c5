"""Torch call forms that pass the tensor (and the other arguments) by keyword, as torch
allows (``torch.sum(input=x, dim=1)``, ``torch.cat(tensors=[...], dim=1)``,
``F.interpolate(input=x, scale_factor=2)``, ``x.add(other=y)``), on sharded DTensors inside
``SpatialMode``: every registered handler must take them as torch does (an unnamed
``TypeError: handler() missing 1 required positional argument`` before, where a handler
took the tensor by position). fp64 output and input gradient against one device (where
torch's keyword and positional forms agree), uneven strips and tiles, 2 and 3 ranks, maps,
pixel tokens with and without a prefix token, volumes; no-gather audit
(``tests/op_check.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import distribute_tensor

from spconv_train.parallel.extend import SpatialMode
from tests.keyword_forms import MAP_FORMS, plain, pool_forms, positive
from tests.meshes import mesh_and_placements
from tests.op_check import check_fn
from tests.reference import check_close, seeded

#: ``(name, op)``: tokens ``(N, L, C)`` (C = 4) to tokens ``(N, L, C')``, by keyword
TOKEN_FORMS = [
    ("torch.sum(input=) channels", lambda t: torch.sum(input=t, dim=2, keepdim=True) * t),
    ("torch.mean(input=) channels", lambda t: t - torch.mean(input=t, dim=-1, keepdim=True)),
    ("torch.amax(input=) channels", lambda t: torch.amax(input=t, dim=2, keepdim=True) + t),
    ("torch.var(input=) channels", lambda t: torch.var(input=t, dim=2, keepdim=True) * t),
    ("torch.softmax(input=) channels", lambda t: torch.softmax(input=t, dim=-1)),
    ("F.softmax(input=) channels", lambda t: F.softmax(input=t, dim=2)),
    ("torch.cumsum(input=) channels", lambda t: torch.cumsum(input=t, dim=2)),
    (
        "torch.logsumexp(input=) channels",
        lambda t: torch.logsumexp(input=t, dim=2, keepdim=True) * t,
    ),
    (
        "torch.add(input=, other=) plain",
        lambda t: torch.add(input=t, other=plain(20, 1, 1, 4, like=t)),
    ),
    ("torch.mul(input=, other=)", lambda t: torch.mul(input=t, other=t)),
    ("torch.div(input=, other=)", lambda t: torch.div(input=t, other=positive(t))),
    ("Tensor.add(other=)", lambda t: t.add(other=t.flip(2))),
    ("torch.pow(input=)", lambda t: torch.pow(input=t, exponent=2)),
    ("F.gelu(input=)", lambda t: F.gelu(input=t)),
    (
        "F.layer_norm(input=, weight=, bias=)",
        lambda t: F.layer_norm(
            input=t,
            normalized_shape=(4,),
            weight=plain(21, 4, like=t),
            bias=plain(22, 4, like=t),
            eps=1e-5,
        ),
    ),
    (
        "torch.layer_norm(input=)",
        lambda t: torch.layer_norm(
            input=t, normalized_shape=[4], weight=None, bias=None, eps=1e-5, cudnn_enable=False
        ),
    ),
    (
        "F.rms_norm(input=)",
        lambda t: F.rms_norm(input=t, normalized_shape=(4,), weight=plain(23, 4, like=t), eps=1e-6),
    ),
    ("F.normalize(input=) channels", lambda t: F.normalize(input=t, dim=-1)),
    (
        "F.linear(input=, weight=, bias=)",
        lambda t: F.linear(input=t, weight=plain(24, 6, 4, like=t), bias=plain(25, 6, like=t)),
    ),
    ("torch.chunk(input=) channels", lambda t: torch.chunk(input=t, chunks=2, dim=-1)[1]),
    (
        "torch.split(tensor=) channels",
        lambda t: torch.split(tensor=t, split_size_or_sections=2, dim=2)[0],
    ),
    ("torch.roll(input=) channels", lambda t: torch.roll(input=t, shifts=1, dims=-1)),
    ("torch.flip(input=) channels", lambda t: torch.flip(input=t, dims=(2,))),
    (
        "torch.reshape(input=) heads",
        lambda t: torch.reshape(input=t, shape=(t.shape[0], t.shape[1], 2, 2)).flatten(2),
    ),
    (
        "Tensor.view(size=) heads",
        lambda t: (
            t.view(size=(t.shape[0], t.shape[1], 2, 2))
            .transpose(dim0=2, dim1=3)
            .flatten(start_dim=2)
        ),
    ),
    ("Tensor.unflatten(dim=) heads", lambda t: t.unflatten(dim=-1, sizes=(2, 2)).sum(dim=-1)),
    ("torch.cat(tensors=) channels", lambda t: torch.cat(tensors=(t, t * 2), dim=2)),
    (
        "torch.stack(tensors=) channels",
        lambda t: torch.stack(tensors=[t, t * 2], dim=-1).flatten(2),
    ),
    ("torch.where(condition=)", lambda t: torch.where(condition=t > 0, input=t, other=-t)),
    ("torch.masked_fill(input=)", lambda t: torch.masked_fill(input=t, mask=t > 0.5, value=0.0)),
    (
        "F.scaled_dot_product_attention(query=, key=, value=)",
        lambda t: F.scaled_dot_product_attention(
            query=t[:, None], key=t[:, None], value=t[:, None]
        )[:, 0],
    ),
]

#: ``(name, fn)``: a volume ``(N, C, D, H, W)`` (C = 2) to a tensor, by keyword
VOLUME_FORMS = [
    (
        "F.conv3d(input=, weight=)",
        lambda v: F.conv3d(input=v, weight=plain(30, 3, 2, 3, 3, 3, like=v), padding=1),
    ),
    (
        "F.conv_transpose3d(input=)",
        lambda v: F.conv_transpose3d(input=v, weight=plain(31, 2, 2, 2, 2, 2, like=v), stride=2),
    ),
    (
        "F.interpolate(input=) trilinear",
        lambda v: F.interpolate(input=v, scale_factor=2, mode="trilinear"),
    ),
    ("F.instance_norm(input=) volume", lambda v: F.instance_norm(input=v)),
    ("torch.sum(input=) volume", lambda v: torch.sum(input=v, dim=(2, 3, 4))),
]


#: token forms that behind a prefix token fail by position too (not a keyword matter):
#: ``flip`` / ``chunk`` / ``split`` of the channels (backward errors), ``t > 0`` and
#: ``t[:, None]`` refused by name
NOT_BEHIND_PREFIX = {
    "torch.flip(input=) channels",
    "torch.chunk(input=) channels",
    "torch.split(tensor=) channels",
    "torch.where(condition=)",
    "torch.masked_fill(input=)",
    "F.scaled_dot_product_attention(query=, key=, value=)",
}

#: ``(name, keyword form, positional form)`` of tokens refused by position: refused alike
#: by keyword (a ``SpatialShardingError``, not an unnamed ``TypeError``)
REFUSED_ALIKE = [
    (
        "torch.matmul(input=, other=) plain",
        lambda t: torch.matmul(input=t, other=plain(26, 4, 6, like=t)),
        lambda t: torch.matmul(t, plain(26, 4, 6, like=t)),
    ),
    (
        "Tensor.matmul(other=) plain",
        lambda t: t.matmul(other=plain(26, 4, 6, like=t)),
        lambda t: t.matmul(plain(26, 4, 6, like=t)),
    ),
    (
        "Tensor.bmm(mat2=) plain",
        lambda t: t.bmm(mat2=plain(27, t.shape[0], 4, 3, like=t)),
        lambda t: t.bmm(plain(27, t.shape[0], 4, 3, like=t)),
    ),
    (
        "torch.bmm(input=, mat2=) plain",
        lambda t: torch.bmm(input=t, mat2=plain(27, t.shape[0], 4, 3, like=t)),
        lambda t: torch.bmm(t, plain(27, t.shape[0], 4, 3, like=t)),
    ),
]


def _tokens(m: torch.Tensor) -> torch.Tensor:
    return m.flatten(2).transpose(1, 2)


def _on_tokens(op, prefix: bool):
    """A map -> map function: ``op`` on the map's pixel tokens, behind a constant prefix
    (class) token when ``prefix`` (sliced off again), the result summed over its channels
    and back as a map times the map."""

    def fn(m: torch.Tensor) -> torch.Tensor:
        t = _tokens(m)
        if prefix:
            front = torch.linspace(-1, 1, t.shape[-1], dtype=t.dtype, device=t.device)
            t = torch.cat([front.expand(t.shape[0], 1, -1), t], 1)
        out = op(t)[:, 1:] if prefix else op(t)
        return out.sum(-1).view(m.shape[0], 1, *m.shape[2:]) * m

    return fn


def _layouts(world: int, ndim: int, prefix: bool = False) -> list:
    """``(label, mesh, placements)``: strips along W, tiles (H x W, the W side 1; not for
    tokens behind a prefix token) and volumes along D."""
    if ndim == 5:
        return [(f"D {world}", *mesh_and_placements((world, 1), ("sp_d", "sp_w"), 5))]
    strips = [(f"W {world}", *mesh_and_placements((world,), ("sp_w",)))]
    return (
        strips
        if prefix
        else [*strips, (f"tiles {world}x1", *mesh_and_placements((world, 1), ("sp_h", "sp_w")))]
    )


def _check_all(forms, x: torch.Tensor, ndim: int, prefix: bool = False) -> list[str]:
    failures: list[str] = []
    for label, dmesh, placements in _layouts(dist.get_world_size(), ndim, prefix):
        for name, fn in forms:
            try:
                check_fn(fn, x, dmesh, placements, f"{name} {label}", failures)
            except Exception as e:  # noqa: BLE001 -- every error is a finding
                failures.append(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}")
    return failures


def _outcome(fn, x) -> str:
    """``fn(x)`` under ``SpatialMode``: ``"ok"`` or the error's type and first line."""
    try:
        with SpatialMode():
            fn(x)
        return "ok"
    except Exception as e:  # noqa: BLE001 -- compared between the two forms
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def map_failures() -> list[str]:
    w = 3 * dist.get_world_size() + 1  # uneven strips (a stride-2 output too)
    return _check_all(MAP_FORMS, seeded(60, 2, 4, 5, w, dtype=torch.float64), 4)


def token_failures() -> list[str]:
    w = 2 * dist.get_world_size() + 1
    x = seeded(61, 2, 4, 3, w, dtype=torch.float64)
    failures = _check_all([(n, _on_tokens(op, False)) for n, op in TOKEN_FORMS], x, 4)
    behind = [
        (f"{n} prefix", _on_tokens(op, True)) for n, op in TOKEN_FORMS if n not in NOT_BEHIND_PREFIX
    ]
    failures += _check_all(behind, x, 4, prefix=True)
    xs = _tokens(distribute_tensor(x, *mesh_and_placements((dist.get_world_size(),), ("sp_w",))))
    for name, by_keyword, by_position in REFUSED_ALIKE:
        got, want = _outcome(by_keyword, xs), _outcome(by_position, xs)
        if got != want or not want.startswith("SpatialShardingError"):
            failures.append(f"{name}: by keyword {got!r}, by position {want!r}")
    return failures


def volume_failures() -> list[str]:
    w = 2 * dist.get_world_size() + 1
    return _check_all(
        VOLUME_FORMS + pool_forms(3), seeded(62, 1, 2, w, 3, 4, dtype=torch.float64), 5
    )


def _no_failures(results: list) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures[:20])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["map", "token", "volume"])
def test_keyword_forms_match_single_device(dist_pool, world, kind):
    """Every form of ``MAP_FORMS`` / ``TOKEN_FORMS`` / ``VOLUME_FORMS`` (tensors and options
    by keyword) on uneven strips and tiles matches one device in fp64, gradients included,
    without gathers; ``REFUSED_ALIKE``'s keyword forms are refused as their positional ones.
    Before: ``torch.max_pool2d(input=)``, ``F.avg_pool2d(input=)``, ``torch.flip(input=)``,
    ``torch.select(input=)``, ``torch.matmul(input=, other=)``, ``x.matmul(other=)``,
    ``torch.bmm(input=, mat2=)`` raised an unnamed ``TypeError`` (a handler took the tensor
    by position), ``torch.dropout(train=)`` and ``torch.layer_norm(cudnn_enable=)`` too."""
    _no_failures(dist_pool.run(world, globals()[f"{kind}_failures"]))


class _KeywordNet(torch.nn.Module):
    """A conv, then handlers called with their tensors by keyword (torch's builtins)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.max_pool2d(input=self.conv(x), kernel_size=3, stride=1, padding=1)
        y = torch.flip(input=y, dims=(1,)) + torch.select(input=y, dim=1, index=0)[:, None]
        y = torch.layer_norm(input=y.permute(0, 2, 3, 1), normalized_shape=[4], cudnn_enable=False)
        return torch.dropout(input=y.permute(0, 3, 1, 2), p=0.5, train=False)


def compiled_failures() -> list[str]:
    """``_KeywordNet`` parallelized, eager and compiled (``aot_eager``, DTensor ops traced),
    against one device: output and every gradient in fp64."""
    import copy

    from spconv_train.parallel import parallelize
    from tests.reference import full

    world, failures = dist.get_world_size(), []
    dmesh, placements = mesh_and_placements((world,), ("sp_w",))
    torch.manual_seed(0)
    ref = _KeywordNet().double()
    x = seeded(63, 2, 3, 5, 3 * world + 1, dtype=torch.float64)
    ref(x).square().sum().backward()
    for compiled in (False, True):
        par = parallelize(copy.deepcopy(ref), dmesh, trace_dtensor_ops=True)
        par.zero_grad(set_to_none=True)
        run = torch.compile(par, backend="aot_eager", dynamic=False) if compiled else par
        y = run(distribute_tensor(x, dmesh, placements))
        y.to_local().square().sum().backward()
        label = "compiled" if compiled else "eager"
        check_close(f"{label} output", full(y), ref(x), 1e-10, failures)
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            check_close(f"{label} {name} grad", p.grad, q.grad, 1e-10, failures)
    return failures


def test_keyword_forms_compiled(dist_pool):
    """The keyword forms under ``torch.compile`` too (``SpatialMode`` moves the tensors to
    their places in traced code)."""
    _no_failures(dist_pool.run(2, compiled_failures))
