"""The fault taxonomy: load `policies/faults.yaml` (shipped in this package) and look faults up.

Nothing else in fleetheal maps an Xid, a counter or a symptom to an action, nor says what an action means
(whether the agent's fast path takes it, whether it requeues the job, which node states it moves the node
through): code asks the `Action` for it, never names an action. This module needs only
the standard library and PyYAML, so the agent stays lean; full JSON-schema validation
(`check_schema`) imports jsonschema lazily.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

UNKNOWN_ID = "unknown"


class TaxonomyError(ValueError):
    """The taxonomy file is malformed; the message names the entry and the field."""


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """The node states an action moves its node through, and the follow-up it starts (all optional)."""

    #: Node state once the gate lets the action act.
    acting: str | None = None
    #: Node state after its playbook succeeded.
    done: str | None = None
    #: Node state when a validation fails (REVALIDATE only).
    rejected: str | None = None
    #: The follow-up action...
    next: str | None = None
    #: ... and when it starts (one of TRIGGERS).
    trigger: str | None = None


@dataclass(frozen=True, slots=True)
class Action:
    name: str
    description: str
    destructive: bool
    playbook: str
    #: The node agent's fast path takes it by default (drain, taint).
    fastpath: bool = False
    #: The remediator runs its latency-critical steps in-process before the playbook (responder.py).
    first_response: bool = False
    #: Its playbook requeues the Slurm job: the per-job retry limit applies.
    requeues_job: bool = False
    #: Once it ran on a node, a later destructive alert there for one of these actions is a duplicate.
    supersedes: tuple[str, ...] = ()
    #: A follow-up action (no fault maps to it): the fault that took the node out maps to one of these.
    follows: tuple[str, ...] = ()
    lifecycle: Lifecycle = Lifecycle()


@dataclass(frozen=True, slots=True)
class Fault:
    id: str
    name: str
    xid: int | None
    fault_class: str
    action: str
    severity: str
    explanation: str
    source: str
    mnemonic: str | None = None
    nvidia_action: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "fault_id": self.id,
            "name": self.name,
            "xid": self.xid,
            "class": self.fault_class,
            "action": self.action,
            "severity": self.severity,
            "explanation": self.explanation,
        }


@dataclass(frozen=True, slots=True)
class DecodeRule:
    """One row of NVIDIA's Xid 144-150 decode: register bit patterns -> fault id."""

    xid: int
    unit: str
    intrinfo_v1: str
    intrinfo_v2: str
    error_status: int
    fault: str

    def matches(self, intrinfo: int, error_status: int) -> bool:
        if error_status != self.error_status:
            return False
        return any((intrinfo & mask) == value for mask, value in (_mask(self.intrinfo_v1), _mask(self.intrinfo_v2)))


@functools.cache
def _mask(pattern: str) -> tuple[int, int]:
    """A 32-character bit pattern ('-' = any bit, most significant first) as (mask, value)."""
    mask = int("".join("0" if c == "-" else "1" for c in pattern), 2)
    value = int(pattern.replace("-", "0"), 2)
    return mask, value


def _schema() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("faults.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _enum(field: str) -> tuple[str, ...]:
    return tuple(_schema()["properties"]["faults"]["items"]["properties"][field]["enum"])


CLASSES: tuple[str, ...] = _enum("class")
SEVERITIES: tuple[str, ...] = _enum("severity")
#: When a lifecycle's `next` action starts: at once when the action succeeded (`done`), when the node's
#: repair is reported (`repaired`), or when the action succeeded and the standby pool is full (`pool_full`).
TRIGGERS: tuple[str, ...] = tuple(
    _schema()["properties"]["actions"]["additionalProperties"]["properties"]["lifecycle"]["properties"]["trigger"][
        "enum"
    ]
)
TRIGGER_TEXT = {
    "done": "at once",
    "repaired": "when the repair is reported",
    "pool_full": "when the standby pool is full",
}
#: Keys of an action's `lifecycle`: node states, then the follow-up.
LIFECYCLE_STATES = ("acting", "done", "rejected")
LIFECYCLE_KEYS = (*LIFECYCLE_STATES, "next", "trigger")
#: Required action fields (besides description, destructive and playbook).
_ACTION_FLAGS = ("fastpath", "first_response", "requeues_job")
_ACTION_LISTS = ("supersedes", "follows")


class Taxonomy:
    """Every fault fleetheal knows, indexed by id and by Xid."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        _check_structure(doc)
        self.actions: dict[str, Action] = {
            name: Action(
                name,
                a["description"],
                a["destructive"],
                a["playbook"],
                fastpath=a["fastpath"],
                first_response=a["first_response"],
                requeues_job=a["requeues_job"],
                supersedes=tuple(a["supersedes"]),
                follows=tuple(a["follows"]),
                lifecycle=Lifecycle(**a["lifecycle"]),
            )
            for name, a in doc["actions"].items()
        }
        #: Node states of the lifecycle (name -> what it means), in the taxonomy's order; the first is the
        #: state of a node in service.
        self.node_states: dict[str, str] = dict(doc["node_states"])
        self.faults: dict[str, Fault] = {}
        self._by_xid: dict[int, Fault] = {}
        for entry in doc["faults"]:
            fault = Fault(
                id=entry["id"],
                name=entry["name"],
                xid=entry["xid"],
                fault_class=entry["class"],
                action=entry["action"],
                severity=entry["severity"],
                explanation=entry["explanation"],
                source=entry["source"],
                mnemonic=entry.get("mnemonic"),
                nvidia_action=entry.get("nvidia_action"),
            )
            self.faults[fault.id] = fault
            # The plain `xid-N` entry is the code's default; decoded variants are reached by id.
            if fault.xid is not None and fault.id == f"xid-{fault.xid}":
                self._by_xid[fault.xid] = fault
        self.decode_rules: tuple[DecodeRule, ...] = tuple(
            DecodeRule(
                xid=r["xid"],
                unit=r["unit"],
                intrinfo_v1=r["intrinfo_v1"],
                intrinfo_v2=r["intrinfo_v2"],
                error_status=int(r["error_status"], 16),
                fault=r["fault"],
            )
            for r in doc["nvlink5_decode"]
        )
        #: Xid 154's recovery actions: NVML's field value -> fault, and the driver's words (lower case) -> fault.
        recovery = doc["recovery_actions"]
        self._recovery_by_value: dict[int, Fault] = {r["value"]: self.faults[r["fault"]] for r in recovery}
        self._recovery_by_text: dict[str, Fault] = {r["text"].lower(): self.faults[r["fault"]] for r in recovery}
        self.unknown = self.faults[UNKNOWN_ID]

    def fault(self, fault_id: str) -> Fault:
        """The fault with this id; KeyError if fleetheal does not know it."""
        return self.faults[fault_id]

    def get(self, fault_id: str) -> Fault:
        """The fault with this id, or the safe `unknown` fault (observe, never destroy)."""
        return self.faults.get(fault_id, self.unknown)

    def moves_node(self, fault_id: str) -> bool:
        """True when the fault's action takes the node out (destructive) or the agent's fast path acts on it."""
        action = self.actions[self.get(fault_id).action]
        return action.destructive or action.fastpath

    def for_xid(self, xid: int) -> Fault:
        """NVIDIA's Xid `xid` as fleetheal classifies it; codes not in the catalog are unknown."""
        return self._by_xid.get(xid, self.unknown)

    def known_xids(self) -> frozenset[int]:
        return frozenset(self._by_xid)

    def decode_nvlink5(self, xid: int, intrinfo: int, error_status: int) -> Fault | None:
        """NVIDIA's decode of an Xid 144-150 register pair, or None when no row matches."""
        for rule in self.decode_rules:
            if rule.xid == xid and rule.matches(intrinfo, error_status):
                return self.faults[rule.fault]
        return None

    def recovery_action(self, value: int) -> Fault | None:
        """The fault NVML's recovery-action field `value` means (None for 0, none, or a value not known)."""
        return self._recovery_by_value.get(value)

    def recovery_action_text(self, text: str) -> Fault | None:
        """The fault the driver's Xid 154 words mean ("Node Reboot Required"), or None."""
        return self._recovery_by_text.get(text.strip().lower())

    def fastpath_actions(self) -> tuple[str, ...]:
        """Actions the node agent's fast path takes by default (`fastpath: true`), in taxonomy order."""
        return tuple(a.name for a in self.actions.values() if a.fastpath)

    def first_response_actions(self) -> tuple[str, ...]:
        """Actions whose latency-critical steps the remediator runs in-process (`first_response: true`)."""
        return tuple(a.name for a in self.actions.values() if a.first_response)

    def requeuing_actions(self) -> tuple[str, ...]:
        """Actions whose playbook requeues the Slurm job (`requeues_job: true`)."""
        return tuple(a.name for a in self.actions.values() if a.requeues_job)

    def followups(self) -> dict[str, tuple[str, ...]]:
        """Follow-up action -> the actions it follows (only actions with a non-empty `follows`)."""
        return {a.name: a.follows for a in self.actions.values() if a.follows}

    def covers(self, owner: str, action: str) -> bool:
        """True when `action` on a node adds nothing once `owner` runs there: the same action, or one
        `owner` supersedes."""
        return owner == action or action in self.actions[owner].supersedes

    def transitions(self) -> list[tuple[str, str, str]]:
        """The node lifecycle as (from state, to state, why) edges, derived from the actions' lifecycles."""
        in_service = next(iter(self.node_states))  # the first state is the one a node is in service in
        edges: list[tuple[str, str, str]] = []
        for a in self.actions.values():
            lc = a.lifecycle
            if lc.acting and not a.follows:
                edges.append((in_service, lc.acting, f"the gate lets {a.name} act"))
            if lc.acting and lc.done:
                edges.append((lc.acting, lc.done, f"{a.name} succeeded"))
            if lc.acting and lc.rejected:
                edges.append((lc.acting, lc.rejected, f"{a.name} failed"))
            if lc.next and lc.done:
                nxt = self.actions[lc.next].lifecycle
                if nxt.acting and nxt.acting != lc.done:
                    edges.append((lc.done, nxt.acting, f"{lc.next} starts {TRIGGER_TEXT.get(lc.trigger or '', '')}"))
        return edges

    def allowed(self, fault_id: str, action: str) -> bool:
        """True when `action` is what the taxonomy maps `fault_id` to."""
        fault = self.faults.get(fault_id)
        return fault is not None and fault.action == action

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults.values())

    def __len__(self) -> int:
        return len(self.faults)


def _check_structure(doc: Mapping[str, Any]) -> None:
    """The checks every reader needs, without jsonschema: ids unique, enums and references closed."""
    for key in ("actions", "node_states", "faults", "recovery_actions", "nvlink5_decode"):
        if key not in doc:
            raise TaxonomyError(f"taxonomy: missing top-level key {key!r}")
    _check_node_states(doc["node_states"])
    _check_actions(doc["actions"], doc["node_states"])
    actions = doc["actions"]
    seen: set[str] = set()
    for i, entry in enumerate(doc["faults"]):
        fid = entry.get("id")
        where = f"taxonomy: faults[{i}] (id {fid!r})"
        if not isinstance(fid, str) or not fid:
            raise TaxonomyError(f"{where}: 'id' must be a non-empty string")
        if fid in seen:
            raise TaxonomyError(f"{where}: duplicate id")
        seen.add(fid)
        if entry.get("class") not in CLASSES:
            raise TaxonomyError(f"{where}: class {entry.get('class')!r} is not one of {', '.join(CLASSES)}")
        if entry.get("action") not in actions:
            raise TaxonomyError(f"{where}: action {entry.get('action')!r} is not one of {', '.join(actions)}")
        if actions[entry["action"]]["follows"]:
            raise TaxonomyError(
                f"{where}: action {entry['action']!r} is a follow-up (it follows "
                f"{', '.join(actions[entry['action']]['follows'])}); no fault maps to it"
            )
        if entry.get("severity") not in SEVERITIES:
            raise TaxonomyError(f"{where}: severity {entry.get('severity')!r} is not one of {', '.join(SEVERITIES)}")
        for field in ("name", "explanation", "source"):
            if not isinstance(entry.get(field), str) or not entry[field].strip():
                raise TaxonomyError(f"{where}: {field!r} must be a non-empty string")
    if UNKNOWN_ID not in seen:
        raise TaxonomyError(f"taxonomy: the safe default fault {UNKNOWN_ID!r} is missing")
    for section in ("recovery_actions", "nvlink5_decode"):
        for i, rule in enumerate(doc[section]):
            if rule.get("fault") not in seen:
                raise TaxonomyError(f"taxonomy: {section}[{i}]: fault {rule.get('fault')!r} is not a fault id")
    values = [r.get("value") for r in doc["recovery_actions"]]
    if len(set(values)) != len(values) or not all(isinstance(v, int) and v > 0 for v in values):
        raise TaxonomyError("taxonomy: recovery_actions: every value must be a distinct positive integer")


def _check_node_states(states: Any) -> None:
    if not isinstance(states, Mapping) or not states:
        raise TaxonomyError("taxonomy: 'node_states' must be a non-empty mapping of state name -> description")
    for name, text in states.items():
        if not isinstance(name, str) or not name:
            raise TaxonomyError(f"taxonomy: node_states: {name!r} is not a state name")
        if not isinstance(text, str) or not text.strip():
            raise TaxonomyError(f"taxonomy: node_states.{name}: the description must be a non-empty string")


def _check_actions(actions: Any, states: Mapping[str, Any]) -> None:
    """Every action's fields present and typed, and every action or state it names defined."""
    if not isinstance(actions, Mapping) or not actions:
        raise TaxonomyError("taxonomy: 'actions' must be a non-empty mapping of action name -> fields")
    for name, a in actions.items():
        where = f"taxonomy: action {name}"
        if not isinstance(a, Mapping):
            raise TaxonomyError(f"{where}: expected a mapping of fields, got {type(a).__name__}")
        for field in ("description", "playbook"):
            if not isinstance(a.get(field), str) or not a[field].strip():
                raise TaxonomyError(f"{where}: {field!r} must be a non-empty string")
        for field in ("destructive", *_ACTION_FLAGS):
            if field not in a:
                raise TaxonomyError(f"{where}: {field!r} is missing (true or false)")
            if not isinstance(a[field], bool):
                raise TaxonomyError(f"{where}: {field!r} must be true or false, got {a[field]!r}")
        for field in _ACTION_LISTS:
            if field not in a:
                raise TaxonomyError(f"{where}: {field!r} is missing (a list of action names, [] for none)")
            names = a[field]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise TaxonomyError(f"{where}: {field!r} must be a list of action names, got {names!r}")
            for other in names:
                if other not in actions:
                    raise TaxonomyError(
                        f"{where}: {field} names {other!r}, which is not an action ({', '.join(actions)})"
                    )
            if name in names:
                raise TaxonomyError(f"{where}: {field} names the action itself")
        if "lifecycle" not in a:
            raise TaxonomyError(f"{where}: 'lifecycle' is missing ({{}} for an action that moves no node)")
        lc = a["lifecycle"]
        if not isinstance(lc, Mapping):
            raise TaxonomyError(f"{where}: 'lifecycle' must be a mapping, got {lc!r}")
        for key, value in lc.items():
            if key not in LIFECYCLE_KEYS:
                raise TaxonomyError(f"{where}: lifecycle.{key} is not one of {', '.join(LIFECYCLE_KEYS)}")
            if key in LIFECYCLE_STATES and value not in states:
                raise TaxonomyError(
                    f"{where}: lifecycle.{key} {value!r} is not one of the node_states ({', '.join(states)})"
                )
        if "next" in lc and lc["next"] not in actions:
            raise TaxonomyError(f"{where}: lifecycle.next {lc['next']!r} is not an action ({', '.join(actions)})")
        if "trigger" in lc and lc["trigger"] not in TRIGGERS:
            raise TaxonomyError(f"{where}: lifecycle.trigger {lc['trigger']!r} is not one of {', '.join(TRIGGERS)}")
        if ("next" in lc) != ("trigger" in lc):
            raise TaxonomyError(f"{where}: lifecycle.next and lifecycle.trigger go together (one is missing)")
        if "next" in lc and "acting" not in actions[lc["next"]].get("lifecycle", {}):
            raise TaxonomyError(
                f"{where}: lifecycle.next {lc['next']!r} has no lifecycle.acting (the node's state while it runs)"
            )


def check_schema(doc: Mapping[str, Any]) -> list[str]:
    """Every JSON-schema violation of `doc`, as 'path: message' lines (empty when valid)."""
    import jsonschema  # lazy: the agent does not need it

    validator = jsonschema.Draft202012Validator(_schema())
    return [
        f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    ]


def raw() -> dict[str, Any]:
    """The taxonomy file as parsed YAML."""
    text = resources.files(__package__).joinpath("faults.yaml").read_text("utf-8")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc: dict[str, Any] = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    return doc


@functools.cache
def load() -> Taxonomy:
    """The shipped taxonomy, parsed once per process."""
    return Taxonomy(raw())


def catalog_gaps(taxonomy: Taxonomy, catalog_csv: str) -> list[str]:
    """Codes of NVIDIA's catalog CSV missing from the taxonomy, or whose mnemonic differs."""
    with open(catalog_csv, encoding="utf-8") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    problems = []
    for row in rows:
        code = int(row["code"])
        fault = taxonomy.faults.get(f"xid-{code}")
        if fault is None:
            problems.append(f"Xid {code} ({row['mnemonic']}) is missing")
        elif fault.mnemonic != row["mnemonic"]:
            problems.append(f"Xid {code}: mnemonic {fault.mnemonic!r} differs from the catalog's {row['mnemonic']!r}")
    return problems
