"""The small checks the stack config's readers share; each raises ConfigError naming the key and what it
accepts (fleetheal.infra.schema checks what a JSON Schema can say; these are the rest)."""

from __future__ import annotations

import re
from typing import Any

from fleetheal.infra.project import PROJECT
from fleetheal.settings import ConfigError

RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def one_of(key: str, value: str, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ConfigError(f"{PROJECT}:{key}: {value!r} is not accepted; use one of: {', '.join(accepted)}")
    return value


def dns_label(key: str, value: str, max_len: int = 63) -> str:
    if not RFC1123_LABEL.match(value) or len(value) > max_len:
        raise ConfigError(
            f"{PROJECT}:{key}: {value!r} is not accepted; use lower-case letters, digits and '-', "
            f"starting and ending with a letter or digit, at most {max_len} characters"
        )
    return value


def percent(key: str, value: int) -> int:
    if not 0 <= value <= 100:
        raise ConfigError(f"{PROJECT}:{key}: {value} is not accepted; use an integer from 0 to 100")
    return value


def at_least(key: str, value: int, low: int) -> int:
    if value < low:
        raise ConfigError(f"{PROJECT}:{key}: {value} is not accepted; use an integer >= {low}")
    return value


def pinned(key: str, image: str) -> str:
    """An image reference with an explicit tag other than `latest`, or a digest."""
    if "@sha256:" in image:
        return image
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag or not tag or tag == "latest":
        raise ConfigError(
            f"{PROJECT}:{key}: {image!r} is not pinned; use REPOSITORY:TAG with a tag other than 'latest', "
            "or REPOSITORY@sha256:DIGEST"
        )
    return image


def fields(where: str, item: Any, accepted: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with {', '.join(accepted)}, got {item!r}")
    unknown = sorted(set(item) - set(accepted))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted fields: {', '.join(accepted)}")
    missing = [k for k in required if k not in item]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}; accepted fields: {', '.join(accepted)}")
    return item


def names(where: str, value: Any, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {what}, got {value!r}")
    for v in value:
        if not isinstance(v, str) or not pattern.match(v):
            raise ConfigError(f"{where}: {v!r} is not accepted as {what} (pattern {pattern.pattern})")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: {what} repeat in {value!r}")
    return tuple(value)


def int_range(where: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ConfigError(f"{where}: {value!r} is not accepted; use an integer from {low} to {high}")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {value!r} is not accepted; use an integer from {low} to {high}")
    return int(value)


def unique_named(where: str, raw: Any, pattern: re.Pattern[str], what: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, item) of a list of objects with a `name`, each name valid and given once."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of objects, got {raw!r}")
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not pattern.match(name):
            raise ConfigError(
                f"{where}[{i}].name: {name!r} is not a valid {what}; use lower-case letters, digits and '-', "
                f"starting with a letter (pattern {pattern.pattern})"
            )
        if name in seen:
            raise ConfigError(f"{where}[{i}].name: {what} {name!r} is declared twice; names must be unique")
        seen.add(name)
        out.append((name, item))
    return out
