"""The training-step part of ``scripts/gpu_check.sh``: the trainer's own ``train_step`` in
bf16 with channels-last activations on the device, plain and with FSDP, against the same
step in float32 on one device.

Per case: the ranks (one GPU each on CUDA, NCCL; gloo on CPU), seconds per step (CUDA
events on the GPU), the loss, and the relative distances of the loss and of the gradients
from the float32 step of the plain model on one device, beside that model's own bf16
distance (the rounding noise of bf16); and whether the logits stayed channels-last (with
FSDP the weights stay contiguous: FSDP2 shards contiguous parameters only, so only the
input is channels-last). A case fails on an exception, on lost channels-last logits, or on
a distance beyond ``NOISE_FACTOR`` times the noise; the exit code is then 1. The Markdown
table goes to ``--out``.

Usage: ``python scripts/gpu_check.py --device cuda --out gpu_check/step.md [--worlds 1 2]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import _time_steps, init_worker, spawn_ranks  # noqa: E402

from spconv_train.distributed import shutdown  # noqa: E402

#: bf16 against float32: a sharded step may stray at most this many times as far from the
#: float32 step as the bf16 step of the plain model on one device does (its rounding noise)
NOISE_FACTOR = 3.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _reference(model, img, target, device: str) -> dict:
    """The plain model on one device: the float32 loss and gradients, and how far its own
    bf16 step is from them (the rounding noise of bf16)."""
    import torch.nn.functional as F

    out = {}
    for bf16 in (False, True):
        ref = copy.deepcopy(model)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = ref(img)
        loss = F.cross_entropy(logits.float(), target)
        loss.backward()
        out[bf16] = (loss.item(), [p.grad.detach().float() for p in ref.parameters()])
    (loss32, grads32), (loss16, grads16) = out[False], out[True]
    noise = max(_rel(a, b) for a, b in zip(grads16, grads32, strict=True))
    return {"loss": loss32, "grads": grads32, "loss_noise": abs(loss16 - loss32) / abs(loss32),
            "grad_noise": noise}  # fmt: skip


def _worker(rank: int, world: int, port: int, fsdp: bool, args, queue) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from spconv_train.distributed import build_mesh
    from spconv_train.models import create_model
    from spconv_train.parallel import parallelize, shard_parameters
    from spconv_train.train import cross_entropy
    from spconv_train.train.optim import checkpoint_blocks
    from spconv_train.train.step import train_step

    dev = torch.device(args.device, rank if args.device == "cuda" else 0)
    init_worker(rank, world, port, args)
    try:
        mesh = build_mesh(1, world, args.device)
        torch.manual_seed(0)
        model = create_model("unet", num_classes=4, depth=3, base_width=16).to(dev)
        if not fsdp:  # FSDP2 needs contiguous parameters; the activations follow the input
            model = model.to(memory_format=torch.channels_last)
        g = torch.Generator().manual_seed(1)
        img = torch.randn(1, 3, args.height, args.width, generator=g).to(dev)
        target = torch.randint(0, 4, (1, args.height, args.width), generator=g).to(dev)
        ref = _reference(model, img, target, args.device)
        model = parallelize(model, mesh)
        if fsdp:
            shard_parameters(
                model,
                checkpoint_blocks(model),
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
            )
        x = distribute_tensor(img, mesh, [Shard(0), Shard(3)], src_data_rank=None)
        x = DTensor.from_local(
            x.to_local().contiguous(memory_format=torch.channels_last),
            mesh,
            x.placements,
            shape=x.shape,
            stride=x.stride(),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step the same
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        grads: list = []

        def keep() -> None:
            grads[:] = [
                p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                for p in model.parameters()
            ]

        out = {}

        def step() -> None:
            autocast = torch.autocast(args.device, dtype=torch.bfloat16)
            done = train_step(
                model, x, target, cross_entropy, opt, sched, params=list(model.parameters()),
                grad_clip=None, step=0, autocast=autocast, after_backward=keep,
            )  # fmt: skip
            out["loss"] = done.loss
            out["channels_last"] = done.logits.to_local().is_contiguous(
                memory_format=torch.channels_last
            )

        step()  # warm-up
        sec = _time_steps(step, args.iters, 0, args.device)
        grad_err = max(_rel(a, b) for a, b in zip(grads, ref["grads"], strict=True))
        loss_err = abs(out["loss"] - ref["loss"]) / abs(ref["loss"])
        errs = (loss_err, ref["loss_noise"], grad_err, ref["grad_noise"])
        queue.put((rank, None, sec, out["loss"], *errs, out["channels_last"]))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        queue.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    header = ("ranks", "FSDP", "s/step", "loss", "loss vs fp32 (1-device bf16)")
    header += ("grad vs fp32 (1-device bf16)", "channels-last", "verdict")
    rows, failed = [], False
    for world in args.worlds:
        for fsdp in (False, True):
            res = spawn_ranks(_worker, world, fsdp, args)
            errors = [r[1] for r in res if r[1]]
            if errors:
                rows.append((world, fsdp, "-", "-", "-", "-", "-", f"FAIL: {errors[0]}"))
                failed = True
                continue
            sec, loss = max(r[2] for r in res), res[0][3]
            worst = [max(x[i] for x in res) for i in range(4, 8)]
            loss_err, loss_noise, grad_err, grad_noise = worst
            # FSDP2 shards contiguous weights only: channels-last then holds for the input alone
            last = all(x[8] for x in res) if not fsdp else "input only"
            ok = (
                bool(last)
                and loss_err <= NOISE_FACTOR * loss_noise + 1e-4
                and grad_err <= NOISE_FACTOR * grad_noise + 1e-3
            )
            failed |= not ok
            rows.append(
                (world, fsdp, f"{sec:.4f}", f"{loss:.4f}", f"{loss_err:.1e} ({loss_noise:.1e})",
                 f"{grad_err:.1e} ({grad_noise:.1e})", last, "pass" if ok else "FAIL")
            )  # fmt: skip
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
