"""The fault taxonomy: load `policies/faults.yaml` (shipped in this package) and look faults up.

Nothing else in fleetheal maps an Xid, a counter or a symptom to an action. This module needs only
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
class Action:
    name: str
    description: str
    destructive: bool
    playbook: str


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


class Taxonomy:
    """Every fault fleetheal knows, indexed by id and by Xid."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        _check_structure(doc)
        self.actions: dict[str, Action] = {
            name: Action(name, a["description"], bool(a["destructive"]), a["playbook"])
            for name, a in doc["actions"].items()
        }
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
        self.unknown = self.faults[UNKNOWN_ID]

    def fault(self, fault_id: str) -> Fault:
        """The fault with this id; KeyError if fleetheal does not know it."""
        return self.faults[fault_id]

    def get(self, fault_id: str) -> Fault:
        """The fault with this id, or the safe `unknown` fault (observe, never destroy)."""
        return self.faults.get(fault_id, self.unknown)

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
    for key in ("actions", "faults", "nvlink5_decode"):
        if key not in doc:
            raise TaxonomyError(f"taxonomy: missing top-level key {key!r}")
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
        if entry.get("severity") not in SEVERITIES:
            raise TaxonomyError(f"{where}: severity {entry.get('severity')!r} is not one of {', '.join(SEVERITIES)}")
        for field in ("name", "explanation", "source"):
            if not isinstance(entry.get(field), str) or not entry[field].strip():
                raise TaxonomyError(f"{where}: {field!r} must be a non-empty string")
    if UNKNOWN_ID not in seen:
        raise TaxonomyError(f"taxonomy: the safe default fault {UNKNOWN_ID!r} is missing")
    for i, rule in enumerate(doc["nvlink5_decode"]):
        if rule.get("fault") not in seen:
            raise TaxonomyError(f"taxonomy: nvlink5_decode[{i}]: fault {rule.get('fault')!r} is not a fault id")


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
