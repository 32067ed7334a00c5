"""``install()``: the built-in handlers, module swaps, refusals and torch patches, once.

Importing ``spconv_train.parallel`` registers and patches nothing; ``install()`` (idempotent,
thread-safe; first in ``parallelize``, ``SpatialMode`` and ``extend``, so a user's handler is
never overwritten) imports every op module, applies the refusal table below and installs
``_errors``' guards and DTensor's element-wise rule for three backward ops.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

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


def installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return _INSTALLED


def install() -> None:
    """Register every built-in handler and module swap, then the default refusals (the
    first call; later ones return at once). Call it to inspect the default registry."""
    global _INSTALLED
    if _INSTALLED:
        return
    with _LOCK:
        if _INSTALLED:
            return
        package = __name__.rpartition(".")[0]
        path = importlib.import_module(package).__path__
        # every private module: the op modules register on import (no list kept here)
        for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
            if info.name.startswith("_") and not info.name.startswith("__"):
                importlib.import_module(f"{package}.{info.name}")
        for name in REFUSED_BY_DEFAULT:  # the distinct F / torch / torch._C._nn functions
            found = [getattr(ns, name, None) for ns in (F, torch, torch._C._nn)]
            fns = {id(fn): fn for fn in found if fn is not None}
            DEFAULT_REGISTRY.refuse(*fns.values(), reason=REFUSAL_REASON)
        from ._errors import add_pointwise_strategies, install_guard, install_token_guard

        install_guard()
        install_token_guard()
        add_pointwise_strategies()
        _INSTALLED = True
