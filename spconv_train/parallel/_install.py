"""``install()``: register the built-in spatial handlers and modules, once, explicitly.

Importing ``spconv_train.parallel`` registers and patches nothing. ``install()`` (idempotent,
thread-safe; called first by ``parallelize``, ``SpatialMode`` and ``extend``'s registration
functions, so a user's handler is never overwritten) imports every op module, applies the
default refusal table below, and makes the parallel layer's changes to torch state:
Dynamo's routed functions (``_compile.route_through_modes``), the no-silent-gather guard
(``_errors.install_guard``), the tiles' token guard on ``full_tensor`` / ``redistribute``
(``_errors.install_token_guard``) and DTensor's element-wise rule for three backward ops
(``_errors.add_pointwise_strategies``).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._registry import DEFAULT_REGISTRY

_LOCK = threading.Lock()
_INSTALLED = False

#: Ops that DTensor would run by gathering the width or that would be wrong on strips; the
#: op modules register handlers for those they implement, which take precedence.
# fmt: off
REFUSED_BY_DEFAULT = (
    "conv1d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "lp_pool2d",
    "adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_max_pool2d_with_indices",
    "fractional_max_pool2d", "interpolate", "grid_sample", "affine_grid", "batch_norm",
    "group_norm", "instance_norm", "layer_norm", "local_response_norm", "pad",
    "fold", "pixel_shuffle", "pixel_unshuffle", "cross_entropy", "nll_loss", "embedding",
)
# fmt: on
REFUSAL_REASON = (
    "no spatial implementation (it would gather the whole image or mix strips wrongly). Use "
    "a supported layer, register a handler (spconv_train.parallel.extend, "
    "docs/extending.md), or run this part of the model on a gathered tensor explicitly "
    "(x.full_tensor())."
)


def _named(name: str) -> list[Callable]:
    """The distinct ``F``/``torch``/``torch._C._nn`` functions called ``name``."""
    found = {}
    for ns in (F, torch, torch._C._nn):
        fn = getattr(ns, name, None)
        if fn is not None:
            found[id(fn)] = fn
    return list(found.values())


def installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return _INSTALLED


def install() -> None:
    """Register every built-in spatial handler and module swap, then the default refusals.

    Idempotent: the first call does the work, later calls return at once. ``parallelize``
    calls it; call it yourself only to inspect the default registry before parallelizing."""
    global _INSTALLED
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        package = __name__.rpartition(".")[0]
        path = importlib.import_module(package).__path__
        # Every private module of the package: the op modules register on import; the
        # others are imported by them anyway. New op modules need no list kept here.
        for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
            if info.name.startswith("_") and not info.name.startswith("__"):
                importlib.import_module(f"{package}.{info.name}")
        for name in REFUSED_BY_DEFAULT:
            DEFAULT_REGISTRY.refuse(*_named(name), reason=REFUSAL_REASON)
        from ._errors import add_pointwise_strategies, install_guard, install_token_guard

        install_guard()
        install_token_guard()
        add_pointwise_strategies()
        _INSTALLED = True
