"""Read what `scontrol show node|job -o` prints (Slurm 22.05 has no `--json` for these).

Shared by the agent's fast path, the remediator and the lab's SlurmCluster harness.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeInfo:
    """One node as `scontrol show node -o` reports it."""

    name: str
    #: Base state, upper case: IDLE, ALLOCATED, MIXED, DOWN, UNKNOWN...
    state: str
    #: State flags after the base state: DRAIN, NOT_RESPONDING, COMPLETING, DYNAMIC_NORM...
    flags: frozenset[str]
    #: The reason text without Slurm's trailing `[user@time]`, or None.
    reason: str | None
    #: Every other key=value field, as printed.
    fields: Mapping[str, str] = field(repr=False)

    @property
    def drained(self) -> bool:
        """True for DRAINED and DRAINING nodes (Slurm's DRAIN flag)."""
        return "DRAIN" in self.flags

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags and self.state != "DOWN"


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_.:/]*)=")
#: What Slurm prints after a node's reason: `[user@time]`, then (when the node has one) ` Comment=...`.
_REASON_TAIL = re.compile(r"\s*\[[^\]@]*@[^\]]*\](?:\s+Comment=(.*))?\s*$")


def parse_kv_line(line: str, to_end: str | None = None) -> dict[str, str]:
    """Parse one `scontrol show ... -o` line into its key=value fields.

    Values may contain spaces (`Comment=`, `Command=`): a value runs up to the next ` Key=`. The
    field named `to_end` (a node's `Reason`, which Slurm prints last) runs to the end of the line,
    because owned reasons themselves contain `key=value` words.
    """
    line = line.strip()
    tail: dict[str, str] = {}
    if to_end is not None:
        marker = f" {to_end}="
        idx = line.find(marker)
        if idx >= 0:
            tail[to_end] = line[idx + len(marker) :]
            line = line[:idx]
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    out.update(tail)
    return out


def parse_node_line(line: str) -> NodeInfo:
    """One `scontrol show node -o` line -> NodeInfo."""
    kv = parse_kv_line(line, to_end="Reason")
    if "NodeName" not in kv:
        raise ValueError(f"not a node line: {line!r}")
    base, *flags = kv.get("State", "UNKNOWN").split("+")
    reason = kv.get("Reason")
    if reason is not None:
        tail = _REASON_TAIL.search(reason)
        if tail is not None:
            if tail.group(1) is not None:
                kv["Comment"] = tail.group(1).strip()
            reason = reason[: tail.start()]
        reason = reason.strip() or None
        if reason == "(null)":
            reason = None
    return NodeInfo(
        name=kv["NodeName"],
        state=base.rstrip("*~#!%$@^-").upper(),
        flags=frozenset(f.upper() for f in flags),
        reason=reason,
        fields=kv,
    )
