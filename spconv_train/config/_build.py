"""Build the typed ``Config`` from plain YAML data, driven by the dataclass field types.

Supported field types: nested dataclasses (sections), ``bool``, ``int``, ``float``,
``str``, ``Literal[...]`` of strings, ``list[X]``, ``dict[str, Any]``, ``X | None`` and a
scalar-or-list union such as ``int | list[int]`` (a YAML list takes the list arm).
Adding a field to ``schema.py`` needs no code here; a range rule goes in ``_checks.py``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Union

from ._checks import CROSS_CHECKS, FIELD_CHECKS, PATH_CHECKS
from ._errors import ConfigError
from .schema import Config

_NONE_TYPE = type(None)
_SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def show(value: Any) -> str:
    """Short repr of a user-supplied value for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _show_typed(value: Any) -> str:
    """``show`` plus the YAML-ish type, for type errors (``'5' (a string)``)."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    kind = {**kinds, list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)
    return "null" if value is None else f"{show(value)} ({kind})"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field types of a dataclass (cached: get_type_hints is not cheap)."""
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and _NONE_TYPE in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    arms = _union_arms(tp)
    return arms[0] if len(arms) == 1 else Union[arms]  # noqa: UP007 (a runtime union)


def _union_arms(tp: Any) -> tuple[Any, ...]:
    """The arms of a union without ``None`` (empty for a non-union type)."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return ()
    return tuple(a for a in typing.get_args(tp) if a is not _NONE_TYPE)


def describe(tp: Any) -> str:
    """Human description of a field type, completing "expected ..."."""
    if _is_optional(tp):
        return f"{describe(_strip_optional(tp))} or null"
    if len(_union_arms(tp)) > 1:
        return " or ".join(describe(a) for a in _union_arms(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_PLURALS.get(args[0], 'values')}"
    if origin is dict or tp is dict:
        return "a mapping"
    if is_dataclass(tp):
        return "a section (mapping of " + ", ".join(f.name for f in fields(tp)) + ")"
    return _SCALAR_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def _fail_type(key: str, tp: Any, value: Any, where: str = "") -> typing.NoReturn:
    raise ConfigError(key, f"{where}expected {describe(tp)}, got {_show_typed(value)}")


def _convert(value: Any, tp: Any, key: str, where: str = "", declared: Any = None) -> Any:
    """Check ``value`` against the field type ``tp`` and return the typed value.

    ``where`` prefixes the reason for list items ("item 1: ") so the key stays the field;
    ``declared`` is the type to describe in errors (``tp`` before ``| None`` was stripped).
    """
    declared = tp if declared is None else declared
    if _is_optional(tp):
        inner = _strip_optional(tp)
        return None if value is None else _convert(value, inner, key, where, declared)
    if len(_union_arms(tp)) > 1:
        # scalar-or-list: a list goes to the list arm, anything else to the first scalar arm
        arms = _union_arms(tp)
        is_list = isinstance(value, (list, tuple))
        arm = next((a for a in arms if (typing.get_origin(a) is list) == is_list), arms[0])
        return _convert(value, arm, key, where, declared)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_dataclass(tp):
        # An empty section (all keys commented out) loads as null: it means "defaults".
        value = {} if value is None else value
        if not isinstance(value, Mapping):
            _fail_type(key, declared, value, where)
        return _build_section(tp, value, key)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        hint = _suggest(value, list(args)) if isinstance(value, str) else ""
        reason = f"{where}expected {describe(declared)}, got {_show_typed(value)}"
        raise ConfigError(key, f"{reason}; {hint}" if hint else reason)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _fail_type(key, declared, value, where)
        return [_convert(v, args[0], key, f"item {i}: ") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(key, f"{where}expected a mapping with string keys, got {show(value)}")
        return copy.deepcopy(dict(value))
    if tp is Any:
        return value
    # bool is a subclass of int: `steps: true` must not pass as 1.
    if isinstance(value, bool) != (tp is bool):
        _fail_type(key, declared, value, where)
    if tp is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, tp):
        _fail_type(key, declared, value, where)
    return value


def _unknown_key(prefix: str, key: str, valid: list[str]) -> ConfigError:
    hint = _suggest(key, valid) or "valid keys: " + ", ".join(valid)
    return ConfigError(f"{prefix}.{key}" if prefix else key, f"unknown key; {hint}")


def _build_section(cls: type, raw: Mapping[Any, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``; missing keys take the defaults."""
    hints = _hints(cls)
    names = [f.name for f in fields(cls)]
    for key in raw:
        if key not in hints:
            raise _unknown_key(prefix, str(key), names)
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        key = f"{prefix}.{name}" if prefix else name
        value = _convert(raw[name], hints[name], key)
        for check in FIELD_CHECKS.get(key, ()) if value is not None else ():
            if not check.test(value):
                # Report the value as written (-1, not -1.0).
                raise ConfigError(key, f"expected {check.expected}, got {show(raw[name])}")
        kwargs[name] = value
    return cls(**kwargs)


def build_config(raw: Any, source: str = "config", *, check_paths: bool = True) -> Config:
    """Validate plain data (as loaded from YAML) and return the typed ``Config``.

    ``source`` names where ``raw`` came from, for the top-level error.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        sections = ", ".join(f.name for f in fields(Config))
        raise ConfigError(
            source,
            f"top level must be a mapping of sections ({sections}), got {_show_typed(raw)}",
        )
    cfg = _build_section(Config, raw, "")
    # Defaults never go through _build_section, so cross checks cover them too.
    for cross_check in CROSS_CHECKS + (PATH_CHECKS if check_paths else ()):
        problem = cross_check(cfg)
        if problem is not None:
            raise ConfigError(*problem)
    return cfg
