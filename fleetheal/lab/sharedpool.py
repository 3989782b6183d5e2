"""One GPU pool shared by Slurm training and Kubernetes inference, on the lab: a real Slurm cluster whose nodes
are also kwok Nodes of the same names (pool `h100`, active) on a real control plane, and the remediator's lending
controller (fleetheal.remediator.lending) over both. Tests and `benchmarks/bench_lending.py` use it.

The pool has the stack's queues (`fleetheal.infra.kueue.manifests`, its quota what the pool may lend) on Kueue's
real controller (`fleetheal.lab.kueue`), and its inference pods go through them: made with a LocalQueue's name
only, gated by Kueue until it admits them, then given the flavour's node selector (`fleetheal.io/pool: lent` and
the GPU type) and tolerations by Kueue.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from fleetheal import contracts, steps
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.kubeapi import KubeApiError
from fleetheal.lab.kueue import KueueController, apply_queues
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator.config import LendingConfig, LendingPool
from fleetheal.remediator.lending import LendingController
from fleetheal.remediator.store import Store
from fleetheal.wait import wait_until

POOL = GPU_TYPE = "h100"
#: The label that puts a pod in a Kueue LocalQueue.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Seconds Kueue gets to admit a pod within its quota.
ADMIT_S = 30.0
NAMESPACE = "ml"
#: A long-running job's script.
SLEEP = "#!/bin/sh\nsleep 3600\n"
#: Node names: short, as slurmd's step sockets are named after the node under the spool directory (108 bytes at most).
_prefixes = (f"l{i}n" for i in itertools.count())


class SharedPool:
    """`nodes` Slurm nodes of `gpus` GPUs that are also Nodes of GPU pool h100, and a lending controller over them.
    `rules`: the pool's LendingPool fields; `interval_s`: the controller's round (LendingConfig's default); `kueue`:
    Kueue's controller, running for NAMESPACE (module docstring); `quota_nodes`: the nodes whose GPUs are Kueue's
    quota (default: the most the pool lends, as the stack renders it)."""

    def __init__(
        self,
        cp: KubeControlPlane,
        state_dir: Path,
        kueue: KueueController,
        *,
        nodes: int = 3,
        gpus: int = 2,
        interval_s: float = LendingConfig().interval_s,
        fast_timers: bool = True,
        quota_nodes: int | None = None,
        **rules: Any,
    ) -> None:
        self.cp = cp
        self.kueue = kueue
        self.gpus = gpus
        self.prefix = next(_prefixes)
        self._queues: list[str] = []
        self.slurm = SlurmCluster(
            state_dir / "slurm", nodes=nodes, gpus_per_node=gpus, node_prefix=self.prefix, fast_timers=fast_timers
        )
        self.names = list(self.slurm.node_names)
        self.store: Store | None = None
        self._pods = itertools.count()
        self.slurm.start()
        try:
            if not cp.exists(f"/api/v1/namespaces/{NAMESPACE}"):
                ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
                cp.request("POST", "/api/v1/namespaces", ns)
            labels = {
                contracts.LABEL_GPU_POOL: POOL,
                contracts.LABEL_GPU_TYPE: GPU_TYPE,
                contracts.LABEL_POOL: "active",
            }
            cp.add_nodes(self.names, labels=labels, gpus=gpus)
            # The inference pods' owner, as a Deployment's ReplicaSet would own them (no controller runs it here):
            # a drain evicts only pods something would recreate.
            owner = f"{self.prefix}-infer"
            rs: dict[str, Any] = {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": owner, "namespace": NAMESPACE},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"workload": self.prefix}},
                    "template": {
                        "metadata": {"labels": {"workload": self.prefix}},
                        "spec": {"containers": [{"name": "serve", "image": "registry.k8s.io/pause:3.10"}]},
                    },
                },
            }
            made = cp.request("POST", f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets", rs)
            self.owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner,
                          "uid": made["metadata"]["uid"], "controller": True}  # fmt: skip
            settings = steps.Settings(
                slurm_env={"SLURM_CONF": str(self.slurm.conf_path)},
                slurm_retry_delay_s=0.2,
                kubeconfig=str(cp.kubeconfig),
            )
            kube = steps.kube_for(settings)
            assert kube is not None
            self.store = Store(str(state_dir / "store.db"))
            pool = LendingPool(**{"max_nodes": nodes, "min_lent_s": 0.0, "reclaim_grace_s": 1.0, **rules})
            lendable = pool.max_nodes if quota_nodes is None else quota_nodes
            self._queues = apply_queues(
                cp, self.prefix, gpu_type=GPU_TYPE, gpus=gpus, nodes=nodes, lendable=lendable, namespaces=(NAMESPACE,)
            )
            self.ctl = LendingController(
                LendingConfig(True, interval_s, {POOL: pool}, (NAMESPACE,)), self.store, kube, steps.Slurm(settings)
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.slurm.stop()
        self.delete_pods()
        for path in self._queues:  # local queues first, flavours last
            if self.cp.exists(path):
                self.cp.request("DELETE", path)
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets/{self.prefix}-infer"
        if self.cp.exists(path):
            self.cp.request("DELETE", path)
        if self.store is not None:
            self.store.close()
        for n in self.names:
            if self.cp.exists(f"/api/v1/nodes/{n}"):
                self.cp.request("DELETE", f"/api/v1/nodes/{n}")

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------------------------

    def node(self, name: str) -> dict[str, Any]:
        return self.cp.request("GET", f"/api/v1/nodes/{name}")  # type: ignore[no-any-return]

    def pool_of(self, name: str) -> str:
        return str(self.node(name)["metadata"]["labels"].get(contracts.LABEL_POOL))

    def pod(self, name: str) -> dict[str, Any] | None:
        """The pod, or None once it is gone (one read: a pod can go between two)."""
        try:
            return self.cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")  # type: ignore[no-any-return]
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def running_on(self, name: str) -> str:
        """The node pod `name` runs on ("" while it is not Running)."""
        pod = self.pod(name)
        if not pod or (pod.get("status") or {}).get("phase") != "Running":
            return ""
        return str(pod["spec"].get("nodeName") or "")

    def job_reason(self, job: str) -> str:
        return self.slurm.run("squeue", "-j", job, "-h", "-o", "%r", check=False).stdout.strip()

    # --- acting ----------------------------------------------------------------------------------------------

    def inference_pod(
        self, gpus: int | None = None, labels: dict[str, str] | None = None, *, admit: bool = True
    ) -> str:
        """A pod of the inference workload, in Kueue's small queue. `admit`: return once Kueue has admitted it (False:
        at once, as for a pod past the quota)."""
        name = f"{self.prefix}-infer-{next(self._pods)}"
        limits = {"nvidia.com/gpu": str(self.gpus if gpus is None else gpus)}
        spec: dict[str, Any] = {
            "containers": [{"name": "serve", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}]
        }
        labels = {"workload": self.prefix, QUEUE_LABEL: "small", **(labels or {})}
        meta = {"name": name, "namespace": NAMESPACE, "labels": labels, "ownerReferences": [self.owner]}
        self.cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {"apiVersion": "v1", "kind": "Pod",
                                                                         "metadata": meta, "spec": spec})  # fmt: skip
        if admit:
            wait_until(lambda: self.admitted(name), ADMIT_S, f"Kueue to admit {name}", interval=0.1)
        return name

    def admitted(self, name: str) -> bool:
        """Whether pod `name` is admitted: ungated, with the flavour's node selector."""
        pod = self.pod(name)
        spec = (pod or {}).get("spec") or {}
        selector = spec.get("nodeSelector") or {}
        return not spec.get("schedulingGates") and selector.get(contracts.LABEL_POOL) == contracts.POOL_LENT

    def pods(self) -> list[dict[str, Any]]:
        """This pool's inference pods."""
        path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=workload%3D{self.prefix}"
        return self.cp.request("GET", path)["items"]  # type: ignore[no-any-return]

    def delete_pod(self, name: str) -> None:
        """One inference pod, at once (a scale-in)."""
        self.cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")

    def delete_pods(self) -> None:
        """This pool's inference pods, at once."""
        self.cp.request(
            "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=workload%3D{self.prefix}&gracePeriodSeconds=0"
        )
