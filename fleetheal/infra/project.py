"""The Pulumi project on disk: where it is, the keys `Pulumi.yaml` declares, the values stack files set.

`Pulumi.yaml` is the single place that declares every key (type, default, description); a stack file
(`Pulumi.<stack>.yaml`) only overrides. fleetheal.infra.config checks the values into a StackConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetheal.settings import ConfigError
from fleetheal.tools import CHECKOUT

PROJECT = "fleetheal"


def _project_root() -> Path:
    """The Pulumi project: the checkout this package sits in, or for an installed wheel the nearest
    directory holding Pulumi.yaml from the working directory up (as the Pulumi CLI looks), else the
    working directory (`fleetheal render --root` names another)."""
    if (CHECKOUT / "Pulumi.yaml").is_file():
        return CHECKOUT
    cwd = Path.cwd()
    return next((d for d in (cwd, *cwd.parents) if (d / "Pulumi.yaml").is_file()), cwd)


REPO_ROOT = _project_root()
PROJECT_FILE = REPO_ROOT / "Pulumi.yaml"

#: Optional secrets. Pulumi.yaml declares them with the default "" (not set) and without `secret: true`:
#: the engine requires a declared key that has no default, and refuses a default for a secret key. A
#: value set without `--secret` is refused when the program runs (it would sit in the stack file in clear).
SECRET_KEYS = frozenset({"slurmKey", "slurmJwtKey", "remediatorToken", "remediatorDbPassword"})


@dataclass(frozen=True, slots=True)
class Declaration:
    key: str
    type: str
    description: str
    default: Any = None
    has_default: bool = False
    secret: bool = False
    items: str | None = None


def declarations(project_file: Path = PROJECT_FILE) -> dict[str, Declaration]:
    """Every config key declared in `Pulumi.yaml`, by bare name."""
    doc = yaml.safe_load(project_file.read_text(encoding="utf-8"))
    out: dict[str, Declaration] = {}
    for key, spec in (doc.get("config") or {}).items():
        if ":" in key:  # a provider's setting (kubernetes:...), given a value there, not a fleetheal key
            continue
        out[key] = Declaration(
            key=key,
            type=spec["type"],
            description=spec.get("description", ""),
            default=spec.get("default"),
            has_default="default" in spec,
            secret=bool(spec.get("secret", False)) or key in SECRET_KEYS,
            items=(spec.get("items") or {}).get("type"),
        )
    return out


def stack_values(stack: str, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Values of `Pulumi.<stack>.yaml` by bare name; encrypted (`secure:`) values become None (not decryptable here)."""
    path = root / f"Pulumi.{stack}.yaml"
    if not path.exists():
        raise ConfigError(
            f"stack {stack!r}: {path} does not exist; stacks here: {', '.join(list_stacks(root)) or 'none'}"
        )
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    out: dict[str, Any] = {}
    for key, value in (doc.get("config") or {}).items():
        ns, _, bare = key.partition(":")
        if ns != PROJECT or not bare:
            continue  # provider settings (kubernetes:context ...) belong to the provider
        out[bare] = None if isinstance(value, dict) and set(value) == {"secure"} else value
    return out


def list_stacks(root: Path = REPO_ROOT) -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in root.glob("Pulumi.*.yaml"))
