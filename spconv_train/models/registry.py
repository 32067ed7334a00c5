"""A small timm-style model registry: ``register_model`` / ``create_model`` / ``list_models``.

Every registered builder is called as ``builder(num_classes=..., in_channels=..., **options)``
and must return an ``nn.Module`` whose forward maps ``N x in_channels x H x W`` to plain
logits ``N x num_classes x H x W``. Keeping one interface for every model lets the trainer,
the parallel plan and the tests treat all of them alike.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "UnknownModelError",
    "WeightsLoadError",
    "create_model",
    "list_models",
    "register_model",
]

ModelBuilder = Callable[..., nn.Module]
_B = TypeVar("_B", bound=ModelBuilder)

_REGISTRY: dict[str, ModelBuilder] = {}

# Arguments that create_model always passes itself; they are not per-model "options".
_COMMON_ARGS = ("num_classes", "in_channels")
# How many missing/unexpected keys to show in an error before eliding the rest.
_MAX_KEYS_SHOWN = 5


class UnknownModelError(KeyError):
    """Raised by :func:`create_model` for a name that no builder was registered under."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument, which would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class WeightsLoadError(RuntimeError):
    """Raised when a ``weights=`` file cannot be read or does not fit the model."""


def register_model(name: str) -> Callable[[_B], _B]:
    """Register a model builder (a function or an ``nn.Module`` class) under ``name``.

    Use as a decorator::

        @register_model("my_net")
        def my_net(*, num_classes: int, in_channels: int = 3, width: int = 16) -> nn.Module: ...

    The builder must accept ``num_classes`` and ``in_channels`` as keyword arguments; its
    other keyword parameters become the options accepted by :func:`create_model`.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(builder: _B) -> _B:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered (by {_REGISTRY[name]!r})")
        _REGISTRY[name] = builder
        return builder

    return decorator


def register_family(
    library: str, names: tuple[str, ...], make: Callable[[str], Callable], target: str
) -> None:
    """Register ``library.<name>`` for each of ``names``: ``make(name)`` returns its
    builder, whose ``model.kwargs`` go to ``target`` (``{name}`` filled in; for the help)."""
    for name in names:
        build = make(name)
        build.__name__ = f"{library}_{name}"
        build.__doc__ = f"{library}.{name} (``model.kwargs`` go to ``{target.format(name=name)}``)."
        register_model(f"{library}.{name}")(build)


def list_models() -> list[str]:
    """Return the names of all registered models, sorted."""
    return sorted(_REGISTRY)


def create_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int = 3,
    weights: str | Path | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: a name from :func:`list_models`.
        num_classes: number of output channels (classes) of the logits.
        in_channels: number of input image channels.
        weights: optional path to a local ``.pt``/``.pth`` file holding either a state dict
            or a dict with the state dict under ``"model"``. It is loaded strictly; nothing
            is ever downloaded.
        **kwargs: model-specific options (see the builder's signature).

    Returns:
        The model, whose forward returns plain logits ``N x num_classes x H x W``.

    Raises:
        UnknownModelError: ``name`` is not registered (the message suggests close names).
        TypeError: ``kwargs`` holds an option the model does not accept.
        FileNotFoundError: ``weights`` does not exist.
        WeightsLoadError: ``weights`` cannot be read or its keys/shapes do not match.
    """
    builder = _get_builder(name)
    _check_options(name, builder, kwargs)
    model = builder(num_classes=num_classes, in_channels=in_channels, **kwargs)
    if weights is not None:
        load_weights(model, weights)
    return model


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a local state-dict file into ``model`` strictly, with errors naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {str(path)!r}")
    try:
        # weights_only=True: never unpickle arbitrary objects from a checkpoint file.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        from spconv_train.checkpoint.safe_load import load_error_text  # lazy: pulls in DCP

        # never torch's advice to retry with weights_only off (that runs the file's code)
        raise WeightsLoadError(
            f"could not read weights file {str(path)!r}: {load_error_text(exc)}; give a "
            "state-dict file of tensors (torch.save(model.state_dict(), path))"
        ) from None

    state_dict = obj.get("model", obj) if isinstance(obj, dict) else obj
    if not isinstance(state_dict, dict):
        raise WeightsLoadError(
            f"weights file {str(path)!r} holds a {type(state_dict).__name__}, expected a state "
            "dict or a dict with the state dict under 'model'"
        )

    # Compare keys ourselves first so the message names the file and stays short.
    expected = set(model.state_dict())
    found = set(state_dict)
    missing = sorted(expected - found)
    unexpected = sorted(found - expected)
    if missing or unexpected:
        parts = [f"weights file {str(path)!r} does not match the model"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_preview(unexpected)}")
        raise WeightsLoadError("; ".join(parts))
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:  # e.g. shape mismatches
        raise WeightsLoadError(f"could not load weights file {str(path)!r}: {exc}") from exc


def _get_builder(name: str) -> ModelBuilder:
    try:
        return _REGISTRY[name]
    except KeyError:
        pass
    available = list_models()
    message = f"unknown model {name!r}"
    close = difflib.get_close_matches(name, available, n=3)
    if close:
        message += f"; did you mean {' or '.join(repr(c) for c in close)}?"
    message += f" Available models: {', '.join(available) or '(none registered)'}"
    raise UnknownModelError(message)


def _check_options(name: str, builder: ModelBuilder, kwargs: dict[str, Any]) -> None:
    """Reject options the builder does not take, before calling it, with a readable message."""
    params = inspect.signature(builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the builder takes **kwargs itself; let it decide
    accepted = [
        p.name
        for p in params.values()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name not in _COMMON_ARGS
    ]
    bad = sorted(set(kwargs) - set(accepted))
    if bad:
        raise TypeError(
            f"model {name!r} got unexpected option(s) {', '.join(map(repr, bad))}; "
            f"accepted options: {', '.join(accepted) or '(none)'}"
        )


def _preview(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_KEYS_SHOWN])
    if len(keys) > _MAX_KEYS_SHOWN:
        shown += f", ... (+{len(keys) - _MAX_KEYS_SHOWN} more)"
    return shown
