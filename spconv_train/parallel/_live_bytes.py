"""``LiveBytes``: the activation memory a forward leaves alive for its backward, exactly:
the storages created under the meter and still referenced, by C++ weak references (a
Python weakref to the tensor dies with its wrapper while autograd's saved copy lives on).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Dispatch mode recording every op output; ``live()`` sums those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: it is new only if that
        # input was made while the meter runs (then it is recorded already). A view of a
        # parameter (a conv tap's weight slice) is no activation.
        inputs = {_storage(t, nn.Parameter) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            st = _storage(t)
            if st is not None and st._cdata not in {i._cdata for i in inputs if i is not None}:
                self.refs[st._cdata] = (StorageWeakRef(st), st.nbytes())
        return out

    def live(self) -> int:
        """Bytes of the recorded storages whose tensor is still alive."""
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def _storage(t, *also: type) -> torch.UntypedStorage | None:
    """The storage of a plain tensor (or of one of the types ``also``), else ``None``."""
    if type(t) is not torch.Tensor and type(t) not in also:
        return None
    try:
        return t.untyped_storage()
    except RuntimeError:  # no storage (e.g. a meta or functional tensor)
        return None


class PeakBytes(LiveBytes):
    """``LiveBytes`` that also keeps ``peak``: the most bytes alive after any op (inputs,
    outputs, gradients, saved tensors, message buffers created while active)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.refs = {k: r for k, r in self.refs.items() if not r[0].expired()}
        self.peak = max(self.peak, self.live())
        return out
