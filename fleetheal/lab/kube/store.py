"""The fake API server's in-memory store: objects, the global resourceVersion, the event history that
watches replay, evictions under PodDisruptionBudgets and the optional JSON state file.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetheal.lab.kube.model import (
    BY_PATH,
    HISTORY,
    RESOURCES,
    ApiError,
    Obj,
    ResourceType,
    conflict,
    invalid,
    not_found,
    utc_timestamp,
    validate,
)
from fleetheal.lab.kube.patch import field_selector, label_selector, match_label_selector


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
                self.create(BY_PATH[("", "v1", "namespaces")], "", {"metadata": {"name": ns}})

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
                    "lastTransitionTime": pdb["metadata"].get("creationTimestamp", utc_timestamp()),
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
        validate(rt, obj)
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
            meta["creationTimestamp"] = utc_timestamp()
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
            validate(rt, new)
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
        pods_rt = BY_PATH[("", "v1", "pods")]
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
