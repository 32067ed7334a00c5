"""Dispatch modes that measure a step. ``CommAudit``: the communication, and hidden
activation gathers (unlike DTensor's ``CommDebugMode`` it sees the halo's point-to-point
traffic and plain ``dist.all_reduce``); ``grows_with_image``: the flagged ones a wider
image does not repeat. ``LiveBytes``: the activation memory a forward leaves alive for its
backward, exactly: the storages created under the meter and still referenced, by C++ weak
references (a Python weakref to the tensor dies with its wrapper while autograd's saved
copy lives on).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_P2P = ("send", "recv", "recv_", "recv_any_source_")
_SKIP = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")
#: Parts of the names of ops that move (pieces of) a whole tensor between ranks rather than
#: reducing it (``all_gather``, ``allgather``, ``reduce_scatter``, ...).
_GATHER_LIKE = ("gather", "scatter", "all_to_all", "alltoall", "broadcast")


@dataclass
class CommRecord:
    """One communication op: its name, kind and the elements of its (largest) tensor."""

    op: str
    #: "p2p", "reduce", "gather", or "param": a gather-like op on a flat 1-D buffer, which
    #: is FSDP moving parameter shards and gradients (an activation that DTensor moves
    #: keeps its N-D shape), never flagged as an activation
    kind: str
    numel: int
    shape: tuple[int, ...]


class CommAudit(TorchDispatchMode):
    """Record c10d ops while active (``with CommAudit() as audit: ...``)."""

    #: the audits now active (innermost last), and how deep ``counted_as_reduce`` is
    _active: list[CommAudit] = []
    _inside_reduce = 0

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []

    def __enter__(self):
        CommAudit._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        CommAudit._active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if CommAudit._inside_reduce:
            return func(*args, **kwargs)  # counted once, as the reduce it implements
        if any(issubclass(t, DTensor) for t in types):
            # A DTensor op: let DTensor run it, so the collectives it issues inside (its
            # redistributions) come back here as plain-tensor ops and are counted too.
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in _NAMESPACES and name not in _SKIP:
            ts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            shape = tuple(max(ts, key=torch.Tensor.numel).shape) if ts else ()
            moves = "param" if len(shape) == 1 else "gather"
            kind = moves if any(g in name for g in _GATHER_LIKE) else "reduce"
            kind = "p2p" if name in _P2P else kind
            self.records.append(CommRecord(name, kind, math.prod(shape) if ts else 0, shape))
        return func(*args, **kwargs)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "elements": total}}``."""
        counts, elements = Counter(), Counter()
        for r in self.records:
            counts[r.kind], elements[r.kind] = counts[r.kind] + 1, elements[r.kind] + r.numel
        return {k: {"count": counts[k], "elements": elements[k]} for k in counts}

    def activation_sized(
        self, min_elements: int, param_shapes: set[tuple[int, ...]] = frozenset()
    ) -> list[CommRecord]:
        """Records of at least ``min_elements`` that look like a moved activation: a gather,
        or a reduction of a spatial map (last two dims > 1) of no parameter's shape."""

        def flagged(r: CommRecord) -> bool:
            spatial = len(r.shape) >= 3 and min(r.shape[-2:]) > 1 and r.shape not in param_shapes
            return r.kind == "gather" or (r.kind == "reduce" and spatial)

        return [r for r in self.records if r.numel >= min_elements and flagged(r)]


def grows_with_image(flagged: list[CommRecord], wider: list[CommRecord]) -> list[CommRecord]:
    """The records of ``flagged`` (activation-sized, one image) whose op and shape the same
    step on a wider image (``wider``: all its records) did not repeat as often: those grow
    with the image (a channel-attention map, a bias table's gradient do not)."""
    seen = Counter((r.op, r.shape) for r in wider)
    need = Counter((r.op, r.shape) for r in flagged)
    return [r for r in flagged if need[(r.op, r.shape)] > seen[(r.op, r.shape)]]


@contextlib.contextmanager
def counted_as_reduce(tensor: torch.Tensor):
    """The c10d ops issued inside count as one ``reduce`` of ``tensor`` to every audit."""
    for audit in CommAudit._active:
        audit.records.append(
            CommRecord("exchange_sum", "reduce", tensor.numel(), tuple(tensor.shape))
        )
    CommAudit._inside_reduce += 1
    try:
        yield
    finally:
        CommAudit._inside_reduce -= 1


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
