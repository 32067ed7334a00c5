"""Reading checkpoints without running code from them.

A run folder may come from someone else, and a pickle can run any code when it is loaded.
Everything the tool reads from a checkpoint goes through this module:

* DCP's ``.metadata`` is a pickle (``FileSystemReader.read_metadata`` unpickles it):
  :class:`SafeFileSystemReader` reads it with an unpickler that builds only DCP's metadata
  classes, ``torch.Size``, dtypes, layouts and plain containers, and refuses anything else
  with a ``CheckpointError`` naming the file.
* DCP's non-tensor values (the optimizer's param groups) are pickles too, which
  ``DefaultLoadPlanner.load_bytes`` reads with ``weights_only`` off: the planners here
  read them with ``weights_only=True``.
* ``torch.load(weights_only=True)`` errors carry torch's advice to retry with
  ``weights_only`` off; :func:`load_error_text` keeps only what was refused.

Checked against torch 2.14.1 (``torch/distributed/checkpoint/filesystem.py``,
``default_planner.py``, ``format_utils.py``): the classes a ``.metadata`` pickle names, the
body of ``read_metadata``, ``load_bytes`` and ``dcp_to_torch_save`` follow that version.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from spconv_train.checkpoint.files import CheckpointError

__all__ = [
    "SafeFileSystemReader",
    "WeightsOnlyLoadPlanner",
    "load_checkpoint_state",
    "load_error_text",
    "read_dcp_metadata",
    "read_full_state",
]

_DCP = "torch.distributed.checkpoint"
#: module -> names a DCP ``.metadata`` pickle may name (torch 2.14.1 writes these).
_ALLOWED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset(
        {
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),  # and dtypes, checked by value in find_class
    "torch.serialization": frozenset({"_get_layout"}),  # maps "torch.strided" to the layout
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple"}),
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle named something outside ``_ALLOWED``."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the objects of a DCP metadata pickle; anything else is refused before it
    is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"persistent id {pid!r}")


def _refused(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: refused: {why}. A checkpoint written by spconv-train never holds this, "
        "and loading it could run code: do not use this run folder (ask its sender for the "
        "exported model.pt, which loads without code, or start over with --overwrite)",
        code=2,
    )


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The DCP ``Metadata`` pickled in ``path`` (a checkpoint's ``.metadata``), read by the
    restricted unpickler; ``CheckpointError`` (exit 2) naming the file if it names anything
    but DCP's metadata classes, or points DCP at files outside its folder."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _RefusedGlobal as exc:
        raise _refused(path, f"its pickle names {exc}, not a DCP metadata class") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})", code=2) from exc
    except Exception as exc:  # truncated or garbled: a corrupt file, not an attack
        raise CheckpointError(
            f"{path}: not a DCP metadata file ({type(exc).__name__}: {exc})", code=2
        ) from None
    if not isinstance(metadata, Metadata):
        raise _refused(path, f"it holds a {type(metadata).__name__}, not DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or re.search(r"[/\\]", name):
            raise _refused(path, f"it points at {name!r}, outside the checkpoint folder")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles nothing but DCP's metadata
    (``read_dcp_metadata``); the rest is torch's (tensors are read with
    ``weights_only=True`` there)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch 2.14.1's body, with its unpickler replaced by the restricted one. DCP
        # retries a failed read with rank-local metadata (``__{rank}.metadata``), which
        # spconv-train never writes.
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: no rank-local DCP metadata is read", code=2)
        metadata = read_dcp_metadata(self._get_metadata_path())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` (torch 2.14.1) with ``weights_only=True``."""
    fqn = read_item.dest_index.fqn
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"DCP value {fqn!r}: refused: {load_error_text(exc)}; a checkpoint written by "
            "spconv-train holds only plain values there, and loading it could run code",
            code=2,
        ) from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


class _WeightsOnlyEmptyPlanner(_EmptyStateDictLoadPlanner):
    """``_EmptyStateDictLoadPlanner`` (the state dict built from the metadata, as
    ``dcp_to_torch_save`` uses it) reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


def _unwrap(exc: BaseException) -> BaseException:
    """The ``CheckpointError`` a rank raised inside DCP (its ``CheckpointException`` wraps
    each rank's failure), else ``exc``."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                return CheckpointError(str(inner), code=2)
    return exc


def load_checkpoint_state(state: dict[str, Any], folder: str | Path) -> None:
    """``dcp.load(state, checkpoint_id=folder)`` (collective) through the safe reader and
    planner: fills ``state``'s tensors in place; a refused file raises ``CheckpointError``."""
    read_dcp_metadata(Path(folder) / ".metadata")  # every rank: a clear error, not DCP's dump
    try:
        dcp.load(
            state, storage_reader=SafeFileSystemReader(folder), planner=WeightsOnlyLoadPlanner()
        )
    except (Exception, CheckpointException) as exc:
        unwrapped = _unwrap(exc)
        if unwrapped is exc:
            raise
        raise unwrapped from exc


def read_full_state(folder: str | Path) -> dict[str, Any]:
    """Every value of DCP checkpoint ``folder`` as plain tensors (``dcp_to_torch_save``
    without its ``torch.save``/``torch.load`` round trip; one process, no process group)."""
    read_dcp_metadata(Path(folder) / ".metadata")  # a clear error, not DCP's retries
    state: dict[str, Any] = {}
    reader = SafeFileSystemReader(folder)
    try:
        _load_state_dict(
            state, storage_reader=reader, planner=_WeightsOnlyEmptyPlanner(), no_dist=True
        )
    except (Exception, CheckpointException) as exc:
        unwrapped = _unwrap(exc)
        if unwrapped is exc:
            raise
        raise unwrapped from exc
    return state


_REFUSED = (
    re.compile(r"unsupported GLOBAL ([\w.]+)"),  # a blocked module (os, posix, subprocess...)
    re.compile(r"Unsupported global: GLOBAL ([\w.]+)"),  # not on the allowed list
    re.compile(r"(Unsupported operand \d+)"),  # an opcode weights-only pickles never use
)


def load_error_text(exc: BaseException) -> str:
    """What a failed ``torch.load(weights_only=True)`` refused, in one line, without torch's
    advice to retry with ``weights_only`` off (which would run the file's code)."""
    text = str(exc)
    if "weights_only" not in text and "Weights only" not in text:
        return f"{type(exc).__name__}: {text}"
    for pattern in _REFUSED:
        found = pattern.search(text)
        if found:
            what = found.group(1)
            what = what if what.startswith("Unsupported") else f"it names {what}"
            return f"not a weights-only file ({what}, not a tensor or plain value)"
    return "not a weights-only file (it holds objects other than tensors and plain values)"
