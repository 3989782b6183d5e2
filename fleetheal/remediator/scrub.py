"""Keeping secrets out of playbook runs: which site settings and environment values are secrets, the 0600
in-memory file that hands the secret site settings to ansible-playbook, and masking what still reached an
event or an artifact (runner.py calls these; its header says what reaches Ansible and what never does).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetheal import procs
from fleetheal.remediator import config as cfgmod

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH", re.IGNORECASE)
MASK = "***"
#: Site settings named so are secrets (`runner.secret_vars` names more): never written to a run directory.
SECRET_SITE_VAR = re.compile(r"_(?:token|password|passphrase|secret|credentials?|api_key|private_key)$")
#: Shorter strings of a secret site setting are not masked in artifacts (they would mask random text),
#: as for secret environment variables (environment_secrets).
MIN_MASKED = 8
#: The file of a run's secret site settings: <dir>/fleetheal-secret-vars-<pid>-<random>.json (0600).
SECRET_FILE_PREFIX = "fleetheal-secret-vars-"  # noqa: S105 - a file name, not a password


def secret_site_vars(cfg: cfgmod.RunnerConfig) -> dict[str, Any]:
    """The site settings that are secrets: named like one (SECRET_SITE_VAR) or listed in runner.secret_vars."""
    listed = set(cfg.secret_vars)
    return {k: v for k, v in cfg.site_vars.items() if k in listed or SECRET_SITE_VAR.search(k)}


def secret_strings(value: Any) -> Iterator[str]:
    """Every string of a secret setting worth masking, also as JSON writes it (escaped)."""
    if isinstance(value, str):
        if len(value) >= MIN_MASKED:
            yield value
            yield json.dumps(value)[1:-1]
            yield json.dumps(value, ensure_ascii=False)[1:-1]
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from secret_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from secret_strings(v)


def secret_vars_dir() -> str:
    """Where the secret settings' file of a run lives: /dev/shm (memory) when usable, else the temp dir."""
    shm = "/dev/shm"  # noqa: S108 - a private 0600 file made by mkstemp
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


def remove_stale_secret_files(directory: str | None = None) -> int:
    """Remove the secret settings' files a dead remediator left (a crash mid-run); how many were removed."""
    directory = directory or secret_vars_dir()
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(SECRET_FILE_PREFIX):
            continue
        pid_text = entry.name[len(SECRET_FILE_PREFIX) :].split("-", 1)[0]
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if not pid_text.isdigit() or owner != os.getuid():
            continue
        pid = int(pid_text)
        if pid == os.getpid() or procs.alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed += 1
    return removed


def write_secret_file(doc: Mapping[str, Any]) -> str:
    fd, path = tempfile.mkstemp(prefix=f"{SECRET_FILE_PREFIX}{os.getpid()}-", suffix=".json", dir=secret_vars_dir())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp: 0600, O_EXCL
            json.dump(dict(doc), f, sort_keys=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


def environment_secrets(
    env: Mapping[str, str], extra: Iterable[str] = (), allowed: Iterable[str] = ()
) -> tuple[str, ...]:
    """Values to keep out of artifacts: `extra` plus every secret-named variable of `env` (8+ chars)
    except the `allowed` names an operator handed to Ansible on purpose."""
    keep = set(allowed)
    values = {v for v in extra if v}
    values.update(v for k, v in env.items() if SECRET_NAME.search(k) and k not in keep and len(v) >= 8)
    return tuple(sorted(values, key=len, reverse=True))


def scrub_value(value: Any, secrets: Sequence[str]) -> Any:
    if isinstance(value, str):
        for s in secrets:
            if s in value:
                value = value.replace(s, MASK)
        return value
    if isinstance(value, dict):
        for k in list(value):
            value[k] = scrub_value(value[k], secrets)
        return value
    if isinstance(value, list):
        return [scrub_value(v, secrets) for v in value]
    return value


def scrub_tree(root: Path, secrets: Sequence[str]) -> int:
    """Replace secret values in every file under `root`; returns how many files changed."""
    if not secrets:
        return 0
    needles = [s.encode() for s in secrets]
    changed = 0
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        new = data
        for n in needles:
            new = new.replace(n, MASK.encode())
        if new != data:
            path.write_bytes(new)
            changed += 1
    return changed
