"""How Slurm prints fields, for the wing's readers: the `-O` field separator, the `CLUSTER: <name>` sections of
a `-M` read, the key=value lines of `scontrol show ... -o` (Slurm 22.05 has no `--json` for `show job`; the
lab's SlurmCluster and the benchmarks read jobs this way), and the JSON numbers of every data parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: The end of every `-O` field of a read (a control character no name, state or reason contains).
SEP = "\x1f"
_CLUSTER_HEADER = re.compile(r"^CLUSTER: (\S+)\s*$")
#: The first field of the column titles `-M` prints after each CLUSTER line.
_TITLES = frozenset({"NODELIST", "JOBID"})
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_.:/]*)=")


def sections(text: str) -> dict[str, str]:
    """`sinfo -M ...`/`squeue -M ...` output split by its `CLUSTER: <name>` lines: name -> that cluster's lines,
    without the column titles that follow each `CLUSTER:` line."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _CLUSTER_HEADER.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None and line.strip():
            if not current and line.split(SEP, 1)[0].strip() in _TITLES:
                continue
            current.append(line)
    return {name: "\n".join(lines) + ("\n" if lines else "") for name, lines in out.items()}


def parse_kv_line(line: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` line into its key=value fields.

    Values may contain spaces (`Comment=`, `Command=`): a value runs up to the next ` Key=`, so a value
    that itself holds ` word=` (a fleetheal comment's `incident=`) is split there.
    """
    line = line.strip()
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def number(value: Any, unset: int = 0) -> int:
    """A JSON number field of any data parser: a plain integer (v0.0.38, v0.0.39), or from v0.0.40 on
    `{"set": true, "infinite": false, "number": 7}`; `unset` when not set or infinite."""
    if isinstance(value, Mapping):
        value = value.get("number") if value.get("set") and not value.get("infinite") else None
    return unset if value is None or value == "" else int(value)
