"""The map call forms of ``tests/test_keyword_forms.py``: torch functions, ``F.*`` and
Tensor methods with the map (and the other tensors and options) passed by keyword."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.reference import seeded


def plain(seed: int, *shape: int, like: torch.Tensor) -> torch.Tensor:
    """A plain seeded fp64 tensor on ``like``'s device (a weight, a bias, an operand)."""
    return seeded(seed, *shape, dtype=like.dtype).to(like.device)


def positive(m: torch.Tensor) -> torch.Tensor:
    """``m`` made positive (for ``log``, ``sqrt``, divisors)."""
    return m * m + 0.5


#: ``torch.batch_norm`` / ``torch.instance_norm``'s arguments after the input, by keyword
NO_STATISTICS = {
    "weight": None,
    "bias": None,
    "running_mean": None,
    "running_var": None,
    "momentum": 0.1,
    "eps": 1e-5,
    "cudnn_enabled": False,
}


def pool_forms(d: int) -> list:
    """``(name, fn)``: the ``d``-D pooling functions with the input by keyword."""
    window = {"kernel_size": 3, "stride": 1, "padding": 1}
    forms = [
        (f"F.max_pool{d}d", getattr(F, f"max_pool{d}d"), window),
        (
            f"F.max_pool{d}d indices",
            getattr(F, f"max_pool{d}d"),
            {**window, "return_indices": True},
        ),
        (f"torch.max_pool{d}d", getattr(torch, f"max_pool{d}d"), window),
        (f"F.avg_pool{d}d", getattr(F, f"avg_pool{d}d"), window),
        (f"F.adaptive_avg_pool{d}d", getattr(F, f"adaptive_avg_pool{d}d"), {"output_size": 1}),
        (f"F.adaptive_max_pool{d}d", getattr(F, f"adaptive_max_pool{d}d"), {"output_size": 1}),
        (
            f"F.adaptive_max_pool{d}d indices",
            getattr(F, f"adaptive_max_pool{d}d"),
            {"output_size": 1, "return_indices": True},
        ),
    ]
    if d == 3:  # volumes: max-pool indices refused by name (no MaxUnpool3d)
        forms = [form for form in forms if not form[0].endswith("indices")]
    return [(f"{name}(input=)", lambda x, f=f, k=k: f(input=x, **k)) for name, f, k in forms]


#: ``(name, fn)``: a map ``(N, C, H, W)`` (C = 4) to a tensor, the map by keyword
MAP_FORMS = [
    # reductions, over the channels and over the split dims
    ("torch.sum(input=, dim=W)", lambda m: torch.sum(input=m, dim=3)),
    ("torch.sum(input=, dim=C, keepdim=)", lambda m: torch.sum(input=m, dim=1, keepdim=True) * m),
    ("torch.mean(input=, dim=HW)", lambda m: torch.mean(input=m, dim=(2, 3), keepdim=True) * m),
    ("torch.nansum(input=)", lambda m: torch.nansum(input=m, dim=3)),
    ("torch.nanmean(input=)", lambda m: torch.nanmean(input=m, dim=1)),
    ("torch.amax(input=)", lambda m: torch.amax(input=m, dim=3)),
    ("torch.amin(input=)", lambda m: torch.amin(input=m, dim=(2, 3))),
    ("torch.var(input=)", lambda m: torch.var(input=m, dim=3, correction=0)),
    ("torch.std(input=)", lambda m: torch.std(input=m, dim=1)),
    ("torch.max(input=, other=)", lambda m: torch.max(input=m, other=m.flip(1))),
    ("torch.min(input=, dim=)", lambda m: torch.min(input=m, dim=1)),
    ("torch.aminmax(input=)", lambda m: torch.aminmax(input=m, dim=3)),
    ("torch.norm(input=)", lambda m: torch.norm(input=m, p=2, dim=1)),
    ("torch.linalg.vector_norm(x=)", lambda m: torch.linalg.vector_norm(m, ord=2, dim=3)),
    ("torch.prod(input=)", lambda m: torch.prod(input=m, dim=1)),
    ("torch.median(input=)", lambda m: torch.median(input=m, dim=1)),
    ("torch.nanmedian(input=)", lambda m: torch.nanmedian(input=m, dim=1)),
    ("torch.argmax(input=)", lambda m: m * torch.argmax(input=m, dim=1, keepdim=True)),
    ("torch.argmin(input=)", lambda m: m * torch.argmin(input=m, dim=1, keepdim=True)),
    ("F.softmax(input=)", lambda m: F.softmax(input=m, dim=3)),
    ("torch.softmax(input=)", lambda m: torch.softmax(input=m, dim=1)),
    ("F.log_softmax(input=)", lambda m: F.log_softmax(input=m, dim=3)),
    ("torch.log_softmax(input=)", lambda m: torch.log_softmax(input=m, dim=1)),
    ("Tensor.log_softmax(dim=)", lambda m: m.log_softmax(dim=3)),
    ("torch.cumsum(input=)", lambda m: torch.cumsum(input=m, dim=3)),
    ("torch.cumprod(input=)", lambda m: torch.cumprod(input=m, dim=1)),
    ("F.normalize(input=)", lambda m: F.normalize(input=m, p=2.0, dim=1)),
    # activations
    ("F.relu(input=)", lambda m: F.relu(input=m)),
    ("torch.relu(input=)", lambda m: torch.relu(input=m)),
    ("F.relu6(input=)", lambda m: F.relu6(input=m * 4)),
    ("F.hardswish(input=)", lambda m: F.hardswish(input=m)),
    ("F.hardsigmoid(input=)", lambda m: F.hardsigmoid(input=m)),
    ("F.hardtanh(input=)", lambda m: F.hardtanh(input=m, min_val=-0.5, max_val=0.5)),
    ("F.silu(input=)", lambda m: F.silu(input=m)),
    ("F.gelu(input=)", lambda m: F.gelu(input=m, approximate="tanh")),
    ("F.leaky_relu(input=)", lambda m: F.leaky_relu(input=m, negative_slope=0.2)),
    ("F.elu(input=)", lambda m: F.elu(input=m, alpha=0.5)),
    ("F.selu(input=)", lambda m: F.selu(input=m)),
    ("torch.selu(input=)", lambda m: torch.selu(input=m)),
    ("F.celu(input=)", lambda m: F.celu(input=m, alpha=0.5)),
    ("torch.celu(input=)", lambda m: torch.celu(input=m, alpha=0.5)),
    ("F.mish(input=)", lambda m: F.mish(input=m)),
    ("F.softplus(input=)", lambda m: F.softplus(input=m, beta=2.0)),
    ("F.logsigmoid(input=)", lambda m: F.logsigmoid(input=m)),
    ("F.sigmoid(input=)", lambda m: F.sigmoid(input=m)),
    ("F.tanh(input=)", lambda m: F.tanh(input=m)),
    ("F.dropout(input=) eval", lambda m: F.dropout(input=m, p=0.5, training=False)),
    ("F.dropout2d(input=) eval", lambda m: F.dropout2d(input=m, p=0.5, training=False)),
    ("torch.dropout(input=) eval", lambda m: torch.dropout(input=m, p=0.5, train=False)),
    # element-wise
    ("torch.add(input=, other=, alpha=)", lambda m: torch.add(input=m, other=m.flip(1), alpha=2)),
    ("torch.sub(input=, other=number)", lambda m: torch.sub(input=m, other=2.0)),
    (
        "torch.mul(input=, other=plain)",
        lambda m: torch.mul(input=m, other=plain(3, 1, 4, 1, 1, like=m)),
    ),
    (
        "torch.div(input=, other=)",
        lambda m: torch.div(input=m, other=positive(m), rounding_mode=None),
    ),
    ("Tensor.add(other=)", lambda m: m.add(other=m, alpha=0.5)),
    ("Tensor.sub(other=)", lambda m: m.sub(other=m.flip(1))),
    ("Tensor.mul(other=)", lambda m: m.mul(other=3.0)),
    ("Tensor.div(other=)", lambda m: m.div(other=positive(m))),
    (
        "torch.addcmul(input=, tensor1=, tensor2=)",
        lambda m: torch.addcmul(input=m, tensor1=m, tensor2=m, value=0.5),
    ),
    (
        "torch.addcdiv(input=, tensor1=, tensor2=)",
        lambda m: torch.addcdiv(input=m, tensor1=m, tensor2=positive(m), value=0.5),
    ),
    ("Tensor.addcmul(tensor1=, tensor2=)", lambda m: m.addcmul(tensor1=m, tensor2=m)),
    ("torch.pow(input=, exponent=)", lambda m: torch.pow(input=m, exponent=2)),
    ("Tensor.pow(exponent=)", lambda m: m.pow(exponent=3)),
    ("torch.clamp(input=, min=, max=)", lambda m: torch.clamp(input=m, min=-0.5, max=0.5)),
    ("Tensor.clamp(min=)", lambda m: m.clamp(min=-0.2)),
    ("torch.sigmoid(input=)", lambda m: torch.sigmoid(input=m)),
    ("torch.tanh(input=)", lambda m: torch.tanh(input=m)),
    ("torch.exp(input=)", lambda m: torch.exp(input=m)),
    ("torch.log(input=)", lambda m: torch.log(input=positive(m))),
    ("torch.abs(input=)", lambda m: torch.abs(input=m)),
    ("torch.sqrt(input=)", lambda m: torch.sqrt(input=positive(m))),
    ("torch.rsqrt(input=)", lambda m: torch.rsqrt(input=positive(m))),
    ("torch.square(input=)", lambda m: torch.square(input=m)),
    ("torch.erf(input=)", lambda m: torch.erf(input=m)),
    ("torch.reciprocal(input=)", lambda m: torch.reciprocal(input=positive(m))),
    ("torch.sin(input=)", lambda m: torch.sin(input=m)),
    ("torch.cos(input=)", lambda m: torch.cos(input=m)),
    ("torch.log1p(input=)", lambda m: torch.log1p(input=positive(m))),
    ("torch.expm1(input=)", lambda m: torch.expm1(input=m)),
    ("torch.sign(input=)", lambda m: m * torch.sign(input=m)),
    (
        "torch.masked_fill(input=, mask=, value=)",
        lambda m: torch.masked_fill(input=m, mask=m > 0.3, value=0.0),
    ),
    ("Tensor.masked_fill(mask=, value=)", lambda m: m.masked_fill(mask=m < 0, value=1.0)),
    (
        "torch.where(condition=, input=, other=)",
        lambda m: torch.where(condition=m > 0, input=m, other=m * 2),
    ),
    ("torch.where(cond, input=, other=number)", lambda m: torch.where(m > 0, input=m, other=0.5)),
    # norms with plain weights
    ("torch.prelu(input=, weight=)", lambda m: torch.prelu(input=m, weight=plain(4, 4, like=m))),
    ("F.prelu(input=, weight=)", lambda m: F.prelu(input=m, weight=plain(4, 4, like=m))),
    (
        "F.batch_norm(input=) training",
        lambda m: F.batch_norm(
            input=m,
            running_mean=None,
            running_var=None,
            weight=plain(5, 4, like=m),
            bias=plain(6, 4, like=m),
            training=True,
            eps=1e-3,
        ),
    ),
    (
        "F.batch_norm(input=) eval",
        lambda m: F.batch_norm(
            input=m,
            running_mean=plain(5, 4, like=m),
            running_var=positive(plain(6, 4, like=m)),
            training=False,
        ),
    ),
    (
        "torch.batch_norm(input=)",
        lambda m: torch.batch_norm(input=m, training=True, **NO_STATISTICS),
    ),
    (
        "F.instance_norm(input=)",
        lambda m: F.instance_norm(input=m, weight=plain(7, 4, like=m), bias=None, eps=1e-3),
    ),
    (
        "torch.instance_norm(input=)",
        lambda m: torch.instance_norm(input=m, use_input_stats=True, **NO_STATISTICS),
    ),
    (
        "F.group_norm(input=)",
        lambda m: F.group_norm(
            input=m, num_groups=2, weight=plain(8, 4, like=m), bias=plain(9, 4, like=m)
        ),
    ),
    ("torch.group_norm(input=)", lambda m: torch.group_norm(input=m, num_groups=2)),
    # convolutions, pooling, resizing
    *pool_forms(2),
    (
        "F.conv2d(input=, weight=, bias=)",
        lambda m: F.conv2d(
            input=m, weight=plain(10, 3, 4, 3, 3, like=m), bias=plain(11, 3, like=m), padding=1
        ),
    ),
    (
        "F.conv2d(input=) stride 2",
        lambda m: F.conv2d(input=m, weight=plain(10, 3, 4, 3, 3, like=m), stride=2, padding=1),
    ),
    (
        "F.conv_transpose2d(input=, weight=)",
        lambda m: F.conv_transpose2d(input=m, weight=plain(12, 4, 3, 2, 2, like=m), stride=2),
    ),
    (
        "F.interpolate(input=, scale_factor=)",
        lambda m: F.interpolate(input=m, scale_factor=2, mode="nearest"),
    ),
    (
        "F.interpolate(input=, size=) bilinear",
        lambda m: F.interpolate(
            input=m, size=(7, 2 * m.shape[3]), mode="bilinear", align_corners=False
        ),
    ),
    ("F.pad(input=, pad=)", lambda m: F.pad(input=m, pad=(1, 1, 2, 0), mode="constant", value=0.5)),
    ("F.pad(input=) reflect", lambda m: F.pad(input=m, pad=(1, 1, 1, 1), mode="reflect")),
    ("torch.pixel_shuffle(input=)", lambda m: torch.pixel_shuffle(input=m, upscale_factor=2)),
    (
        "torch.pixel_unshuffle(input=)",
        lambda m: torch.pixel_unshuffle(input=F.interpolate(m, scale_factor=2), downscale_factor=2),
    ),
    # layout
    ("torch.cat(tensors=)", lambda m: torch.cat(tensors=[m, m * 2], dim=1)),
    ("torch.concat(tensors=)", lambda m: torch.concat(tensors=[m, m * 2], dim=1)),
    ("torch.concatenate(tensors=, axis=)", lambda m: torch.concatenate(tensors=[m, m * 2], axis=1)),
    ("torch.stack(tensors=)", lambda m: torch.stack(tensors=[m, m * 2], dim=1)),
    ("torch.chunk(input=)", lambda m: torch.chunk(input=m, chunks=2, dim=1)[1]),
    ("Tensor.chunk(chunks=)", lambda m: m.chunk(chunks=2, dim=1)[0]),
    (
        "torch.split(tensor=)",
        lambda m: torch.split(tensor=m, split_size_or_sections=[1, 3], dim=1)[1],
    ),
    ("Tensor.split(split_size=)", lambda m: m.split(split_size=2, dim=1)[1]),
    ("torch.flip(input=, dims=)", lambda m: torch.flip(input=m, dims=(3,))),
    ("Tensor.flip(dims=)", lambda m: m.flip(dims=(1, 3))),
    ("torch.roll(input=, shifts=, dims=)", lambda m: torch.roll(input=m, shifts=1, dims=1)),
    ("Tensor.roll(shifts=, dims=)", lambda m: m.roll(shifts=(1, 2), dims=(1, 2))),
    ("torch.permute(input=, dims=)", lambda m: torch.permute(input=m, dims=(0, 2, 3, 1))),
    ("Tensor.permute(dims=)", lambda m: m.permute(dims=(0, 3, 2, 1))),
    ("torch.transpose(input=, dim0=, dim1=)", lambda m: torch.transpose(input=m, dim0=1, dim1=3)),
    ("Tensor.transpose(dim0=, dim1=)", lambda m: m.transpose(dim0=2, dim1=3)),
    ("torch.movedim(input=)", lambda m: torch.movedim(input=m, source=1, destination=3)),
    ("Tensor.movedim(source=)", lambda m: m.movedim(source=1, destination=-1)),
    ("torch.unsqueeze(input=)", lambda m: torch.unsqueeze(input=m, dim=1)),
    ("torch.squeeze(input=)", lambda m: torch.squeeze(input=m.unsqueeze(2), dim=2)),
    ("Tensor.unsqueeze(dim=)", lambda m: m.unsqueeze(dim=-1)),
    ("torch.select(input=)", lambda m: torch.select(input=m, dim=1, index=2)),
    ("Tensor.select(dim=, index=)", lambda m: m.select(dim=0, index=1)),
    ("torch.flatten(input=)", lambda m: torch.flatten(input=m, start_dim=0, end_dim=1)),
    ("torch.unflatten(input=)", lambda m: torch.unflatten(input=m, dim=1, sizes=(2, 2))),
    ("Tensor.unflatten(dim=, sizes=)", lambda m: m.unflatten(dim=1, sizes=(2, -1))),
    (
        "torch.reshape(input=, shape=)",
        lambda m: torch.reshape(input=m, shape=(m.shape[0], 2, 2, *m.shape[2:])),
    ),
    ("Tensor.reshape(shape=)", lambda m: m.reshape(shape=(m.shape[0] * 2, 2, *m.shape[2:]))),
    ("Tensor.view(size=)", lambda m: m.view(size=(m.shape[0], 2, 2, *m.shape[2:]))),
    ("Tensor.unfold(dimension=)", lambda m: m.unfold(dimension=1, size=2, step=2)),
    (
        "Tensor.contiguous(memory_format=)",
        lambda m: m.contiguous(memory_format=torch.channels_last) * 2,
    ),
    ("Tensor.clone(memory_format=)", lambda m: m.clone(memory_format=torch.channels_last) * 2),
    ("Tensor.to(dtype=)", lambda m: m.to(dtype=torch.float64) * 2),
    ("Tensor.type_as(other=)", lambda m: m.type_as(other=m) * 2),
    ("Tensor.expand_as(other=)", lambda m: m[:, :1].expand_as(other=m) * m),
    ("Tensor.sum(dim=)", lambda m: m.sum(dim=3, keepdim=True) * m),
    ("Tensor.mean(dim=)", lambda m: m.mean(dim=(2, 3))),
    ("Tensor.std(dim=)", lambda m: m.std(dim=3)),
    ("Tensor.norm(p=, dim=)", lambda m: m.norm(p=2, dim=1)),
    ("Tensor.softmax(dim=)", lambda m: m.softmax(dim=3)),
    ("Tensor.cumsum(dim=)", lambda m: m.cumsum(dim=3)),
]
