"""The fake API server's resource model: the types it serves, its `Status` errors, object validation
(422 Invalid with the real API's causes) and the Node and Pod objects the lab seeds.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

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
LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
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
#: Every served resource type by (group, version, plural), as an API path names it.
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


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


def utc_timestamp() -> str:
    """Now, as Kubernetes writes a timestamp (RFC 3339, UTC, whole seconds)."""
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


# ---- validation ----------------------------------------------------------------------------------


def validate(rt: ResourceType, obj: Obj) -> None:
    """Refuse `obj` of type `rt` as the API server would (422 Invalid, one cause per bad field)."""
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
                or not LABEL_NAME_RE.match(short)
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


# ---- objects the lab seeds -----------------------------------------------------------------------


def node_object(name: str, labels: dict[str, str] | None = None, taints: list[Obj] | None = None, gpus: int = 8) -> Obj:
    """A Ready GPU Node as a kubelet would register it."""
    now = utc_timestamp()
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
