"""Cases of the conv / window / halo modules the other tests leave open: the functional
transposed convolution called with keyword arguments (``input=``, as torch names it), and
transposed convolutions on 2-D and 3-D tiles where some ranks' window along one dim is
empty while another dim exchanges halos: exact against one device (fp64, every gradient)
and no zero-size point-to-point message posted (NCCL's zero-byte send / receive is not
relied on)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError, parallelize
from tests.dist_harness import mesh
from tests.meshes import each_mesh
from tests.op_check import check_fn, check_module
from tests.reference import seeded


class _KeywordConvT(nn.Module):
    """``F.conv_transpose{n}d`` / ``torch.conv_transpose{n}d`` called with every argument
    by keyword, ``input=`` included."""

    def __init__(self, n: int, fn) -> None:
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(seeded(5, 4, 3, *([3] * n), dtype=torch.float64))
        self.b = nn.Parameter(seeded(6, 6, dtype=torch.float64))

    def forward(self, x):
        kw = dict(stride=2, padding=1, output_padding=1, groups=2, dilation=1)
        return self.fn(input=x, weight=self.w, bias=self.b, **kw)


def keyword_convt() -> list[str]:
    failures: list[str] = []
    for n, fns in ((2, (F.conv_transpose2d, torch.conv_transpose2d)), (3, (F.conv_transpose3d,))):
        for fn in fns:
            x = seeded(7, 1, 4, *([5] * (n - 1)), 9, dtype=torch.float64)
            label = f"{fn.__name__}(input=...) {n}-D"
            check_module(_KeywordConvT(n, fn), x, mesh(2), [Shard(n + 1)], label, failures)
    return failures


def test_functional_conv_transpose_by_keyword(dist_pool):
    failures = dist_pool.run(2, keyword_convt)[0]
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def zero_size_messages(found: list[str]):
    """While active, every point-to-point message of no element posted is named in ``found``."""
    post = dist.batch_isend_irecv

    def counted(ops):
        found.extend(
            f"{op.op.__name__} {tuple(op.tensor.shape)}" for op in ops if not op.tensor.numel()
        )
        return post(ops)

    dist.batch_isend_irecv = counted
    try:
        yield
    finally:
        dist.batch_isend_irecv = post


#: (mesh dim names, ndim, ConvTranspose kwargs, input spatial shape): one dim of width 1
#: over 2 ranks, so a rank's window along it is empty while the other dim exchanges halos
EMPTY_WINDOW_CASES = [
    (("sp_h", "sp_w"), 4, dict(kernel_size=(3, 1), stride=(1, 3), padding=(1, 0),
                               output_padding=(0, 2)), (7, 1)),
    (("sp_h", "sp_w"), 4, dict(kernel_size=(1, 3), stride=(3, 1), padding=(0, 1),
                               output_padding=(2, 0)), (1, 7)),
    (("sp_h", "sp_w"), 5, dict(kernel_size=(2, 3, 1), stride=(1, 2, 3), padding=(0, 1, 0),
                               output_padding=(0, 1, 2), dilation=(1, 2, 1), groups=2), (3, 7, 1)),
    (("sp_d", "sp_w"), 5, dict(kernel_size=(3, 2, 1), stride=(1, 1, 3), padding=(1, 0, 0),
                               output_padding=(0, 0, 2), groups=2, bias=False), (7, 3, 1)),
    (("sp_d", "sp_h"), 5, dict(kernel_size=(3, 1, 2), stride=(2, 3, 1), padding=(1, 0, 0),
                               output_padding=(1, 2, 0)), (6, 1, 4)),
]  # fmt: skip


def convt_empty_windows() -> tuple[list[str], list[str]]:
    failures: list[str] = []
    found: list[str] = []
    for i, (names, ndim, cfg, size) in enumerate(EMPTY_WINDOW_CASES):
        ((dmesh, pl, label),) = each_mesh([((2, 2), names)], ndim=ndim)
        conv = (nn.ConvTranspose2d if ndim == 4 else nn.ConvTranspose3d)(4, 2, **cfg).double()
        x = seeded(70 + i, 1, 4, *size, dtype=torch.float64)
        with zero_size_messages(found):
            check_module(conv, x, dmesh, pl, f"{label} {names} {cfg} {size}", failures)
    return failures, found


def test_conv_transpose_empty_windows_post_no_empty_message(dist_pool):
    for rank, (failures, found) in enumerate(dist_pool.run(4, convt_empty_windows)):
        assert not failures, "\n".join(failures)
        assert not found, f"rank {rank} posted zero-size messages: {found}"


def flip_forms() -> list[str]:
    """``x.flip(1)`` (``Tensor.flip``'s int form) of a tensor no re-chunk moves (replicated,
    tokens) went to ``torch.flip(x, 1)``, a TypeError; with it the sharded and the keyword
    forms."""
    failures: list[str] = []
    x = seeded(7, 2, 3, 4, 7, dtype=torch.float64)
    forms = {
        "x.flip(1)": lambda t: t.flip(1),
        "x.flip(1, 3)": lambda t: t.flip(1, 3),
        "x.flip(-1)": lambda t: t.flip(-1),
        "torch.flip(x, dims=[2])": lambda t: torch.flip(t, dims=[2]),
    }

    for label, fn in forms.items():
        check_fn(fn, x, mesh(2), [Shard(3)], label, failures)
    # along the split tokens: the no-gather guard's named refusal (was the TypeError)
    model = parallelize(_TokenFlip(), mesh(2))
    try:
        model(distribute_tensor(x, mesh(2), [Shard(3)]))
        failures.append("tokens .flip(1): not refused")
    except SpatialShardingError as e:
        if "flip" not in str(e):
            failures.append(f"tokens .flip(1): refused without naming flip: {e}")
    return failures


class _TokenFlip(nn.Module):
    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return m.flatten(2).transpose(1, 2).flip(1)


def test_flip_forms(dist_pool):
    for rank, failures in enumerate(dist_pool.run(2, flip_forms)):
        assert not failures, f"rank {rank}: {failures}"
