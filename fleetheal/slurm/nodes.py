"""The one reader of Slurm's nodes, and the rules on them (drained, responding, an owned reason).

Every reader of node state uses it: the agent's fast path, the remediator's steps and lifecycle, the
playbooks (through the `fleetheal.cluster` collection's filters), and the lab's `SlurmCluster`.

The source is the text of `sinfo NODES_ARGS`: it honours `-n NODE` (the JSON of Slurm 22.05's
`sinfo --json` ignores filters), costs a fraction of the JSON at fleet size (1,500 nodes:
44 kB against 1.8 MB, and 22.05's JSON printer is slow), and its `-O` fields are named, not positional,
so a release that adds fields changes nothing here (measured on Debian's 22.05.8). Each field ends with the
unit separator, a character no name, state or reason of ours holds; the free-text fields come last (a stray
one in the Comment could shift only the Extra). Extra is fleetheal's record: Slinky's operator writes its pod's
identity into the Comment of its nodes. sinfo lists the nodes of partitions: a node in none is not read.

`read` also takes a JSON document of nodes (`{"nodes": [...]}`) for cross-checks and callers that have
one; this module is the one place that knows its shapes: `sinfo --json` of Slurm 22.05 (openapi v0.0.38:
`state` a lower-case word, `state_flags` a list) and `scontrol --json show node` of 23.02 and later (data
parser v0.0.39+: `state` a list of upper-case words, base state and flags together; `reason_changed_at`
an integer, from v0.0.40 `{"set", "infinite", "number"}`), up to 26.05's v0.0.45. A newer `sinfo --json`
prints partition rows (`"sinfo": [...]`, 24.11) instead of nodes: refused, not read as an empty cluster.
The same versions' job fields are read by `fleetheal.slurm.jobs`.

The fleet's read (`FLEET_SINFO_ARGS`, `with_gres`) is the same node read of every cluster (`-M all`) with the
`Gres` and `GresUsed` fields at the end of each line: `fleetheal fleet status` and placement read it.

Standard library only (and fleetheal.contracts): the agent imports it.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fleetheal.contracts import DRAIN_REASON_PREFIX, owns_reason
from fleetheal.slurm.fields import SEP, number

_FIELDS = ("NodeList", "StateComplete", "Timestamp", "Reason", "Comment", "Extra")
#: `sinfo` arguments of a node read (`sinfo_argv`); add `-n NODE` for one node.
NODES_ARGS = ("-N", "-h", "-O", ",".join(f"{f}:{SEP}" for f in _FIELDS))
#: The two fields the fleet's read adds at the end of each node line.
_GRES_FIELDS = ("Gres", "GresUsed")
#: The fleet's read: the node read of every cluster with the GRES fields; without `-h`: with it, `-M` leaves out
#: the `CLUSTER: <name>` lines (measured on 22.05.8).
FLEET_SINFO_ARGS = (
    "-M",
    "all",
    *(a for a in NODES_ARGS[:-1] if a != "-h"),
    NODES_ARGS[-1] + "," + ",".join(f"{f}:{SEP}" for f in _GRES_FIELDS),
)
#: Slurm's base node states (slurm.h NODE_STATE_BASE); everything else in a state is a flag.
BASE_STATES = frozenset({"UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE"})
#: What Slurm appends to a base state in text: `*` not responding, `~` powered off, `#` powering up...
_STATE_MARKS = "*~#%$@^-!"


def sinfo_argv(sinfo: str = "sinfo", node: str = "") -> list[str]:
    """The command of a node read: every node, or only `node`."""
    return [sinfo, *NODES_ARGS, *(("-n", node) if node else ())]


@dataclass(frozen=True, slots=True)
class Node:
    """One Slurm node."""

    name: str
    #: Base state, upper case: IDLE, ALLOCATED, MIXED, DOWN, UNKNOWN...
    state: str
    #: State flags, upper case: DRAIN, NOT_RESPONDING, COMPLETING, DYNAMIC_NORM...
    flags: frozenset[str]
    #: The reason ("" when none), without Slurm's `[user@time]`.
    reason: str = ""
    #: The node's comment ("" when none). Slinky's operator owns it on its nodes (its pod's identity).
    comment: str = ""
    #: When slurmctld recorded the reason, local ISO time to the second (Slurm's default
    #: SLURM_TIME_FORMAT); "" when none, which sorts first.
    reason_time: str = ""
    #: The node's Extra field ("" when none): where fleetheal records which incident promoted it.
    extra: str = ""

    @property
    def drained(self) -> bool:
        """DRAINED and DRAINING nodes (Slurm's DRAIN flag)."""
        return "DRAIN" in self.flags

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags and self.state != "DOWN"

    def reason_owned(self, prefix: str = DRAIN_REASON_PREFIX) -> bool:
        """The reason is one fleetheal wrote (`contracts.owns_reason`)."""
        return owns_reason(self.reason, prefix)

    def as_dict(self, owned_prefix: str = DRAIN_REASON_PREFIX) -> dict[str, Any]:
        """The node as the playbooks and the remediator's steps see it (`slurm_node`)."""
        return {
            "found": True,
            "name": self.name,
            "state": self.state,
            "flags": sorted(self.flags),
            "drained": self.drained,
            "responding": self.responding,
            "reason": self.reason,
            "reason_owned": self.reason_owned(owned_prefix),
            "comment": self.comment,
            "extra": self.extra,
        }


_MISSING = {
    "found": False,
    "state": "",
    "flags": [],
    "drained": False,
    "responding": False,
    "reason": "",
    "reason_owned": False,
    "comment": "",
    "extra": "",
}


class Nodes(dict[str, Node]):
    """Every node of one read, by name. The scans a storm's first responses repeat (standby pool, promoted
    nodes) are built once per read: scanning the fleet for each of N incidents made the storm quadratic."""

    @functools.cached_property
    def _drained(self) -> list[Node]:
        return sorted((n for n in self.values() if n.drained), key=lambda n: n.name)

    @functools.cached_property
    def _noted(self) -> list[tuple[str, frozenset[str]]]:
        return sorted((n.name, frozenset(n.extra.split())) for n in self.values() if n.extra)

    def with_reason(self, prefix: str) -> list[str]:
        """Names of drained nodes whose reason starts with `prefix` (e.g. the standby pool), sorted."""
        return [n.name for n in self._drained if n.reason.startswith(prefix)]

    def with_extra(self, word: str) -> list[str]:
        """Names of nodes whose Extra field has the word `word` (how a promotion is tied to its incident), sorted."""
        return [name for name, words in self._noted if word in words]


def _state(text: str) -> tuple[str, frozenset[str]]:
    """`IDLE*+DRAIN` (any case) -> ("IDLE", {"DRAIN", "NOT_RESPONDING"})."""
    base, *flags = text.upper().split("+")
    if base.endswith("*"):
        flags.append("NOT_RESPONDING")
    return base.rstrip(_STATE_MARKS) or "UNKNOWN", frozenset(f for f in flags if f)


def parse_text(text: str) -> Nodes:
    """What `sinfo NODES_ARGS` printed. An empty reason prints `none`, an empty comment `(null)`, an unset
    time `Unknown`; `-N` lists a node once per partition, and the first line counts."""
    nodes = Nodes()
    for line in text.splitlines():
        name, state, stamp, reason, comment, extra, *_ = [*line.split(SEP, 5), "", "", "", "", "", ""]
        extra = extra.removesuffix(SEP)
        if not name or not state or name in nodes:
            continue
        base, flags = _state(state)
        nodes[name] = Node(
            name=name,
            state=base,
            flags=flags,
            reason="" if reason == "none" else reason,
            comment="" if comment == "(null)" else comment,
            reason_time="" if stamp == "Unknown" else stamp,
            extra="" if extra == "(null)" else extra,
        )
    return nodes


def _time(value: Any) -> str:
    seconds = number(value)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(seconds)) if seconds > 0 else ""


def _json_node(node: Mapping[str, Any]) -> Node:
    state = node.get("state")
    if isinstance(state, list):  # v0.0.39+: ["IDLE", "DRAIN"]
        words = [str(s).upper() for s in state]
        base = next((w for w in words if w in BASE_STATES), "UNKNOWN")
        flags = frozenset(w for w in words if w != base)
    else:  # v0.0.38: "idle" and state_flags ["DRAIN"]
        base, flags = _state(str(state or "unknown"))
        flags |= {str(f).upper() for f in node.get("state_flags") or []}
    return Node(
        name=str(node.get("name")),
        state=base,
        flags=flags,
        reason=str(node.get("reason") or ""),
        comment=str(node.get("comment") or ""),
        reason_time=_time(node.get("reason_changed_at")),
        extra=str(node.get("extra") or ""),
    )


def parse_json(doc: Mapping[str, Any]) -> Nodes:
    """A `{"nodes": [...]}` document (see the module's docstring for the versions read)."""
    if not isinstance(doc.get("nodes"), list):
        raise ValueError("a JSON document of nodes has a `nodes` list (`scontrol --json show node`)")
    nodes = Nodes()
    for raw in doc["nodes"]:
        node = _json_node(raw)
        nodes.setdefault(node.name, node)
    return nodes


def read(value: Any) -> Nodes:
    """Nodes from what a node read printed (text or JSON), a decoded JSON document, or `Nodes` as they are."""
    if isinstance(value, Nodes):
        return value
    if isinstance(value, Mapping):
        return parse_json(value)
    if isinstance(value, str):
        return parse_json(json.loads(value)) if value.lstrip().startswith("{") else parse_text(value)
    raise ValueError("expected what `sinfo` printed for fleetheal.slurm.nodes.NODES_ARGS, or a JSON document of nodes")


def slurm_node(nodes: Any, name: str, owned_prefix: str = DRAIN_REASON_PREFIX) -> dict[str, Any]:
    """One node of `read(nodes)` as a dict (`Node.as_dict`); `{"found": False, ...}` when Slurm does not know it."""
    node = read(nodes).get(name)
    return node.as_dict(owned_prefix) if node is not None else {**_MISSING, "name": name}


def node_state(node: Node) -> str:
    """The fleet view's state of a node (`fleetheal fleet status`, placement): down (DOWN, not responding)
    before drained (DRAIN) before the base state."""
    if not node.responding:
        return "down"
    if node.drained:
        return "drained"
    base = node.state.lower()
    return base if base in ("idle", "mixed", "allocated") else "other"


def with_gres(text: str) -> Iterator[tuple[Node, str, str]]:
    """(node, its `Gres`, its `GresUsed`) for each node of one cluster's section of `sinfo FLEET_SINFO_ARGS`.
    `-N` lists a node once per partition: the first line counts."""
    seen: set[str] = set()
    for line in text.splitlines():
        parts = line.rsplit(SEP, len(_GRES_FIELDS) + 1)
        if len(parts) != len(_GRES_FIELDS) + 2:
            continue
        head, gres, used, _ = parts
        read = parse_text(head + SEP)
        if len(read) != 1:
            continue
        node = next(iter(read.values()))
        if node.name in seen:
            continue
        seen.add(node.name)
        yield node, gres, used
