"""A checkpoint's manifest (``meta.json``) and its plain state files.

The manifest carries a ``digest``: the sha256 of its own other fields as canonical JSON,
checked before any field is used, so a damaged manifest (one flipped bit in ``"step"``)
is found like any corrupt file. Formats 1 and 2 had no digest and are read as they are.

The scheduler state and each rank's ``extra`` state (RNG states: python's tuple, numpy's
array, torch's byte tensor; counters) are JSON files: tuples, tensors, arrays and dicts
with non-string keys become tagged objects, so nothing is unpickled to read them back.
"""

from __future__ import annotations

import base64
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from spconv_train.checkpoint.files import CheckpointError
from spconv_train.checkpoint.safe_load import load_error_text

__all__ = [
    "META",
    "decode_state",
    "encode_state",
    "listed_files",
    "manifest_digest",
    "manifest_text",
    "read_manifest",
    "read_state",
    "read_state_file",
    "state_file",
    "write_state",
]

META = "meta.json"
#: tags of the JSON state encoding (a dict holding one of them is an encoded value)
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__")


def manifest_digest(meta: dict[str, Any]) -> str:
    """sha256 of ``meta`` without its ``digest`` field, as canonical JSON."""
    fields = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_text(meta: dict[str, Any]) -> str:
    """The text of ``meta.json`` for ``meta``, with its digest."""
    meta = json.loads(json.dumps(meta))  # as read back (non-string keys become strings)
    return json.dumps({**meta, "digest": manifest_digest(meta)}, indent=1) + "\n"


def read_manifest(folder: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(meta, None)`` for a sound ``meta.json`` in ``folder``, else ``(None, problem)``
    with a line naming the file: missing, unreadable, not JSON, or failing its digest."""
    path = Path(folder) / META
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"{path}: missing (the checkpoint was never completed)"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        meta = json.loads(text)
    except ValueError:
        return None, f"{path}: not valid JSON (the manifest is corrupt)"
    if not isinstance(meta, dict):
        return None, f"{path}: not a manifest (a JSON {type(meta).__name__})"
    digest, fmt = meta.get("digest"), meta.get("format", 1)
    if not (isinstance(fmt, int) and isinstance(meta.get("step"), int)):
        return None, f"{path}: not a checkpoint manifest (no integer format and step)"
    if digest is None and fmt <= 2:
        return meta, None  # written before manifests carried a digest
    if digest != manifest_digest(meta):
        return None, f"{path}: digest mismatch (the manifest was altered or is corrupt)"
    return meta, None


def _tensor_bytes(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()


def encode_state(obj: Any, where: str = "state") -> Any:
    """``obj`` as JSON-able values (see the module docstring); ``TypeError`` naming the
    entry ``where`` for anything else (a function, an arbitrary object)."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if torch.is_tensor(obj):
        dtype = str(obj.dtype).removeprefix("torch.")
        return {"__tensor__": dtype, "shape": list(obj.shape), "data": _tensor_bytes(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode_state(v, f"{where}.{k}") for k, v in obj.items()}
        pairs = [
            [encode_state(k, where), encode_state(v, f"{where}[{k!r}]")] for k, v in obj.items()
        ]
        return {"__dict__": pairs}
    np = _numpy()
    if np is not None and isinstance(obj, np.generic):
        return obj.item()
    if np is not None and isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        raw = base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode()
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape), "data": raw}
    raise TypeError(
        f"{where}: a {type(obj).__name__} cannot be stored in a checkpoint (plain values, "
        "tuples, lists, dicts, tensors and numeric numpy arrays can)"
    )


def _numpy():
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return None
    return np


def _decode_tensor(value: dict) -> torch.Tensor:
    dtype = getattr(torch, str(value["__tensor__"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {value['__tensor__']!r}")
    raw = base64.b64decode(value["data"])
    shape = [int(n) for n in value["shape"]]
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


def decode_state(value: Any) -> Any:
    """The object ``encode_state`` encoded as ``value``; ``ValueError`` if it is malformed."""
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return _decode_tensor(value)
    if "__ndarray__" in value:
        np = _numpy()
        dtype = None if np is None else np.dtype(str(value["__ndarray__"]))
        if dtype is None or dtype.kind not in "biufc":
            raise ValueError(f"unsupported array dtype {value['__ndarray__']!r}")
        raw = base64.b64decode(value["data"])
        return np.frombuffer(raw, dtype=dtype).reshape(value["shape"]).copy()
    if "__tuple__" in value:
        return tuple(decode_state(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode_state(k): decode_state(v) for k, v in value["__dict__"]}
    return {k: decode_state(v) for k, v in value.items()}


def write_state(path: Path, obj: Any) -> None:
    """Write ``obj`` (see ``encode_state``) as the JSON file ``path``."""
    path.write_text(json.dumps(encode_state(obj, path.name)) + "\n", encoding="utf-8")


def read_state(path: Path) -> Any:
    """The object in JSON state file ``path``; ``CheckpointError`` (exit 2) naming the file
    if it is not one."""
    try:
        return decode_state(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a valid state file ({exc})", code=2) from None


def state_file(folder: Path, stem: str, fmt: int) -> Path:
    """The scheduler (``stem`` "scheduler") or per-rank ("extra-rank{r}") state file of a
    checkpoint of format ``fmt``."""
    return folder / f"{stem}.{'json' if fmt >= 3 else 'pt'}"


def read_state_file(path: Path, fmt: int) -> Any:
    """A scheduler or per-rank state file: JSON (format 3) or, for formats 1 and 2, a torch
    file read weights-only; ``CheckpointError`` (exit 2) naming it otherwise."""
    if fmt >= 3:
        return read_state(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: refused: {load_error_text(exc)}. Loading it could run code; resume from "
            "a checkpoint written by this version, or start over with --overwrite",
            code=2,
        ) from None


def listed_files(folder: Path, meta: dict[str, Any], rank: int) -> set[str]:
    """The files of ``folder`` its manifest lists (all of them for format 1, which lists
    none); rank 0 warns about, and the load ignores, every other file."""
    present = {p.name for p in folder.iterdir()} - {META}
    if "files" not in meta:
        return present
    listed = set(meta["files"])
    unlisted = sorted(present - listed)
    if unlisted and rank == 0:
        warnings.warn(
            f"{folder}: ignoring {', '.join(unlisted)}: not in its manifest ({META}), so "
            "not written by this checkpoint's save",
            stacklevel=4,
        )
    return listed & present
