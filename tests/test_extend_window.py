"""``extend.halo_window`` on every layout: a convolution run on the window with padding 0
equals one device's padded convolution in fp64 (output, input and weight gradients), for
strides, dilations, asymmetric padding and every padding mode, on strips, tiles, volumes
split along one dim and volume blocks; bad geometry is refused naming the op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.parallel import SpatialShardingError
from spconv_train.parallel.extend import halo_window, sum_grad_over
from tests.dist_harness import mesh
from tests.reference import check_close, seeded

TOL = 1e-11
#: (kernel, stride, padding, dilation, padding mode)
GEOMETRIES = [
    (3, 2, 1, 1, "zeros"),
    (3, 1, 2, 2, "reflect"),
    (2, 1, ((1, 0), (0, 1), (1, 0)), 1, "replicate"),
    (3, 1, 1, 1, "circular"),
    (3, 1, 1, 1, "constant"),
]


def _layouts(world: int) -> list[tuple[str, tuple, tuple, tuple, list]]:
    n = 3 * world + 1
    return [
        ("strips", (2, 2, 5, n), (world,), ("sp",), [Shard(3)]),
        ("tiles", (1, 2, n, 5), (world, 1), ("sp_h", "sp_w"), [Shard(2), Shard(3)]),
        ("volume D", (1, 2, n, 4, 5), (world,), ("sp",), [Shard(2)]),
        ("volume blocks", (1, 2, 4, 5, n), (1, world), ("sp_h", "sp_w"), [Shard(3), Shard(4)]),
    ]


def _reference(x, weight, k, s, p, d, mode, value):
    """One device: pad in ``mode``, then the convolution with padding 0."""
    n = x.ndim - 2
    pads = [p] * n if isinstance(p, int) else list(p[:n])
    flat: list[int] = []
    for q in reversed(pads):
        flat += [q, q] if isinstance(q, int) else list(q)
    padded = (
        F.pad(x, flat, value=value) if mode in ("zeros", "constant") else F.pad(x, flat, mode=mode)
    )
    conv = F.conv2d if n == 2 else F.conv3d
    return conv(padded, weight, stride=s, dilation=d)


def run_windows(world: int) -> list[str]:
    failures: list[str] = []
    # The default runtime's gradient reducer knows parameters by id(): keep every weight
    # alive so that no new weight reuses a freed one's id within this run.
    weights = []
    for label, shape, mshape, names, placements in _layouts(world):
        dmesh = mesh(mshape, names)
        n = len(shape) - 2
        conv = F.conv2d if n == 2 else F.conv3d
        for k, s, p, d, mode in GEOMETRIES:
            pad = p if isinstance(p, int) else p[:n]
            value = 0.5 if mode == "constant" else 0.0
            x = seeded(1, *shape, dtype=torch.float64)
            w = seeded(3, 3, shape[1], *[k] * n, dtype=torch.float64)
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            yr = _reference(xr, wr, k, s, pad, d, mode, value)
            g = seeded(2, *yr.shape, dtype=torch.float64)
            yr.backward(g)
            xs = distribute_tensor(x, dmesh, placements).requires_grad_()
            ws = w.clone().requires_grad_()
            weights.append(ws)
            window = halo_window(xs, k, s, pad, d, mode, value, what=f"test {label}")
            with window.saving():
                out = conv(
                    window.local, sum_grad_over(ws, window.grad_groups), stride=s, dilation=d
                )
            ys = window.wrap(out)
            ys.backward(distribute_tensor(g, dmesh, placements))
            tag = f"{label} {mode} k={k} s={s} p={pad} d={d}"
            check_close(f"{tag} output", ys, yr, TOL, failures)
            check_close(f"{tag} input grad", xs.grad, xr.grad, TOL, failures)
            check_close(f"{tag} weight grad", ws.grad, wr.grad, TOL, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_halo_window_on_every_layout(dist_pool, world):
    for failures in dist_pool.run(world, run_windows, world):
        assert not failures, "\n".join(failures)


def refusals() -> list[str]:
    x = distribute_tensor(seeded(1, 1, 1, 4, 4, dtype=torch.float64), mesh(2), [Shard(3)])
    messages = []
    for kwargs in ({"kernel": 3, "stride": 4}, {"kernel": (3, 3, 3)}, {"kernel": 0}):
        try:
            halo_window(x, what="MyOp", **kwargs)
        except SpatialShardingError as exc:
            messages.append(str(exc))
    try:
        halo_window(x, 3, padding=1, what="MyOp").wrap(x.to_local()[..., :1])
    except SpatialShardingError as exc:
        messages.append(str(exc))
    return messages


def test_halo_window_refuses_naming_the_op(dist_pool):
    messages = dist_pool.run(2, refusals)[0]
    assert len(messages) == 4 and all(m.startswith("MyOp:") for m in messages), messages
    assert "one entry per spatial dim" in messages[1]
    assert "dim 3 must hold this rank's" in messages[3]


def test_halo_window_on_a_plain_tensor_pads_locally():
    x = seeded(0, 1, 2, 5, 6, dtype=torch.float64)
    window = halo_window(x, 3, stride=2, padding=1, padding_mode="reflect")
    assert torch.equal(window.local, F.pad(x, (1, 1, 1, 1), mode="reflect"))
    assert window.out_sizes == {2: 3, 3: 3} and window.grad_groups == ()
    out = window.local[..., ::2, ::2][..., :3, :3]
    assert window.wrap(out) is out
