"""Settings of every fleetheal service: one YAML file plus environment overrides, parsed once.

A part declares each key once, with its type, default and a `#:` comment, as a field of a frozen dataclass
(a nested dataclass is a section), and reads its file with `read_yaml` and `build`. One rule for all:

- `<PREFIX><KEY>` overrides a top-level key and `<PREFIX><SECTION>__<KEY>` a nested one (`__` separates
  levels): `FLEETHEAL_AGENT_BACKEND__KIND=simulated`, `FLEETHEAL_REMEDIATOR_GATE__BUDGET__MAX_ISOLATED=4`.
  Every variable with the prefix must name a setting (a typo is an error, not a silent no-op).
- Values are YAML, in the file and in the environment alike. A boolean is true/false/yes/no/on/off (any
  case); a number may be written as text ("2"); a list is a YAML list or comma-separated text (`A,B`);
  a mapping is a YAML mapping (`{n1: rack-a}`).
- Errors say `<key>: <what is wrong>`, with `(from <VARIABLE>)` after the key when the value came from the
  environment; an unknown key suggests the closest known one. Callers put the file name in front.

Only the standard library and PyYAML: the agent imports this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

#: Field metadata of a dataclass field that is not read from the file or the environment (say a secret
#: read elsewhere, or where the settings came from).
NOT_A_SETTING: Mapping[str, bool] = types.MappingProxyType({"fleetheal.settings.internal": True})
_INTERNAL = "fleetheal.settings.internal"
_TRUE = frozenset({"true", "yes", "on"})
_FALSE = frozenset({"false", "no", "off"})


class ConfigError(ValueError):
    """The configuration is invalid; the message names the file or variable, the key and the fix."""


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML settings file (an empty file is an empty mapping)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    return doc


def build(cls: type[T], doc: Any, env: Mapping[str, str], prefix: str, *, reserved: Collection[str] = ()) -> T:
    """`cls` from a parsed YAML document with `prefix`-ed environment overrides applied (variables named in
    `reserved` are the caller's, not settings). ConfigError names the key (and the variable)."""
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError("the top level must be a mapping of settings")
    merged = _copy(doc)
    origins: dict[tuple[str, ...], str] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(prefix) or name in reserved:
            continue
        path = tuple(p.lower() for p in name[len(prefix) :].split("__"))
        _check_env_path(cls, path, name, prefix)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: not a YAML value: {exc}") from None
        _set_path(merged, path, value)
        origins[path] = name
    return typing.cast(T, _build(cls, merged, (), origins))


def env_name(prefix: str, key: str) -> str:
    """The variable that overrides `key` (dotted: "gate.budget.max_isolated")."""
    return prefix + key.replace(".", "__").upper()


# ---- internals ---------------------------------------------------------------------------------------


def _copy(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in doc.items()}


def _keys(cls: type) -> dict[str, Any]:
    """Setting name -> type hint of a settings dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get(_INTERNAL)}


def _section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _leaf_paths(cls: type, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for name, hint in _keys(cls).items():
        out += _leaf_paths(hint, (*path, name)) if _section(hint) else [(*path, name)]
    return out


def _check_env_path(cls: type, path: tuple[str, ...], name: str, prefix: str) -> None:
    keys = _keys(cls)
    for depth, key in enumerate(path):
        if key not in keys:
            flat = {prefix + "_".join(p).upper(): env_name(prefix, ".".join(p)) for p in _leaf_paths(cls)}
            if name in flat:  # one underscore where the rule wants two
                raise ConfigError(f"{name}: no such setting (did you mean {flat[name]}? `__` separates sections)")
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f" (did you mean {env_name(prefix, '.'.join([*path[:depth], close[0]]))}?)" if close else ""
            raise ConfigError(f"{name}: no setting {key!r}{hint}")
        if depth < len(path) - 1:
            if not _section(keys[key]):
                raise ConfigError(f"{name}: {key!r} is not a section")
            keys = _keys(keys[key])


def _set_path(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for depth, part in enumerate(path[:-1]):
        child = doc.setdefault(part, {})
        if child is None:
            child = doc[part] = {}
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise ConfigError(f"{where}: expected a mapping of settings, got {type(child).__name__}")
        doc = child
    doc[path[-1]] = value


def _where(path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> str:
    key = ".".join(path)
    for depth in range(len(path), 0, -1):
        if path[:depth] in origins:
            return f"{key} (from {origins[path[:depth]]})"
    return key


def _build(cls: type, doc: Any, path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> Any:
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{_where(path, origins)}: expected a mapping of settings, got {type(doc).__name__}")
    keys = _keys(cls)
    for key in doc:
        if key not in keys:
            close = difflib.get_close_matches(str(key), list(keys), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(keys)}"
            raise ConfigError(f"{'.'.join((*path, str(key)))}: unknown key; {hint}")
    kwargs: dict[str, Any] = {}
    for key, hint in keys.items():
        sub = (*path, key)
        if _section(hint):
            kwargs[key] = _build(hint, doc.get(key), sub, origins)
        elif key in doc:
            kwargs[key] = _convert(doc[key], hint, _where(sub, origins))
    return cls(**kwargs)


def _convert(value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint` names, or ConfigError naming `where`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif not isinstance(value, list | tuple):
            value = [value]
        return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        if args and _section(args[1]):  # a mapping of named sections (say clusters by name)
            return types.MappingProxyType({str(k): _build(args[1], v, (where, str(k)), {}) for k, v in value.items()})
        if args and args[1] is str:  # a mapping of names: an empty value is ""
            return types.MappingProxyType(
                {str(k): "" if v is None else _convert(v, str, where) for k, v in value.items()}
            )
        return types.MappingProxyType(dict(value))
    if hint is bool:
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        # A number may be quoted ("2"); a boolean is not a number, and an integer setting takes no 2.5.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return hint(value)
        if isinstance(value, bool) or not isinstance(value, int if hint is int else int | float):
            raise ConfigError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {value!r}")
        return hint(value)
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported setting type {hint}")  # pragma: no cover - a bug in a settings class
