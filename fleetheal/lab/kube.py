"""`FakeKubeApiServer`: a TEST DOUBLE of the Kubernetes API server, for the lab and tests.

The lab runs it when `make tools` has not built the real control plane (`fleetheal.lab.controlplane`):
`make demo` does not build it, and `fleetheal lab up` says which one it started. It is not Kubernetes: it
holds a few resource types in memory, has no kubelet, scheduler or controllers, and deletes pods at once
(no graceful termination). What it does
follow is the API's wire semantics, closely enough that the official `kubernetes` Python client and
Ansible's `kubernetes.core` modules (k8s, k8s_info, k8s_drain, k8s_taint, which discover resources
through /api, /apis and the group-version resource lists) work against it over HTTP:

- discovery: /version, /api, /apis, /api/v1, /apis/policy, /apis/policy/v1;
- Nodes and Namespaces (cluster scoped), Pods and PodDisruptionBudgets (namespaced): get, list, create,
  replace (PUT), patch (strategic-merge, merge and JSON patch), delete, and the `status` subresources;
- label selectors (=, ==, !=, exists, !exists, in, notin) and field selectors (metadata.name,
  metadata.namespace, spec.nodeName, status.phase);
- `pods/eviction` (policy/v1 Eviction): 201 when every matching PodDisruptionBudget allows a disruption,
  429 TooManyRequests with a DisruptionBudget cause when one would be violated, 500 when more than one
  budget selects the pod (as the real server answers); PDB status is computed when read;
- one global resourceVersion counter (like etcd's revision) stamped on every object, 409 Conflict when an
  update or patch carries a stale `metadata.resourceVersion` or a delete a stale precondition, 409
  AlreadyExists, 404 NotFound and 422 Invalid answered as `Status` objects;
- watch (`?watch=1`) for every type: newline-delimited events, replayed from a `resourceVersion` still
  in the history window (410 Gone as an ERROR event when it is not), `timeoutSeconds`;
- `?dryRun=All` validates without storing; optional bearer-token check; optional JSON persistence of
  the whole state (written after each change), so `fleetheal lab up` can run it as a background
  process: `python -m fleetheal.lab.kube --port P --state FILE --kubeconfig FILE`.

Server-side apply (`application/apply-patch+yaml`) is answered 415: nothing here needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from aiohttp import web

from fleetheal.lab.supervisor import Supervisor

Obj = dict[str, Any]

#: Version reported at /version: the API level this double imitates.
KUBE_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-fleetheal-test-double",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-11-29T00:00:00Z",
    "goVersion": "none (Python test double)",
    "compiler": "none",
    "platform": "linux/amd64",
}
#: Events kept for watches that resume from a resourceVersion.
HISTORY = 2000

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class ResourceType:
    """One resource the double serves."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ("status",)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
RESOURCES = (
    ResourceType("", "v1", "namespaces", "namespace", "Namespace", False, ("ns",)),
    ResourceType("", "v1", "nodes", "node", "Node", False, ("no",)),
    ResourceType("", "v1", "pods", "pod", "Pod", True, ("po",), ("status", "eviction")),
    ResourceType("policy", "v1", "poddisruptionbudgets", "poddisruptionbudget", "PodDisruptionBudget", True, ("pdb",)),
)
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
#: Strategic-merge list keys (from the real types' patchMergeKey tags) for the fields the double holds.
_MERGE_KEYS = {
    "metadata.ownerReferences": "uid",
    "status.conditions": "type",
    "status.addresses": "type",
    "spec.containers": "name",
    "spec.initContainers": "name",
    "spec.volumes": "name",
    "spec.containers.ports": "containerPort",
    "spec.containers.env": "name",
}
_SUPPORTED_FIELDS = {
    "Pod": ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"),
    "Node": ("metadata.name", "spec.unschedulable"),
    "Namespace": ("metadata.name", "status.phase"),
    "PodDisruptionBudget": ("metadata.name", "metadata.namespace"),
}


class ApiError(Exception):
    """An API error, answered as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_found(rt: ResourceType, name: str) -> ApiError:
    group = f".{rt.group}" if rt.group else ""
    return ApiError(
        404, "NotFound", f'{rt.plural}{group} "{name}" not found', {"name": name, "group": rt.group, "kind": rt.plural}
    )


def conflict(rt: ResourceType, name: str) -> ApiError:
    group = f".{rt.group}" if rt.group else ""
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.plural}{group} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        {"name": name, "group": rt.group, "kind": rt.plural},
    )


def invalid(rt: ResourceType, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """causes: (field, reason, message) — reason as the real API names it (FieldValueRequired...)."""
    text = ", ".join(f"{f}: {m}" for f, _, m in causes)
    return ApiError(
        422,
        "Invalid",
        f'{rt.kind} "{name}" is invalid: {text}',
        {
            "name": name,
            "group": rt.group,
            "kind": rt.kind,
            "causes": [{"reason": r, "message": m, "field": f} for f, r, m in causes],
        },
    )


# ---- patches -------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """Kubernetes strategic merge patch for the fields this double holds.

    Maps merge key by key (null deletes; `$patch: replace|delete` directives), lists are replaced except
    those with a patchMergeKey in the real types (_MERGE_KEYS), merged element by element on that key
    (an element `{"$patch": "delete", key: ...}` removes one). `$setElementOrder/` and `$retainKeys`
    directives are accepted and ignored (ordering and retained keys do not change any outcome here).
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = f"{path}.{key}" if path else key
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and sub in _MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, _MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(out.get(key), value, sub)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(current: list[Any], patch: list[Any], key: str, path: str) -> list[Any]:
    out = copy.deepcopy(current)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(400, "BadRequest", f"{path}: element without merge key {key!r}")
        idx = next((i for i, e in enumerate(out) if isinstance(e, dict) and e.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
        elif idx is None:
            out.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
        else:
            out[idx] = strategic_merge_patch(out[idx], item, path)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(400, "BadRequest", f"json patch: bad path {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch: body must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            kind = op["op"]
            parts = _pointer(op["path"])
            if kind == "test":
                if _walk(doc, parts) != op["value"]:
                    raise ApiError(422, "Invalid", f"json patch: test failed at {op['path']}")
                continue
            if kind in ("move", "copy"):
                src = _pointer(op["from"])
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    parent = _walk(doc, src[:-1])
                    del parent[int(src[-1]) if isinstance(parent, list) else src[-1]]
            elif kind in ("add", "replace"):
                value = copy.deepcopy(op["value"])
            elif kind != "remove":
                raise ApiError(400, "BadRequest", f"json patch: unknown op {kind!r}")
            if not parts:
                doc = value
                continue
            parent = _walk(doc, parts[:-1])
            last = parts[-1]
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif kind == "replace":
                    parent[int(last)] = value
                else:
                    parent.insert(int(last), value)
            else:
                if kind == "replace" and last not in parent:
                    raise KeyError(last)
                parent[last] = value
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"json patch: cannot apply {op!r}: {type(exc).__name__} {exc}") from exc
    return doc


# ---- selectors -----------------------------------------------------------------------------------

_SEL_IN = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A Kubernetes label selector string -> predicate on a label map."""
    reqs: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for req in _split_selector(text):
        m = _SEL_IN.match(req)
        if m:
            reqs.append((m.group(1), m.group(2), frozenset(v.strip() for v in m.group(3).split(","))))
        elif "!=" in req:
            k, v = (part.strip() for part in req.split("!=", 1))
            reqs.append((k, "notin", frozenset({v})))
        elif "=" in req:
            k, v = (part.strip() for part in req.replace("==", "=").split("=", 1))
            reqs.append((k, "in", frozenset({v})))
        elif req.startswith("!"):
            reqs.append((req[1:].strip(), "!", frozenset()))
        elif _LABEL_NAME_RE.match(req.split("/")[-1]):
            reqs.append((req, "exists", frozenset()))
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {req!r}")

    def matches(labels: dict[str, str]) -> bool:
        for key, op, values in reqs:
            ok = {
                "in": labels.get(key) in values,
                "notin": labels.get(key) not in values,
                "exists": key in labels,
                "!": key not in labels,
            }[op]
            if not ok:
                return False
        return True

    return matches


def match_label_selector(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector object (matchLabels, matchExpressions) against labels; an empty one matches all."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op)
        if not ok:
            return False
    return True


def _field(obj: Obj, path: str) -> str:
    cur: Any = obj
    for p in path.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    if cur is None:
        return "false" if path == "spec.unschedulable" else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_selector(rt: ResourceType, text: str) -> Callable[[Obj], bool]:
    reqs: list[tuple[str, str, bool]] = []  # (field, value, negated)
    for req in _split_selector(text):
        neg = "!=" in req
        k, v = (part.strip() for part in req.replace("==", "=").replace("!=", "=").split("=", 1))
        if k not in _SUPPORTED_FIELDS[rt.kind]:
            raise ApiError(400, "BadRequest", f"field label not supported: {k}")
        reqs.append((k, v, neg))

    def matches(obj: Obj) -> bool:
        return all((_field(obj, k) == v) != neg for k, v, neg in reqs)

    return matches


# ---- validation ----------------------------------------------------------------------------------


def _validate(rt: ResourceType, obj: Obj) -> None:
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    causes: list[tuple[str, str, str]] = []
    if not name:
        causes.append(("metadata.name", "FieldValueRequired", "Required value: name or generateName is required"))
    elif len(name) > 253 or not _NAME_RE.match(name):
        causes.append(
            (
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
            )
        )
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        causes.append(("metadata.labels", "FieldValueTypeInvalid", "Invalid value: must be a map"))
    else:
        for k, v in labels.items():
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE_RE.match(v):
                causes.append(
                    (
                        "metadata.labels",
                        "FieldValueInvalid",
                        f'Invalid value: "{v}": a valid label '
                        "value must be 63 characters or less, alphanumeric, '-', '_' or '.'",
                    )
                )
            prefix, _, short = k.rpartition("/")
            if (
                not short
                or len(short) > 63
                or not _LABEL_NAME_RE.match(short)
                or (prefix and not _NAME_RE.match(prefix))
            ):
                causes.append(
                    (
                        "metadata.labels",
                        "FieldValueInvalid",
                        f'Invalid value: "{k}": name part must be a valid qualified name',
                    )
                )
    spec = obj.get("spec") or {}
    if rt.kind == "Node":
        if "unschedulable" in spec and not isinstance(spec["unschedulable"], bool):
            causes.append(("spec.unschedulable", "FieldValueTypeInvalid", "Invalid value: must be a boolean"))
        seen = set()
        for i, taint in enumerate(spec.get("taints") or []):
            if not isinstance(taint, dict) or not taint.get("key"):
                causes.append((f"spec.taints[{i}].key", "FieldValueRequired", "Required value"))
                continue
            effect = taint.get("effect")
            if effect not in TAINT_EFFECTS:
                supported = ", ".join(f'"{e}"' for e in sorted(TAINT_EFFECTS))
                causes.append(
                    (
                        f"spec.taints[{i}].effect",
                        "FieldValueNotSupported",
                        f'Unsupported value: "{effect}": supported values: {supported}',
                    )
                )
            if (taint["key"], effect) in seen:
                causes.append(
                    (
                        f"spec.taints[{i}]",
                        "FieldValueDuplicate",
                        "Duplicate value: taints must be unique by key and effect pair",
                    )
                )
            seen.add((taint["key"], effect))
    if rt.kind == "PodDisruptionBudget" and "minAvailable" in spec and "maxUnavailable" in spec:
        causes.append(
            ("spec", "FieldValueInvalid", "Invalid value: minAvailable and maxUnavailable cannot be both set")
        )
    if rt.kind == "Pod" and not spec.get("containers"):
        causes.append(("spec.containers", "FieldValueRequired", "Required value"))
    if causes:
        raise invalid(rt, name, causes)


def _scaled(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        pct = int(value[:-1])
        return -(-total * pct // 100) if round_up else total * pct // 100
    return int(value)


# ---- the store -----------------------------------------------------------------------------------


class Store:
    """Objects by (resource, namespace, name), a global resourceVersion and an event history.

    Thread safe: tests seed and read it from their own thread while the server's loop serves it.
    """

    def __init__(self, state_file: Path | None = None) -> None:
        self.lock = threading.RLock()
        self.rv = 0
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {r.plural: {} for r in RESOURCES}
        self.history: collections.deque[tuple[int, str, str, Obj]] = collections.deque(maxlen=HISTORY)
        self.watchers: list[tuple[str, Callable[[tuple[int, str, str, Obj]], None]]] = []
        self.state_file = state_file
        if state_file is not None and state_file.exists():
            data = json.loads(state_file.read_text())
            self.rv = int(data["resourceVersion"])
            for plural, items in data["objects"].items():
                for obj in items:
                    meta = obj["metadata"]
                    self.objects[plural][(meta.get("namespace", ""), meta["name"])] = obj
        for ns in ("default", "kube-system"):
            if ("", ns) not in self.objects["namespaces"]:
                self.create(_BY_PATH[("", "v1", "namespaces")], "", {"metadata": {"name": ns}})

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = {
            "resourceVersion": self.rv,
            "objects": {p: list(objs.values()) for p, objs in self.objects.items()},
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.state_file)

    def _emit(self, rt: ResourceType, kind: str, obj: Obj) -> None:
        self.rv_bump(obj)
        event = (self.rv, rt.plural, kind, copy.deepcopy(obj))
        self.history.append(event)
        for plural, cb in list(self.watchers):
            if plural == rt.plural:
                cb(event)
        self._save()

    def rv_bump(self, obj: Obj) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    # -- reads

    def get(self, rt: ResourceType, ns: str, name: str) -> Obj:
        with self.lock:
            obj = self._stored(rt, ns, name)[1]
            return self._decorate(rt, copy.deepcopy(obj))

    def list_objects(
        self, rt: ResourceType, ns: str | None, labels: str = "", fields: str = ""
    ) -> tuple[list[Obj], int]:
        lsel = label_selector(labels) if labels else None
        fsel = field_selector(rt, fields) if fields else None
        with self.lock:
            items = []
            for (ons, _), obj in sorted(self.objects[rt.plural].items()):
                if ns and rt.namespaced and ons != ns:
                    continue
                if lsel and not lsel(obj["metadata"].get("labels") or {}):
                    continue
                if fsel and not fsel(obj):
                    continue
                items.append(self._decorate(rt, copy.deepcopy(obj)))
            return items, self.rv

    def _decorate(self, rt: ResourceType, obj: Obj) -> Obj:
        """Computed status (the PDB controller's job in a real cluster)."""
        if rt.kind == "PodDisruptionBudget":
            obj["status"] = self._pdb_status(obj)
        return obj

    def _pdb_pods(self, pdb: Obj) -> list[Obj]:
        ns = pdb["metadata"].get("namespace", "default")
        sel = (pdb.get("spec") or {}).get("selector")
        return [
            p
            for (pns, _), p in self.objects["pods"].items()
            if pns == ns and match_label_selector(sel, p["metadata"].get("labels") or {})
        ]

    def _pdb_status(self, pdb: Obj) -> Obj:
        pods = self._pdb_pods(pdb)
        expected = len(pods)
        healthy = sum(1 for p in pods if _pod_healthy(p))
        spec = pdb.get("spec") or {}
        if "maxUnavailable" in spec:
            desired = max(0, expected - _scaled(spec["maxUnavailable"], expected, round_up=True))
        else:
            desired = _scaled(spec.get("minAvailable", 1), expected, round_up=True)
        return {
            "observedGeneration": pdb["metadata"].get("generation", 1),
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "disruptionsAllowed": max(0, healthy - desired),
            "conditions": [
                {
                    "type": "DisruptionAllowed",
                    "status": "True" if healthy - desired > 0 else "False",
                    "reason": "SufficientPods" if healthy - desired > 0 else "InsufficientPods",
                    "message": "",
                    "lastTransitionTime": pdb["metadata"].get("creationTimestamp", _now()),
                    "observedGeneration": pdb["metadata"].get("generation", 1),
                }
            ],
        }

    # -- writes

    def create(self, rt: ResourceType, ns: str, body: Obj, dry_run: bool = False) -> Obj:
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = ns
            if ("", ns) not in self.objects["namespaces"]:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
        else:
            meta.pop("namespace", None)
        if meta.get("resourceVersion"):
            raise ApiError(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        _validate(rt, obj)
        with self.lock:
            key = (ns if rt.namespaced else "", meta["name"])
            if key in self.objects[rt.plural]:
                group = f".{rt.group}" if rt.group else ""
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{rt.plural}{group} "{meta["name"]}" already exists',
                    {"name": meta["name"], "group": rt.group, "kind": rt.plural},
                )
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
            # Go's encoding/json never omits struct fields: spec and status are always present.
            obj.setdefault("spec", {})
            obj.setdefault("status", {})
            if rt.kind == "Pod" and not obj["status"]:
                obj["status"] = {"phase": "Pending"}
            if rt.kind == "Pod":
                obj.setdefault("status", {"phase": "Pending"})
            if rt.kind == "Namespace":
                obj.setdefault("spec", {"finalizers": ["kubernetes"]})
                obj["status"] = {"phase": "Active"}
            return self._commit(rt, key, obj, "ADDED", dry_run)

    def _stored(self, rt: ResourceType, ns: str, name: str) -> tuple[tuple[str, str], Obj]:
        """(key, the stored object) of `name` (the lock held); NotFound if there is none."""
        key = (ns if rt.namespaced else "", name)
        current = self.objects[rt.plural].get(key)
        if current is None:
            raise not_found(rt, name)
        return key, current

    def _commit(self, rt: ResourceType, key: tuple[str, str], obj: Obj, event: str, dry_run: bool) -> Obj:
        """Store `obj` under `key` and tell the watchers (`event`), unless a dry run; the answer either way."""
        if dry_run:
            return self._decorate(rt, obj)
        self.objects[rt.plural][key] = obj
        self._emit(rt, event, obj)
        return self._decorate(rt, copy.deepcopy(obj))

    def update(
        self,
        rt: ResourceType,
        ns: str,
        name: str,
        change: Callable[[Obj], Obj],
        subresource: str = "",
        *,
        dry_run: bool = False,
    ) -> Obj:
        """Apply `change` to a copy of the stored object; a resourceVersion it leaves set must match."""
        with self.lock:
            key, current = self._stored(rt, ns, name)
            new = change(copy.deepcopy(current))
            if not isinstance(new, dict):
                raise ApiError(422, "Invalid", "the patched object is not an object")
            meta = new.setdefault("metadata", {})
            if meta.get("name", name) != name:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
                )
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise conflict(rt, name)
            # Fields the client cannot change.
            for k in ("name", "uid", "creationTimestamp", "namespace", "generation"):
                if k in current["metadata"]:
                    meta[k] = current["metadata"][k]
            meta.pop("deletionTimestamp", None)
            new["apiVersion"], new["kind"] = rt.api_version, rt.kind
            if subresource == "status":
                new = {**current, "status": new.get("status", {})}
                new["metadata"] = dict(current["metadata"])
            else:
                if "status" in current:
                    new["status"] = current["status"]
                if new.get("spec") != current.get("spec"):
                    new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            _validate(rt, new)
            if (
                rt.kind == "Pod"
                and (new.get("spec") or {}).get("nodeName") != (current.get("spec") or {}).get("nodeName")
                and (current.get("spec") or {}).get("nodeName")
            ):
                raise invalid(
                    rt,
                    name,
                    [
                        (
                            "spec",
                            "FieldValueForbidden",
                            "Forbidden: pod updates may not change fields other than image, "
                            "activeDeadlineSeconds, tolerations",
                        )
                    ],
                )
            if new == current:
                return self._decorate(rt, copy.deepcopy(current))
            return self._commit(rt, key, new, "MODIFIED", dry_run)

    def delete(
        self, rt: ResourceType, ns: str, name: str, preconditions: Obj | None = None, dry_run: bool = False
    ) -> Obj:
        with self.lock:
            key, current = self._stored(rt, ns, name)
            pre = preconditions or {}
            if pre.get("resourceVersion") and pre["resourceVersion"] != current["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rt.plural} "{name}": Precondition failed: '
                    f"ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {current['metadata']['resourceVersion']}",
                    {"name": name, "kind": rt.plural},
                )
            if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rt.plural} "{name}": Precondition failed: UID in precondition: '
                    f"{pre['uid']}, UID in object meta: {current['metadata']['uid']}",
                    {"name": name, "kind": rt.plural},
                )
            if dry_run:
                return copy.deepcopy(current)
            del self.objects[rt.plural][key]
            gone = copy.deepcopy(current)
            self._emit(rt, "DELETED", gone)
            return copy.deepcopy(gone)

    def evict(self, ns: str, name: str, body: Obj, dry_run: bool = False) -> None:
        """policy/v1 Eviction: delete the pod unless a PodDisruptionBudget forbids it."""
        pods_rt = _BY_PATH[("", "v1", "pods")]
        with self.lock:
            pod = self.objects["pods"].get((ns, name))
            if pod is None:
                raise not_found(pods_rt, name)
            labels = pod["metadata"].get("labels") or {}
            pdbs = [
                p
                for (pns, _), p in self.objects["poddisruptionbudgets"].items()
                if pns == ns and match_label_selector((p.get("spec") or {}).get("selector"), labels)
            ]
            # A pod that is not running (finished, pending) may always be evicted, as in the real API.
            if pdbs and (pod.get("status") or {}).get("phase") == "Running":
                if len(pdbs) > 1:
                    raise ApiError(
                        500,
                        "InternalError",
                        "This pod has more than one PodDisruptionBudget, "
                        "which the eviction subresource does not support.",
                    )
                status = self._pdb_status(pdbs[0])
                if status["disruptionsAllowed"] < 1:
                    raise ApiError(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        {
                            "causes": [
                                {
                                    "reason": "DisruptionBudget",
                                    "message": f"The disruption budget {pdbs[0]['metadata']['name']} needs "
                                    f"{status['desiredHealthy']} healthy pods and has "
                                    f"{status['currentHealthy']} currently",
                                }
                            ]
                        },
                    )
            opts = (body or {}).get("deleteOptions") or {}
            self.delete(pods_rt, ns, name, opts.get("preconditions"), dry_run=dry_run)

    def watch(
        self, plural: str, since: int | None, cb: Callable[[tuple[int, str, str, Obj]], None]
    ) -> Callable[[], None]:
        """Register cb for events on `plural` after `since` (None: current objects first, as ADDED)."""
        rt = next(r for r in RESOURCES if r.plural == plural)
        with self.lock:
            if since is None:
                for obj in self.list_objects(rt, None)[0]:
                    cb((int(obj["metadata"]["resourceVersion"]), plural, "ADDED", obj))
            else:
                oldest = self.history[0][0] if self.history else self.rv + 1
                if since < oldest - 1 and since < self.rv:
                    raise ApiError(410, "Expired", f"too old resource version: {since} ({oldest - 1})")
                for event in self.history:
                    if event[0] > since and event[1] == plural:
                        cb(event)
            entry = (plural, cb)
            self.watchers.append(entry)

        def cancel() -> None:
            with self.lock, contextlib.suppress(ValueError):
                self.watchers.remove(entry)

        return cancel


def _pod_healthy(pod: Obj) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return False
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return bool(conds.get("Ready", "True") == "True")


# ---- HTTP ----------------------------------------------------------------------------------------


def _resource_list(group: str, version: str) -> Obj:
    resources: list[Obj] = []
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        resources.append(
            {
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": VERBS,
                "shortNames": list(r.short_names),
            }
        )
        for sub in r.subresources:
            if sub == "eviction":
                resources.append(
                    {
                        "name": f"{r.plural}/eviction",
                        "singularName": "",
                        "namespaced": True,
                        "group": "policy",
                        "version": "v1",
                        "kind": "Eviction",
                        "verbs": ["create"],
                    }
                )
            else:
                resources.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def _group(name: str) -> Obj:
    gv = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


def _json(body: Obj, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _static(body: Obj) -> Callable[[web.Request], Any]:
    async def handle(_: web.Request) -> web.Response:
        return _json(body)

    return handle


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class FakeKubeApiServer(Supervisor):
    """Test double of kube-apiserver on 127.0.0.1 (see the module docstring for what it follows).

    Args:
        port: TCP port on 127.0.0.1 (0: pick a free one; `url` tells which).
        state_file: JSON file the whole state is loaded from (if present) and saved to after each change.
        token: when set, every request must carry `Authorization: Bearer <token>` (401 otherwise).
    """

    def __init__(
        self, port: int = 0, state_file: str | os.PathLike[str] | None = None, token: str | None = None
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port
        self.token = token
        self.store = Store(Path(state_file) if state_file else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- direct access for tests and the lab (same semantics as the HTTP API)

    def resource(self, plural: str) -> ResourceType:
        return next(r for r in RESOURCES if r.plural == plural)

    def add(self, plural: str, body: Obj, namespace: str = "default") -> Obj:
        return self.store.create(self.resource(plural), namespace, body)

    def get(self, plural: str, name: str, namespace: str = "default") -> Obj:
        return self.store.get(self.resource(plural), namespace, name)

    def write_kubeconfig(self, path: str | os.PathLike[str], context: str = "fleetheal-lab") -> Path:
        """A kubeconfig pointing at this server (plain HTTP on loopback, bearer token if one is set)."""
        return write_kubeconfig(path, self.url, self.token, context)

    # -- the app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=16 * 1024 * 1024)
        r = app.router
        for path in ("/version", "/version/"):
            r.add_get(path, _static(KUBE_VERSION))
        for path in ("/healthz", "/readyz", "/livez"):
            r.add_get(path, _ok)
        r.add_get("/api", self._api_versions)
        r.add_get("/apis", self._api_groups)
        r.add_get("/api/v1", _static(_resource_list("", "v1")))
        r.add_get("/apis/policy", _static({"kind": "APIGroup", "apiVersion": "v1", **_group("policy")}))
        r.add_get("/apis/policy/v1", _static(_resource_list("policy", "v1")))
        # Namespaced routes first: /api/v1/namespaces/{ns}/pods must not match Namespace's /{name}/{sub}.
        for rt in sorted(RESOURCES, key=lambda r: not r.namespaced):
            base = f"/api/{rt.version}" if not rt.group else f"/apis/{rt.group}/{rt.version}"
            h = self._handler(rt)
            if rt.namespaced:
                r.add_route("*", f"{base}/{rt.plural}", h)  # all namespaces (list, watch)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}", h)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}", h)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}/{{sub}}", h)
            else:
                r.add_route("*", f"{base}/{rt.plural}", h)
                r.add_route("*", f"{base}/{rt.plural}/{{name}}", h)
                r.add_route("*", f"{base}/{rt.plural}/{{name}}/{{sub}}", h)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _json(ApiError(401, "Unauthorized", "Unauthorized").status(), 401)
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except ApiError as exc:
            return _json(exc.status(), exc.code)
        except web.HTTPNotFound:
            return _json(ApiError(404, "NotFound", "the server could not find the requested resource").status(), 404)
        except web.HTTPMethodNotAllowed:
            return _json(
                ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                ).status(),
                405,
            )

    async def _api_versions(self, _: web.Request) -> web.Response:
        return _json(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                ],
            }
        )

    async def _api_groups(self, _: web.Request) -> web.Response:
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group("policy")]})

    def _handler(self, rt: ResourceType) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._dispatch(rt, request)

        return handle

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"the request body is not JSON: {exc}") from exc

    async def _dispatch(self, rt: ResourceType, request: web.Request) -> web.StreamResponse:
        ns = request.match_info.get("namespace", "")
        name = request.match_info.get("name")
        sub = request.match_info.get("sub", "")
        q = request.query
        dry_run = "dryRun" in q
        method = request.method
        store = self.store
        if sub and sub not in rt.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub == "eviction":
            if method != "POST":
                raise web.HTTPMethodNotAllowed(method, ["POST"])
            body = await self._body(request)
            if (body.get("metadata") or {}).get("name", name) != name:
                raise ApiError(400, "BadRequest", "name in URL does not match name in Eviction object")
            store.evict(ns, name or "", body, dry_run=dry_run)
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if name is None:
            if method == "GET":
                if q.get("watch") in ("1", "true", "True"):
                    return await self._watch(rt, request, ns or None)
                items, rv = store.list_objects(rt, ns or None, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                for obj in items:
                    obj.pop("apiVersion", None)
                    obj.pop("kind", None)
                return _json(
                    {
                        "kind": f"{rt.kind}List",
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    }
                )
            if method == "POST":
                return _json(store.create(rt, ns, await self._body(request), dry_run=dry_run), 201)
            if method == "DELETE":
                items, _ = store.list_objects(rt, ns or None, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                for obj in items:
                    store.delete(rt, ns, obj["metadata"]["name"], dry_run=dry_run)
                return _json({"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {}, "items": items})
            raise web.HTTPMethodNotAllowed(method, ["GET", "POST", "DELETE"])
        if method == "GET":
            return _json(store.get(rt, ns, name))
        if method == "PUT":
            body = await self._body(request)
            replacement: Obj = body

            def replace(_cur: Obj) -> Obj:
                return copy.deepcopy(replacement)

            return _json(store.update(rt, ns, name, replace, sub, dry_run=dry_run))
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            body = await self._body(request)
            if ctype == "application/strategic-merge-patch+json":

                def change(cur: Obj) -> Obj:
                    out = strategic_merge_patch(cur, body)
                    return out if out is not None else {}
            elif ctype == "application/merge-patch+json":

                def change(cur: Obj) -> Obj:
                    out = merge_patch(cur, body)
                    return out if isinstance(out, dict) else {}
            elif ctype == "application/json-patch+json":

                def change(cur: Obj) -> Obj:
                    out = json_patch(cur, body)
                    return out if isinstance(out, dict) else {}
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types include: "
                    "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json"
                    f" (got {ctype!r}; server-side apply is not implemented by this test double)",
                )
            return _json(store.update(rt, ns, name, change, sub, dry_run=dry_run))
        if method == "DELETE":
            body = await self._body(request)
            return _json(store.delete(rt, ns, name, body.get("preconditions"), dry_run=dry_run))
        raise web.HTTPMethodNotAllowed(method, ["GET", "PUT", "PATCH", "DELETE"])

    async def _watch(self, rt: ResourceType, request: web.Request, ns: str | None) -> web.StreamResponse:
        q = request.query
        lsel = label_selector(q["labelSelector"]) if q.get("labelSelector") else None
        fsel = field_selector(rt, q["fieldSelector"]) if q.get("fieldSelector") else None
        rv_text = q.get("resourceVersion", "")
        since = int(rv_text) if rv_text not in ("", "0") else None
        timeout = float(q.get("timeoutSeconds", "1800"))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, str, str, Obj] | None] = asyncio.Queue()

        def push(event: tuple[int, str, str, Obj]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        )
        try:
            cancel = self.store.watch(rt.plural, since, push)
        except ApiError as exc:
            # The real server answers an expired resourceVersion with 200 and an ERROR event.
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": exc.status()}).encode() + b"\n")
            await resp.write_eof()
            return resp
        await resp.prepare(request)
        deadline = loop.time() + timeout
        stopping = self._stopping
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0 or (stopping is not None and stopping.is_set()):
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=min(left, 0.5))
                except TimeoutError:
                    continue
                if event is None:
                    break
                _, _, kind, obj = event
                meta = obj["metadata"]
                if ns and rt.namespaced and meta.get("namespace") != ns:
                    continue
                if lsel and not lsel(meta.get("labels") or {}):
                    continue
                if fsel and not fsel(obj):
                    continue
                out = self.store._decorate(rt, copy.deepcopy(obj))
                out["apiVersion"], out["kind"] = rt.api_version, rt.kind
                await resp.write(json.dumps({"type": kind, "object": out}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            cancel()
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    # -- lifecycle

    async def _start_site(self) -> None:
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        if self.port == 0 and server is not None:
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1]

    async def _stop_site(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def start(self) -> Self:
        """Serve from a background thread (tests); returns once the port is bound."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # reported to the caller of start()
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop_site())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-kube-apiserver", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = None
        self._thread = None

    def serve_forever(self, ready_file: Path | None = None) -> None:
        """Serve in this process until SIGTERM/SIGINT (`fleetheal lab up` runs it this way)."""

        async def main() -> None:
            await self._start_site()
            if ready_file is not None:
                ready_file.write_text(json.dumps({"pid": os.getpid(), "url": self.url}))
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await self._stop_site()

        asyncio.run(main())


def write_kubeconfig(
    path: str | os.PathLike[str], url: str, token: str | None = None, context: str = "fleetheal-lab"
) -> Path:
    """Write a kubeconfig for `url` (JSON is valid YAML; both the client and kubectl read it)."""
    user: Obj = {"token": token} if token else {}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": "default"}}],
        "current-context": context,
        "preferences": {},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    os.chmod(out, 0o600)
    return out


# ---- objects the lab seeds -----------------------------------------------------------------------


def node_object(name: str, labels: dict[str, str] | None = None, taints: list[Obj] | None = None, gpus: int = 8) -> Obj:
    """A Ready GPU Node as a kubelet would register it."""
    now = _now()
    return {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
        },
        "spec": {"taints": taints or []},
        "status": {
            "capacity": {"cpu": "8", "memory": "1000Mi", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "1000Mi", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                },
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name + ".boot")),
                "containerRuntimeVersion": "none://fleetheal-lab",
                "kernelVersion": os.uname().release,
                "kubeProxyVersion": "",
                "kubeletVersion": KUBE_VERSION["gitVersion"],
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                "operatingSystem": "linux",
                "osImage": "fleetheal lab (test double)",
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)),
            },
        },
    }


def pod_object(name: str, node: str, labels: dict[str, str], owner_kind: str, owner_name: str) -> Obj:
    """A Running pod bound to `node`, owned by a controller (k8s_drain refuses unmanaged pods)."""
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": owner_kind,
                    "name": owner_name,
                    "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, owner_name)),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "fleetheal-lab/placeholder:0"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetheal.lab.kube", description="Run the FakeKubeApiServer test double."
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--state", help="JSON state file (loaded if present, saved after each change)")
    parser.add_argument("--token", help="require this bearer token")
    parser.add_argument("--kubeconfig", help="write a kubeconfig here once serving")
    parser.add_argument("--ready-file", help="write {pid, url} here once serving")
    args = parser.parse_args(argv)
    server = FakeKubeApiServer(args.port, args.state, args.token)

    ready = Path(args.ready_file) if args.ready_file else None
    if args.kubeconfig:
        # The port is known before serving only when given; with 0 the kubeconfig follows the bind.
        orig = server._start_site

        async def start_and_write() -> None:
            await orig()
            server.write_kubeconfig(args.kubeconfig)

        server._start_site = start_and_write  # type: ignore[method-assign]
    server.serve_forever(ready)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
