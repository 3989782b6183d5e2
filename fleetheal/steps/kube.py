"""The Kubernetes steps: isolate (cordon and taint), drain (evict under the PodDisruptionBudgets) and promote a
Node, through the official client (`fleetheal.kubeclient`), guarded by resourceVersion.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetheal import contracts, kubeclient
from fleetheal.steps.result import StepError, StepResult
from fleetheal.steps.settings import Settings


class Kube:
    """The Node changes the steps make, through the official client, guarded by resourceVersion."""

    #: Connections kept to the API server: a storm's first responses patch Nodes concurrently, and every
    #: connection the pool cannot keep costs the next request a TLS handshake.
    CONNECTIONS = 64
    #: Seconds for one request (the client has no default: a stopped API server would hold a step, and
    #: the thread running it, for good).
    TIMEOUT_S = 10.0

    @staticmethod
    def preload() -> None:
        """Import the parts of the client a Kube uses. `kubernetes.client` imports its APIs lazily, on first
        use, and building CoreV1Api's validated methods costs about a second of CPU: a process that forks
        workers (Ansible's controller) preloads, so that each worker does not pay it again."""
        from kubernetes import client, config  # noqa: F401

        _ = (client.Configuration, client.ApiClient, client.CoreV1Api, client.VersionApi, client.exceptions)

    def __init__(self, settings: Settings) -> None:
        from kubernetes import client

        # No silent retries inside the client (urllib3's default is 3, so a stopped API server held each
        # call for 4 timeouts): a step fails in TIMEOUT_S, and the remediator waits for the API server to
        # answer before it retries the attempt.
        api = kubeclient.api_client(settings.kubeconfig, retries=0, connections=self.CONNECTIONS)
        self.core = client.CoreV1Api(api)
        self._exc = client.exceptions.ApiException

    def unavailable(self) -> str | None:
        """None when the API server answers (`GET /version`), else why not."""
        import urllib3
        from kubernetes import client

        try:
            client.VersionApi(self.core.api_client).get_code(_request_timeout=5)
        except (urllib3.exceptions.HTTPError, OSError, self._exc) as exc:
            return f"kubernetes API server: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return None

    def update_node(self, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Read Node `name`, let `change` return a merge patch (or None: nothing to do), apply it with the
        read resourceVersion; a conflict reads again. True when a patch was applied."""
        for _ in range(5):
            try:
                # The raw JSON: the client's models cost milliseconds per Node, and a storm reads hundreds.
                raw = self.core.read_node(name, _preload_content=False, _request_timeout=self.TIMEOUT_S)
                doc = json.loads(raw.data)  # type: ignore[attr-defined]
            except self._exc as exc:
                raise StepError(f"kubernetes: read Node {name}: {exc.status} {exc.reason}") from exc
            patch = change(doc)
            if patch is None:
                return False
            patch.setdefault("metadata", {})["resourceVersion"] = doc["metadata"]["resourceVersion"]
            try:
                self.core.patch_node(name, patch, _preload_content=False, _request_timeout=self.TIMEOUT_S)
            except self._exc as exc:
                if exc.status == 409:
                    continue
                raise StepError(f"kubernetes: patch Node {name}: {exc.status} {exc.reason}") from exc
            return True
        raise StepError(f"kubernetes: Node {name} kept changing (5 conflicts)")

    def items(self, what: str, method: Callable[..., Any], **kw: Any) -> list[dict[str, Any]]:
        """The items of one list call (`method`: a CoreV1Api list method, `kw` its selectors), as raw JSON: the
        client's models cost milliseconds per object."""
        try:
            raw = method(_preload_content=False, _request_timeout=self.TIMEOUT_S, **kw)
        except self._exc as exc:
            raise StepError(f"kubernetes: list {what}: {exc.status} {exc.reason}") from exc
        return list(json.loads(raw.data).get("items") or [])

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        return self.items(
            f"the pods on {node}", self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}"
        )

    def evict(self, namespace: str, name: str, grace_s: float | None = None) -> str | None:
        """Ask the Eviction API to evict one pod (its PodDisruptionBudget applies; `grace_s` overrides its
        termination grace). None once asked (or the pod is gone); else why not: the status, its reason and the
        server's message, which names the budget that refused."""
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if grace_s is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": int(grace_s)}
        try:
            self.core.create_namespaced_pod_eviction(
                name,
                namespace,
                body,  # type: ignore[arg-type]
                _preload_content=False,
                _request_timeout=self.TIMEOUT_S,
            )
        except self._exc as exc:
            if exc.status == 404:
                return None
            try:
                message = json.loads(exc.body or "{}").get("message", "")
            except ValueError:
                message = ""
            return f"{exc.status} {exc.reason}: {message}"
        return None


def _taints_without(doc: Mapping[str, Any], *keys: str) -> list[dict[str, Any]]:
    return [t for t in (doc.get("spec", {}).get("taints") or []) if t.get("key") not in keys]


def k8s_isolate(kube: Kube | None, node: str, fault_id: str, *, dry_run: bool = False) -> StepResult:
    """Cordon `node` and taint it `fleetheal.io/unhealthy=<fault>:NoSchedule` (one patch). The pods'
    eviction under their PodDisruptionBudgets is the follow-up playbook's (it may take minutes)."""
    if kube is None:
        return StepResult("k8s_cordon", "skipped", f"no Kubernetes API configured: cordon of {node} skipped")
    taint = {"key": contracts.TAINT_UNHEALTHY, "value": fault_id, "effect": "NoSchedule"}
    if dry_run:
        return StepResult(
            "k8s_cordon", "would", f"would cordon {node} and taint it {contracts.TAINT_UNHEALTHY}={fault_id}"
        )

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        spec = doc.get("spec", {})
        mine = [t for t in spec.get("taints") or [] if t.get("key") == contracts.TAINT_UNHEALTHY]
        if spec.get("unschedulable") and mine:
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_FAULT: fault_id}},
            "spec": {
                "unschedulable": True,
                "taints": _taints_without(doc, contracts.TAINT_UNHEALTHY) + (mine or [taint]),
            },
        }

    changed = kube.update_node(node, change)
    what = "cordoned and tainted" if changed else "already cordoned and tainted"
    return StepResult("k8s_cordon", "done", f"{node} {what} {contracts.TAINT_UNHEALTHY}", changed=changed)


def pods_to_evict(pods: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[str]]:
    """What `kubectl drain --ignore-daemonsets --delete-emptydir-data` evicts: (namespace, name) of every
    pod but mirror pods and DaemonSet pods; and the pods no controller manages, which it refuses to
    evict (nothing would recreate them)."""
    evict: list[tuple[str, str]] = []
    unmanaged: list[str] = []
    for pod in pods:
        meta = pod.get("metadata", {})
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
            continue
        owners = meta.get("ownerReferences") or []
        finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if not owners and not finished:
            unmanaged.append(f"{ns}/{name}")
        elif finished or not any(o.get("kind") == "DaemonSet" for o in owners):
            evict.append((ns, name))
    return evict, unmanaged


def k8s_drain(
    kube: Kube | None, node: str, *, timeout_s: float, poll_s: float = 1.0, dry_run: bool = False
) -> StepResult:
    """Evict the pods on `node` through the Eviction API, so that their PodDisruptionBudgets apply, wait up
    to `timeout_s` for them to be gone, then label the node `fleetheal.io/pool=quarantine`. An eviction a
    budget refuses (HTTP 429) fails the step with the server's message, naming the budget (the playbook
    retries exactly that); the node then stays in its pool. Run after `k8s_isolate` (cordoned: nothing
    lands there meanwhile)."""
    if kube is None:
        return StepResult("k8s_drain", "skipped", f"no Kubernetes API configured: drain of {node} skipped")
    if dry_run:
        return StepResult(
            "k8s_drain", "would", f"would evict the pods on {node} and label it {contracts.LABEL_POOL}=quarantine"
        )

    def on_node() -> list[dict[str, Any]]:
        return kube.pods_on(node)

    evict, unmanaged = pods_to_evict(on_node())
    if unmanaged:
        raise StepError(
            f"kubernetes: {node} runs pods no controller manages, which a drain would lose: {', '.join(unmanaged)}; "
            "move or delete them, then run the playbook again"
        )
    for ns, name in evict:
        refused = kube.evict(ns, name)
        if refused is not None:
            raise StepError(f"Failed to delete pod {ns}/{name}: {refused}")
    deadline = time.monotonic() + timeout_s
    evicted = set(evict)
    left = evicted
    while left:
        left = {(p["metadata"].get("namespace", ""), p["metadata"].get("name", "")) for p in on_node()} & evicted
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    was_lent = False

    def quarantine(doc: dict[str, Any]) -> dict[str, Any] | None:
        """Label it quarantine; a node lent to Kubernetes workloads also leaves the lent state (its taint and
        annotation), so that once healed it rejoins Slurm like any other node."""
        nonlocal was_lent
        meta = doc.get("metadata", {})
        loan = (contracts.TAINT_LENT, contracts.TAINT_RECLAIMING)
        lent_taint = any(t.get("key") in loan for t in (doc.get("spec") or {}).get("taints") or [])
        lent_note = contracts.ANNOTATION_LENT in (meta.get("annotations") or {})
        was_lent = lent_taint or lent_note
        if (meta.get("labels") or {}).get(contracts.LABEL_POOL) == "quarantine" and not was_lent:
            return None
        patch: dict[str, Any] = {"metadata": {"labels": {contracts.LABEL_POOL: "quarantine"}}}
        if lent_note:
            patch["metadata"]["annotations"] = {contracts.ANNOTATION_LENT: None}
        if lent_taint:
            patch["spec"] = {"taints": _taints_without(doc, *loan) or None}
        return patch

    labelled = kube.update_node(node, quarantine)
    detail = f"{len(evict)} pod(s) evicted from {node}"
    if left:
        names = ", ".join(sorted(f"{ns}/{name}" for ns, name in left))
        detail += f", {len(left)} still terminating after {timeout_s:.0f} s ({names})"
    detail += f"; {contracts.LABEL_POOL}=quarantine" + (", no longer lent" if was_lent else "")
    return StepResult("k8s_drain", "done", detail, changed=bool(evict) or labelled)


def k8s_promote(kube: Kube | None, node: str, *, dry_run: bool = False) -> StepResult:
    """Label a promoted standby Node `fleetheal.io/pool=active` and remove its standby taint."""
    if kube is None or not node:
        return StepResult("k8s_promote", "skipped", f"no Kubernetes API configured: promotion of {node} skipped")
    if dry_run:
        return StepResult("k8s_promote", "would", f"would label {node} {contracts.LABEL_POOL}=active")

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        labels = doc.get("metadata", {}).get("labels") or {}
        taints = doc.get("spec", {}).get("taints") or []
        if labels.get(contracts.LABEL_POOL) == "active" and not any(
            t.get("key") == contracts.TAINT_STANDBY for t in taints
        ):
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_POOL: "active"}},
            "spec": {"taints": _taints_without(doc, contracts.TAINT_STANDBY)},
        }

    changed = kube.update_node(node, change)
    return StepResult(
        "k8s_promote", "done", f"{node} labelled {contracts.LABEL_POOL}=active, standby taint removed", changed=changed
    )


def kube_for(settings: Settings) -> Kube | None:
    return Kube(settings) if settings.kubernetes else None
