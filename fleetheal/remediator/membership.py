"""The membership controller: applies the stack's pool membership ConfigMaps to the Node objects.

A stack of existing nodes declares one ConfigMap per GPU pool (`fleetheal.infra.nodepools`), not one
resource per node, so `pulumi preview` diffs a few objects at any fleet size. This controller, run by
the remediator's leader, gives each member Node the labels and standby taint `contracts.member_node`
names, with server-side apply under its own field manager, when the Node registers and whenever the
node's entry in the ConfigMaps changes. The entry applied is recorded on the Node
(`contracts.ANNOTATION_MEMBERSHIP`): an unchanged entry is never applied again, so a promotion by the
remediator (labels and taint changed by its own steps) survives every later `pulumi up` and resync. A
node removed from its pool's list gets its membership fields released (those this field manager still
owns). A node listed in two pools is applied to neither and reported.

Safety before speed: a pool whose whole ConfigMap is gone (deleted by hand, or a stack destroyed) keeps
its nodes' labels for `release_grace_s` before they are released: labels removed from a whole pool take
slurmd (and its jobs) off every node of it, so a ConfigMap deleted by mistake must be recreated in time,
not obeyed at once. An entry removed from a ConfigMap that still exists is obeyed at once.

It watches the ConfigMaps and the Nodes (one watch each, from a list), so a change lands in about a
second, and lists everything again every `resync_s` or when a watch expires.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fleetheal import contracts

log = logging.getLogger("fleetheal.remediator.membership")

#: Parallel Node applies when many nodes change at once (a new stack, a pool renamed).
WORKERS = 8


@dataclass(frozen=True)
class Member:
    pool: str
    gpu_type: str
    role: str
    failure_domain: str

    @property
    def key(self) -> str:
        """What the Node's membership annotation holds once this entry is applied."""
        return f"{self.pool} {self.gpu_type} {self.role} {self.failure_domain}"


@dataclass
class Desired:
    members: dict[str, Member] = field(default_factory=dict)
    #: The pools that have a membership ConfigMap.
    pools: set[str] = field(default_factory=set)
    #: Why some entries are not applied (a node in two pools, a malformed entry); one line each.
    problems: list[str] = field(default_factory=list)


def desired_members(configmaps: Iterable[Mapping[str, Any]]) -> Desired:
    """Node -> Member from membership ConfigMaps (raw JSON objects); nodes in two pools are left out."""
    out = Desired()
    pools_of: dict[str, list[str]] = {}
    for cm in configmaps:
        meta = cm.get("metadata") or {}
        labels = meta.get("labels") or {}
        pool, gpu_type = labels.get(contracts.LABEL_MEMBERSHIP), labels.get(contracts.LABEL_GPU_TYPE)
        if pool and meta.get("name") != contracts.membership_configmap(pool):
            # Only the stack's own ConfigMap speaks for a pool: another one labelled like it is refused.
            out.problems.append(
                f"ConfigMap {meta.get('name')}: labelled {contracts.LABEL_MEMBERSHIP}={pool}, but pool {pool}'s "
                f"membership is ConfigMap {contracts.membership_configmap(pool)}; ignored"
            )
            continue
        if not pool or not gpu_type or labels.get(contracts.LABEL_GPU_POOL) != pool:
            out.problems.append(
                f"ConfigMap {meta.get('name')}: labels {contracts.LABEL_MEMBERSHIP}, {contracts.LABEL_GPU_POOL} "
                f"(equal) and {contracts.LABEL_GPU_TYPE} are required; ignored"
            )
            continue
        out.pools.add(pool)
        for node, entry in (cm.get("data") or {}).items():
            try:
                role, domain = contracts.parse_membership_entry(entry)
            except ValueError as exc:
                out.problems.append(f"ConfigMap {meta.get('name')}: {node}: {exc}; not applied")
                continue
            pools_of.setdefault(node, []).append(pool)
            out.members[node] = Member(pool, gpu_type, role, domain)
    for node, pools in pools_of.items():
        if len(pools) > 1:
            del out.members[node]
            out.problems.append(f"node {node} is listed in pools {', '.join(sorted(pools))}; applied to neither")
    return out


def apply_body(node: str, member: Member | None) -> dict[str, Any]:
    """The server-side-apply configuration of `node` for this field manager: the member's labels, taints
    and annotation, or (None) nothing, which releases every field the manager still owns."""
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    if member is not None:
        labels, taints = contracts.member_node(member.pool, member.gpu_type, member.role, member.failure_domain)
        body["metadata"]["labels"] = labels
        body["metadata"]["annotations"] = {contracts.ANNOTATION_MEMBERSHIP: member.key}
        if taints:
            body["spec"] = {"taints": taints}
    return body


@dataclass
class SyncStats:
    applied: int = 0
    released: int = 0
    failed: int = 0
    #: Releases held back: the node's pool has no ConfigMap, for less than release_grace_s.
    held: int = 0


class MembershipController:
    """Applies pool membership to Nodes. `run(stop)` in a thread of its own; `sync()` once (tests, CLI)."""

    def __init__(
        self,
        core: Any,
        namespace: str,
        *,
        resync_s: float = 600.0,
        release_grace_s: float = 300.0,
        timeout_s: float = 10.0,
        on_apply: Callable[[str], None] | None = None,
    ) -> None:
        from kubernetes.client.exceptions import ApiException

        self.core = core
        self.namespace = namespace
        self.resync_s = resync_s
        self.release_grace_s = release_grace_s
        self.timeout_s = timeout_s
        self.on_apply = on_apply or (lambda action: None)
        self._exc = ApiException
        self._cond = threading.Condition()
        self._desired = Desired()
        #: Node -> the membership annotation it carries (None: none); only registered Nodes.
        self._nodes: dict[str, str | None] = {}
        self._dirty: set[str] = set()
        self._relist = True
        self._reported: set[str] = set()
        #: Pool -> when it was first seen without a ConfigMap (monotonic); its nodes' releases wait.
        self._gone: dict[str, float] = {}
        #: Nodes whose release waits for their pool's grace to end.
        self._held: set[str] = set()
        self._stop = threading.Event()

    # --- reading -------------------------------------------------------------------------------------

    def _list(self, call: Callable[..., Any], **kw: Any) -> dict[str, Any]:
        raw = call(_preload_content=False, _request_timeout=self.timeout_s * 6, **kw)
        doc: dict[str, Any] = json.loads(raw.data)
        return doc

    def _list_configmaps(self) -> str:
        doc = self._list(
            self.core.list_namespaced_config_map, namespace=self.namespace, label_selector=contracts.LABEL_MEMBERSHIP
        )
        self._set_desired(desired_members(doc.get("items") or []))
        return str(doc["metadata"]["resourceVersion"])

    def _list_nodes(self) -> str:
        doc = self._list(self.core.list_node)
        nodes = {
            n["metadata"]["name"]: (n["metadata"].get("annotations") or {}).get(contracts.ANNOTATION_MEMBERSHIP)
            for n in doc.get("items") or []
        }
        with self._cond:
            self._nodes = nodes
            self._dirty.update(nodes)
            self._cond.notify()
        return str(doc["metadata"]["resourceVersion"])

    def _set_desired(self, desired: Desired) -> None:
        for problem in desired.problems:
            if problem not in self._reported:  # once per problem, not at every list
                log.error("membership: %s", problem)
        self._reported = set(desired.problems)
        with self._cond:
            old = self._desired.members
            changed = {n for n in old.keys() | desired.members.keys() if old.get(n) != desired.members.get(n)}
            self._desired = desired
            for pool in desired.pools & self._gone.keys():  # it came back: its nodes keep their labels
                del self._gone[pool]
                log.info("membership: pool %s has its ConfigMap again", pool)
            self._dirty.update(changed)
            self._cond.notify()

    # --- writing -------------------------------------------------------------------------------------

    def _apply(self, node: str, member: Member | None) -> str:
        self.core.patch_node(
            node,
            apply_body(node, member),
            field_manager=contracts.MEMBERSHIP_FIELD_MANAGER,
            force=True,  # a changed declaration wins over whoever set these labels before
            _content_type="application/apply-patch+yaml",
            _preload_content=False,
            _request_timeout=self.timeout_s,
        )
        return "applied" if member is not None else "released"

    def _work(self, names: Iterable[str]) -> list[tuple[str, Member | None]]:
        """What to apply to `names`: (node, its member, or None to release it); releases of nodes whose
        pool has no ConfigMap wait for release_grace_s (see the module's docstring)."""
        now = time.monotonic()
        with self._cond:
            todo = []
            for node in names:
                if node not in self._nodes:  # not registered (yet): applied when it is
                    continue
                member, have = self._desired.members.get(node), self._nodes[node]
                if (member.key if member else None) == have:
                    self._held.discard(node)
                    continue
                pool = have.split(" ", 1)[0] if have else ""
                if member is None and pool and pool not in self._desired.pools:
                    if pool not in self._gone:
                        self._gone[pool] = now
                        log.warning(
                            "membership: pool %s has no ConfigMap; its nodes keep their labels for %.0f s, then "
                            "they are released (recreate the ConfigMap to keep them)",
                            pool,
                            self.release_grace_s,
                        )
                    if now - self._gone[pool] < self.release_grace_s:
                        self._held.add(node)
                        continue
                self._held.discard(node)
                todo.append((node, member))
            return todo

    def _do(self, todo: list[tuple[str, Member | None]], stats: SyncStats) -> None:
        def one(item: tuple[str, Member | None]) -> str:
            node, member = item
            if self._stop.is_set():  # stepped down: not one more write
                return "held"
            try:
                action = self._apply(node, member)
            except (self._exc, OSError) as exc:  # urllib3's errors are OSErrors: the API server did not answer
                why = f"{exc.status} {exc.reason}" if isinstance(exc, self._exc) else str(exc)
                log.error("membership: cannot apply %s to %s: %s", _what(member), node, why[:200])
                action = "failed"
            else:
                with self._cond:  # the watch will say the same; do not apply twice meanwhile
                    self._nodes[node] = member.key if member else None
            self.on_apply(action)
            return action

        if not todo:  # the usual case: a resync or a held pool's check found nothing to write
            return
        if len(todo) > 1:
            log.info("membership: applying %d node(s)", len(todo))
        with ThreadPoolExecutor(WORKERS) as pool:
            for done, action in enumerate(pool.map(one, todo), 1):
                setattr(stats, action, getattr(stats, action) + 1)
                if done % 1000 == 0:
                    log.info("membership: %d of %d node(s) done", done, len(todo))

    def sync(self) -> SyncStats:
        """List the ConfigMaps and the Nodes and apply every difference (the whole reconciliation)."""
        self._list_configmaps()
        self._list_nodes()
        with self._cond:
            names, self._dirty = set(self._dirty), set()
        stats = SyncStats()
        self._do(self._work(sorted(names)), stats)
        stats.held = len(self._held)
        return stats

    # --- running -------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set: watch, apply, and list again every resync_s (or after a watch error)."""
        self._stop = stop
        while not stop.is_set():
            try:
                cm_rv = self._list_configmaps()
                node_rv = self._list_nodes()
            except (self._exc, OSError, ValueError, KeyError) as exc:
                log.error("membership: cannot list ConfigMaps and Nodes: %s", exc)
                stop.wait(min(self.resync_s, 5.0))
                continue
            self._relist = False
            epoch = threading.Event()  # set: this round's watches end
            for kind, rv in (("configmaps", cm_rv), ("nodes", node_rv)):
                threading.Thread(
                    target=self._watch, args=(kind, rv, stop, epoch), daemon=True, name=f"watch-{kind}"
                ).start()
            deadline = time.monotonic() + self.resync_s
            while not stop.is_set() and not self._relist and time.monotonic() < deadline:
                with self._cond:
                    if not self._dirty:
                        self._cond.wait(timeout=1.0)
                    names, self._dirty = self._dirty | self._held, set()  # held releases: is the grace over?
                if names:
                    self._do(self._work(sorted(names)), SyncStats())
            epoch.set()

    def _watch(self, kind: str, rv: str, stop: threading.Event, epoch: threading.Event) -> None:
        from kubernetes import watch

        w = watch.Watch()  # type: ignore[no-untyped-call]
        if kind == "configmaps":
            call, kw = self.core.list_namespaced_config_map, {"namespace": self.namespace}
            kw["label_selector"] = contracts.LABEL_MEMBERSHIP
        else:
            call, kw = self.core.list_node, {}
        try:
            while not stop.is_set() and not epoch.is_set():
                for event in w.stream(call, resource_version=rv, timeout_seconds=5, deserialize=False, **kw):  # type: ignore[no-untyped-call]
                    if stop.is_set() or epoch.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
                        break
                    doc = json.loads(event) if isinstance(event, (str, bytes)) else event
                    obj = doc.get("object") or {}
                    if doc.get("type") == "ERROR":  # 410 Gone: the resourceVersion is too old
                        raise RuntimeError(f"watch {kind}: {obj.get('message')}")
                    rv = obj["metadata"]["resourceVersion"]
                    if kind == "configmaps":
                        self._list_configmaps()  # a handful of objects: the desired state from scratch
                    else:
                        self._node_event(doc["type"], obj)
        except Exception as exc:  # any failure of a watch: list everything again
            log.warning("membership: watch of %s ended: %s; listing again", kind, str(exc)[:200])
            with self._cond:
                self._relist = True
                self._cond.notify()

    def _node_event(self, type_: str, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        name = meta["name"]
        with self._cond:
            if type_ == "DELETED":
                self._nodes.pop(name, None)
                return
            self._nodes[name] = (meta.get("annotations") or {}).get(contracts.ANNOTATION_MEMBERSHIP)
            self._dirty.add(name)
            self._cond.notify()


def _what(member: Member | None) -> str:
    return f"membership {member.key!r}" if member else "the release of its membership"
