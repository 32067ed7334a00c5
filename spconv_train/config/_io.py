"""Reading, overriding and writing configs: defaults < YAML file < ``--set`` overrides."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ._build import build_config, show
from ._errors import ConfigError
from .schema import Config

OVERRIDE_HELP = "use --set key.sub=value, e.g. --set training.steps=5"


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float and rejects duplicate keys.

    PyYAML follows YAML 1.1, where a float needs a dot: ``lr: 3e-3`` would load as the
    string "3e-3" and fail the type check, which surprises everyone. A key written twice
    would silently keep the last value.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


# The YAML 1.2 core-schema exponent forms missing from YAML 1.1 ("1e-3", "2E5").
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class _Dumper(yaml.SafeDumper):
    """Block-style sections, but short lists (betas, scale) on one line."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.SequenceNode:
    flow = all(isinstance(v, (str, int, float, bool)) or v is None for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _yaml_reason(exc: yaml.YAMLError) -> str:
    """One-line description of a YAML error with its (1-based) line and column."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = exc.problem or "syntax error"
        context = f" ({exc.context})" if exc.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{context}"
    return str(exc)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(str(path), f"cannot read config file: {why}") from exc
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {_yaml_reason(exc)}") from exc


def _apply_override(raw: dict[str, Any], text: str) -> None:
    """Set ``raw[a][b] = value`` for the override ``"a.b=value"`` (value parsed as YAML)."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or "--set", f"malformed override {text!r}; {OVERRIDE_HELP}")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(key, f"malformed override key {key!r}; {OVERRIDE_HELP}")
    try:
        value = yaml.load(value_text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        reason = _yaml_reason(exc)
        raise ConfigError(key, f"cannot parse override value {value_text!r}: {reason}") from exc
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            parent = ".".join(parts[: depth + 1])
            raise ConfigError(
                parent, f"is a value ({show(child)}), not a section; cannot set {key!r}"
            )
        node = child
    node[parts[-1]] = value


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    *,
    check_paths: bool = True,
) -> Config:
    """Load, merge and validate a config: defaults < YAML file at ``path`` < ``overrides``.

    ``path`` may be ``None`` (defaults only). Each override is ``"a.b=value"`` with the value
    parsed as YAML (``training.steps=5``, ``optimizer.betas=[0.9,0.99]``,
    ``model.weights=null``). ``check_paths=False`` skips the file-system checks (data.root,
    model.weights), for commands that create those files. Raises ``ConfigError`` naming the
    offending key on any problem.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    source = "config" if path is None else str(path)
    raw = {} if path is None else _read_yaml(Path(path))
    if raw is None:  # an empty file means "all defaults"
        raw = {}
    if overrides and not isinstance(raw, dict):
        build_config(raw, source)  # reports the malformed top level, naming the file
    for text in overrides:
        _apply_override(raw, text)
    return build_config(raw, source, check_paths=check_paths)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts/lists (a deep copy), ready for YAML or JSON."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives back an equal config.

    The file is written atomically (temporary file + rename) so a crash never leaves a
    half-written config in a run folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Resolved spconv-train config (all defaults filled in).\n" + yaml.dump(
        config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False
    )
    # Same folder (so the rename is atomic), pid in the name (ranks never collide).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
