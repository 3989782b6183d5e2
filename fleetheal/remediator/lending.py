"""Lending: the nodes Slurm leaves idle serve Kubernetes workloads (Kueue's), and training takes them back.

The leader runs one round every `lending.interval_s`:

- **Lend.** Pods Kueue admitted wait for GPUs on lent nodes (Pending, unscheduled, their node selector
  `fleetheal.io/pool: lent`, which Kueue's flavour injects, in one of Kueue's namespaces `lending.namespaces`)
  and no Slurm job waits for resources. An idle
  active node of a lending pool is drained in Slurm with the owned reason `fleetheal:lent` (nothing new starts
  there), then labelled `fleetheal.io/pool=lent`, tainted `fleetheal.io/lent=<pool>:NoSchedule` and annotated
  with the time. The slurmd NodeSet selects `pool=active`, so it lets the node go; Kueue's flavour selects
  `pool=lent`, so the waiting pods get it. A pool lends at most `max_nodes` at once.
- **Reclaim.** A Slurm job waits for resources and the idle nodes are not enough. Lent nodes lent at least
  `min_lent_s` ago, longest-lent first, as many as the waiting jobs lack: tainted `fleetheal.io/reclaiming`
  (no new pod lands there, the evicted ones' replacements included), their pods evicted through the
  Eviction API with `reclaim_grace_s` to stop, so their PodDisruptionBudgets hold (an eviction a budget refuses
  is asked again next round, never forced). Evicted: what the loan brought, the pods of Kueue's namespaces and
  any pod holding GPUs; other pods stay, as on an active node. Once none of those is left, the node is labelled
  active, untainted, and resumed in Slurm.

Never lent: a node with an unfinished incident or not `active` in the node lifecycle, a cordoned node, a standby
node, a node Slurm does not show idle and undrained. A lent node with an incident is healing's (the isolation
takes it over: cordon, its own drain reason, evictions, quarantine) and is never reclaimed. The lent state lives
on the Node (label, taint, annotation), so a new leader reads it back. Every lend and reclaim is an audit record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetheal import contracts, steps
from fleetheal.remediator.config import LendingConfig, LendingPool
from fleetheal.remediator.store import ACTIVE, Store
from fleetheal.slurm import jobs as slurm_jobs
from fleetheal.slurm.fields import number
from fleetheal.slurm.nodes import Node
from fleetheal.steps import Kube, Slurm

log = logging.getLogger("fleetheal.remediator.lending")

GPU = "nvidia.com/gpu"
#: Pod phases that hold no GPU.
_DONE = ("Succeeded", "Failed")
#: A Slurm job pending for one of these reasons waits for nodes (the others wait for their priority, a limit, a
#: hold). A job needing a lent (drained) node showed Resources on 22.05 and 26.05, and on 26.05 also
#: ReqNodeNotAvail and "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority
#: partitions" (squeue's %r; the JSON's state_reason starts the same).
WAITING_REASONS = ("Resources", "ReqNodeNotAvail", "Nodes required", "Nodes_required")


def _gpus(pod: Mapping[str, Any]) -> int:
    """The GPUs a pod asks for (its containers' requests, else their limits, which default the requests)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("requests") or {}).get(GPU, (res.get("limits") or {}).get(GPU, 0))
        try:
            total += int(value)
        except (TypeError, ValueError):
            continue
    return total


def _use(role: str | None, info: Node | None, *, repairing: bool) -> str:
    """What a node that is not lent does: standby, in repair (quarantined, an unfinished incident, out of the
    node lifecycle's active state, or drained with a reason fleetheal owns), training (a Slurm job on it), idle
    (Slurm could start one), or unavailable (drained by someone else, not responding, unknown to Slurm)."""
    if role == "standby":
        return "standby"
    if role == "quarantine" or repairing or (info is not None and info.drained and info.reason_owned()):
        return "repair"
    if info is None or info.drained or not info.responding:
        return "unavailable"
    return "idle" if info.state == "IDLE" else "training"


@dataclass
class LentNode:
    name: str
    pool: str
    gpus: int
    #: When it was lent (wall clock); 0 when the annotation is missing or unreadable (then: long ago).
    since: float
    reclaiming: bool
    #: GPUs its pods hold.
    used: int = 0


@dataclass
class Round:
    """What one round saw and did (the log, the metrics, tests)."""

    lent: list[str] = field(default_factory=list)
    reclaimed: list[str] = field(default_factory=list)
    #: Nodes drained for a loan they are not on (an interrupted lend or reclaim), resumed in Slurm.
    resumed: list[str] = field(default_factory=list)
    #: Node -> why its reclaim is not done yet (pods left, an eviction refused).
    reclaiming: dict[str, str] = field(default_factory=dict)
    #: GPUs admitted pods wait for, per GPU type.
    waiting_gpus: dict[str, int] = field(default_factory=dict)
    #: Nodes the waiting Slurm jobs lack beyond the idle ones.
    slurm_short: int = 0
    #: (GPU pool, use) -> [nodes, GPUs], every node of every GPU pool (contracts.POOL_USES).
    uses: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def count(self, pool: str, use: str, gpus: int, nodes: int = 1) -> None:
        cell = self.uses.setdefault((pool, use), [0, 0])
        cell[0] += nodes
        cell[1] += gpus


class LendingController:
    """Lends idle Slurm nodes to Kubernetes workloads and takes them back. `run(stop)` in a thread of its own;
    `step()` is one round."""

    def __init__(
        self,
        cfg: LendingConfig,
        store: Store,
        kube: Kube,
        slurm: Slurm,
        *,
        clock: Callable[[], float] = time.time,
        on_round: Callable[[Round], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.kube = kube
        self.slurm = slurm
        self.clock = clock
        #: Called with each round that completed (the metrics' view of the pools).
        self.on_round = on_round

    # --- reading -------------------------------------------------------------------------------------------

    def _nodes(self) -> list[dict[str, Any]]:
        """The Nodes of every GPU pool (those that do not lend are counted in the view)."""
        return self.kube.items("GPU nodes", self.kube.core.list_node, label_selector=contracts.LABEL_GPU_POOL)

    def _waiting_gpus(self) -> dict[str, int]:
        """GPU type -> GPUs that admitted pods wait for on lent nodes (Pending, unscheduled, ungated, not being deleted,
        in one of `lending.namespaces`)."""
        out: dict[str, int] = {}
        pods = self.kube.items(
            "waiting pods",
            self.kube.core.list_pod_for_all_namespaces,
            field_selector="spec.nodeName=,status.phase=Pending",
        )
        for pod in pods:
            meta = pod.get("metadata") or {}
            if meta.get("namespace") not in self.cfg.namespaces:
                continue  # only Kueue's namespaces: anyone else's pod never makes a node lent
            if meta.get("deletionTimestamp"):
                continue  # going: Kueue holds a deleted pod by its finalizer a moment, and may admit it meanwhile
            spec = pod.get("spec") or {}
            selector = spec.get("nodeSelector") or {}
            if selector.get(contracts.LABEL_POOL) != contracts.POOL_LENT or spec.get("schedulingGates"):
                continue
            gpus = _gpus(pod)
            if gpus:
                kind = str(selector.get(contracts.LABEL_GPU_TYPE, ""))
                out[kind] = out.get(kind, 0) + gpus
        return out

    def _slurm_wants(self) -> int:
        """Nodes the Slurm jobs waiting for resources want."""
        doc = slurm_jobs.document(self.slurm.squeue())
        want = 0
        for job in doc.get("jobs") or []:
            if slurm_jobs.job_state(job.get("job_state")) != "PENDING":
                continue
            if str(job.get("state_reason") or "").startswith(WAITING_REASONS):
                want += max(1, number(job.get("node_count"), 1))
        return want

    # --- one round -----------------------------------------------------------------------------------------

    def step(self) -> Round:
        r = Round()
        nodes = self._nodes()
        sinfo = self.slurm.sinfo()
        busy = {i.node for i in self.store.unfinished()}
        states = {s.node: s.state for s in self.store.node_states()}  # nodes that ever left active; one query
        lent: list[LentNode] = []
        candidates: dict[str, list[tuple[str, int]]] = {}  # pool -> (node, gpus) that may be lent
        types: dict[str, str] = {}  # pool -> GPU type
        idle = 0
        for doc in nodes:
            meta = doc.get("metadata") or {}
            labels = meta.get("labels") or {}
            name, pool = str(meta.get("name")), str(labels.get(contracts.LABEL_GPU_POOL))
            types[pool] = str(labels.get(contracts.LABEL_GPU_TYPE, ""))
            gpus = int(((doc.get("status") or {}).get("allocatable") or {}).get(GPU, 0) or 0)
            info = sinfo.get(name)
            role = labels.get(contracts.LABEL_POOL)
            if role == contracts.POOL_LENT:
                note = _annotation(meta)
                node = LentNode(name, pool, gpus, float(note.get("since", 0.0)), bool(note.get("reclaim")))
                node.used = gpus - self._free_gpus(node)
                lent.append(node)
                r.count(pool, "inference" if node.used else "lent", gpus)
                continue
            lifecycle = states.get(name, ACTIVE)
            if (
                role == "active"
                and info is not None
                and info.drained
                and info.reason == contracts.LENT_REASON
                and contracts.ANNOTATION_LENT not in (meta.get("annotations") or {})
                and name not in busy
                and lifecycle == ACTIVE
            ):
                # Drained for a loan but not lent: a lend that stopped between Slurm and the Node, or a reclaim
                # between the Node and Slurm (a crash, an API server that did not answer). Slurm's again.
                self.slurm.scontrol("update", f"nodename={name}", "state=RESUME")
                log.info("lending: %s was drained for a loan it is not on; resumed", name, extra={"node": name})
                r.resumed.append(name)
                info = None  # read again next round
            use = _use(role, info, repairing=name in busy or lifecycle != ACTIVE)
            r.count(pool, use, gpus)
            if use == "idle":
                idle += 1
                if pool in self.cfg.pools and not (doc.get("spec") or {}).get("unschedulable"):
                    candidates.setdefault(pool, []).append((name, gpus))
        wants = self._slurm_wants()
        r.slurm_short = max(0, wants - idle)
        # Idle nodes a waiting job is about to start on are not spare: a job waiting for a node just taken back
        # for it, until Slurm's next scheduling pass, would have it lent again (the demo's Deployment, its evicted
        # pod made again at once, had one node lent and taken back every 3 s).
        spare = max(0, idle - wants)

        # Reclaim first: training takes its nodes back; nodes already being reclaimed count toward the need. A
        # pool that no longer lends, or lends fewer nodes than it has lent, gets the rest back at once.
        short = r.slurm_short
        now = self.clock()
        kept: dict[str, int] = {}
        for node in sorted(lent, key=lambda n: (not n.reclaiming, n.since, n.name)):
            if node.name in busy:
                continue  # healing's: the isolation takes it over
            rules = self.cfg.pools.get(node.pool)
            over = rules is None or kept.get(node.pool, 0) >= rules.max_nodes
            wanted = short > 0 and (rules is None or now - node.since >= rules.min_lent_s)
            if not (node.reclaiming or over or wanted):
                kept[node.pool] = kept.get(node.pool, 0) + 1
                continue
            short -= 1
            outcome = self._reclaim(node)
            node.reclaiming = True
            if outcome is None:
                r.reclaimed.append(node.name)
            else:
                r.reclaiming[node.name] = outcome
        if r.slurm_short > 0:
            return r  # never lend while training waits for nodes

        # Lend: whole nodes, until the GPUs admitted pods of a type wait for fit on its lent nodes.
        r.waiting_gpus = self._waiting_gpus()
        missing = {
            kind: waiting - sum(n.gpus - n.used for n in lent if types.get(n.pool) == kind and not n.reclaiming)
            for kind, waiting in r.waiting_gpus.items()
        }
        for pool, rules in sorted(self.cfg.pools.items()):
            kind = types.get(pool, "")
            mine = sum(1 for n in lent if n.pool == pool)
            for name, gpus in sorted(candidates.get(pool, [])):
                if missing.get(kind, 0) <= 0 or mine >= rules.max_nodes or gpus <= 0 or len(r.lent) >= spare:
                    break
                if self._lend(name, pool):
                    r.lent.append(name)
                    mine += 1
                    missing[kind] -= gpus
                    r.count(pool, "idle", -gpus, nodes=-1)
                    r.count(pool, "lent", gpus)
        return r

    def _free_gpus(self, node: LentNode) -> int:
        running = [p for p in self.kube.pods_on(node.name) if (p.get("status") or {}).get("phase") not in _DONE]
        used = sum(_gpus(p) for p in running)
        return max(0, node.gpus - used)

    # --- acting --------------------------------------------------------------------------------------------

    def _lend(self, node: str, pool: str) -> bool:
        """Drain in Slurm, check that nothing started meanwhile, then give the node to Kubernetes' workloads."""
        reason = contracts.LENT_REASON
        if not steps.drain_node(self.slurm, node, reason).changed:
            return False  # drained meanwhile, by someone else or for a fault: not ours to lend
        info = self.slurm.sinfo_at(time.time())[1].get(node)
        if info is None or info.state != "IDLE" or info.reason != reason:
            # A job started between the read and the drain (or someone else drained it): not ours to lend.
            if info is not None and info.reason == reason:
                self.slurm.scontrol("update", f"nodename={node}", "state=RESUME")
            log.info("lending: %s is no longer idle; not lent", node)
            return False
        note = json.dumps({"since": self.clock(), "pool": pool}, sort_keys=True)

        def change(doc: dict[str, Any]) -> dict[str, Any] | None:
            taints = [t for t in (doc.get("spec") or {}).get("taints") or [] if t.get("key") != contracts.TAINT_LENT]
            taints.append({"key": contracts.TAINT_LENT, "value": pool, "effect": "NoSchedule"})
            return {
                "metadata": {
                    "labels": {contracts.LABEL_POOL: contracts.POOL_LENT},
                    "annotations": {contracts.ANNOTATION_LENT: note},
                },
                "spec": {"taints": taints},
            }

        self.kube.update_node(node, change)
        self.store.audit("lend", f"{node} lent to Kubernetes workloads", node=node, facts={"pool": pool})
        log.info("lending: lent %s", node, extra={"node": node, "pool": pool})
        return True

    def _reclaim(self, node: LentNode) -> str | None:
        """One round of taking `node` back; None once it is Slurm's again, else what it still waits for."""
        if not node.reclaiming:

            def mark(doc: dict[str, Any]) -> dict[str, Any] | None:
                # Marked, and closed to new pods: those evicted are made again, and Kueue admits them again.
                note = _annotation(doc.get("metadata") or {})
                note["reclaim"] = self.clock()
                taints = [
                    t for t in (doc.get("spec") or {}).get("taints") or [] if t.get("key") != contracts.TAINT_RECLAIMING
                ]
                taints.append({"key": contracts.TAINT_RECLAIMING, "effect": "NoSchedule"})
                meta = {"annotations": {contracts.ANNOTATION_LENT: json.dumps(note, sort_keys=True)}}
                return {"metadata": meta, "spec": {"taints": taints}}

            self.kube.update_node(node.name, mark)
            log.info("lending: reclaiming %s for Slurm", node.name, extra={"node": node.name})
        rules = self.cfg.pools.get(node.pool) or LendingPool()  # a pool that no longer lends: the default grace
        # What the loan brought: the pods of Kueue's namespaces, and any pod holding GPUs (Slurm needs them all
        # back); another pod (a node service that is no DaemonSet's) stays, as it would on an active node. Of
        # those, what a drain evicts; a pod no controller would recreate is never evicted (it would be lost): it
        # holds the reclaim until someone moves it.
        pods = [
            p
            for p in self.kube.pods_on(node.name)
            if (p.get("status") or {}).get("phase") not in _DONE
            and ((p.get("metadata") or {}).get("namespace") in self.cfg.namespaces or _gpus(p) > 0)
        ]
        left, unmanaged = steps.pods_to_evict(pods)
        refused = [
            f"{ns}/{name}: {why}" for ns, name in left if (why := self.kube.evict(ns, name, rules.reclaim_grace_s))
        ]
        if left or unmanaged:
            why = f"{len(left) + len(unmanaged)} pod(s) still on it"
            if unmanaged:
                why += f"; no controller manages {', '.join(unmanaged)}: move or delete them"
            return why + (f"; eviction refused: {'; '.join(refused)}" if refused else "")

        def give_back(doc: dict[str, Any]) -> dict[str, Any] | None:
            loan = (contracts.TAINT_LENT, contracts.TAINT_RECLAIMING)
            taints = [t for t in (doc.get("spec") or {}).get("taints") or [] if t.get("key") not in loan]
            back = {"labels": {contracts.LABEL_POOL: "active"}, "annotations": {contracts.ANNOTATION_LENT: None}}
            return {"metadata": back, "spec": {"taints": taints or None}}

        self.kube.update_node(node.name, give_back)
        info = self.slurm.sinfo_at(time.time())[1].get(node.name)
        if info is not None and info.drained and info.reason == contracts.LENT_REASON:
            self.slurm.scontrol("update", f"nodename={node.name}", "state=RESUME")
        self.store.audit("reclaim", f"{node.name} taken back by Slurm", node=node.name, facts={"pool": node.pool})
        log.info("lending: %s is Slurm's again", node.name, extra={"node": node.name})
        return None

    # --- running -------------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                r = self.step()
                if self.on_round is not None:
                    self.on_round(r)
                if r.lent or r.reclaimed or r.reclaiming:
                    log.info(
                        "lending: a round",
                        extra={"lent": r.lent, "reclaimed": r.reclaimed, "reclaiming": r.reclaiming},
                    )
            except Exception as exc:  # a failed round is logged and tried again next period
                log.error("lending: the round failed: %s", exc)
            stop.wait(self.cfg.interval_s)


def _annotation(meta: Mapping[str, Any]) -> dict[str, Any]:
    raw = (meta.get("annotations") or {}).get(contracts.ANNOTATION_LENT)
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
