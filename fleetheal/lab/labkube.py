"""The lab's Kubernetes side, as `fleetheal lab up` sets it up under `<lab dir>/kube` (`LabKube.up`).

With the binaries `make tools` builds, a real control plane (`fleetheal.lab.controlplane.KubeControlPlane`):
the agents authenticate with tokens of their own ServiceAccount, whose ClusterRole is the one the stack
deploys, each token bound to its agent's Node, and the stack's admission policy keeps each agent to that Node
(`install_agent_access`). Without them, the in-process test double (`python -m fleetheal.lab.kube`), whose
single bearer token every agent shares. Either way: a Node per lab node, labelled with its GPU pool (`h100`), its
place in it (active or standby) and failure domain (standby nodes also carry the standby taint), a slurmd pod per
node owned by a StatefulSet under a PodDisruptionBudget, and an agent pod per node owned by a DaemonSet.

The real control plane also runs kube-scheduler, the Deployment and ReplicaSet controllers and Kueue
(`fleetheal.lab.kueue`) with the stack's queues for the pool (`fleetheal.infra.kueue.manifests`): its quota is what
the pool may lend (LEND_NODES nodes), to the inference workloads of namespace INFERENCE_NAMESPACE, which the
remediator's lending controller serves (the demo's sharing scenario).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetheal.contracts import (
    AGENT_NAME,
    AGENT_RBAC_RULES,
    LABEL_FAILURE_DOMAIN,
    LABEL_GPU_POOL,
    LABEL_GPU_TYPE,
    LABEL_POOL,
    OWN_NODE_POLICY,
    TAINT_STANDBY,
    own_node_policy,
)
from fleetheal.lab import wait
from fleetheal.lab.controlplane import KubeControlPlane, tools_built
from fleetheal.lab.kubeapi import KubeApiError, api_request, token_client
from fleetheal.lab.kueue import KueueController, apply_queues, kueue_built

#: The lab's pods never run a container (kwok plays their kubelets); the image is never pulled.
PLACEHOLDER_IMAGE = "fleetheal-lab/placeholder:0"
#: Namespace of the agents' ServiceAccount `fleetheal-agent` on the real API server.
AGENT_NAMESPACE = "kube-system"
#: The lab's one GPU pool (and GPU type), the namespace of its inference workloads, and the most nodes it lends.
GPU_POOL = "h100"
INFERENCE_NAMESPACE = "inference"
LEND_NODES = 2
_MERGE = "application/merge-patch+json"


def agent_token_file(kube_dir: Path, node: str, real: bool) -> Path:
    """The bearer token of `node`'s agent: on the real API server a token bound to that Node, on the double
    the double's one token."""
    return kube_dir / "agent-tokens" / node if real else kube_dir / "token"


def admin_client(kube_dir: Path, real: bool, url: str) -> Any:
    """An admin `kubernetes` ApiClient of the lab's API server at `url`: the real one's admin certificate, or
    the double's bearer token."""
    if real:
        return KubeControlPlane.attach(kube_dir).client()
    return token_client(url, (kube_dir / "token").read_text().strip())


def install_agent_access(cp: KubeControlPlane, nodes: list[str], seconds: int = 7 * 24 * 3600) -> dict[str, str]:
    """On the real API server, what the stack gives the agents: their ServiceAccount (`AGENT_NAMESPACE`)
    with the stack's ClusterRole and own-node admission policy (`fleetheal.contracts`), and for each
    of `nodes` a token bound to that Node. Returns {node: token} once the API server enforces the policy."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    cp.request("POST", f"{rbac}/clusterroles", {"metadata": {"name": AGENT_NAME}, "rules": AGENT_RBAC_RULES})
    binding = {
        "metadata": {"name": AGENT_NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": AGENT_NAME, "namespace": AGENT_NAMESPACE}],
    }
    cp.request("POST", f"{rbac}/clusterrolebindings", binding)
    policy, policy_binding = own_node_policy(AGENT_NAMESPACE)
    admission = "/apis/admissionregistration.k8s.io/v1"
    cp.request("POST", f"{admission}/validatingadmissionpolicies", policy)
    cp.request("POST", f"{admission}/validatingadmissionpolicybindings", policy_binding)
    tokens = {n: cp.service_account_token(AGENT_NAMESPACE, AGENT_NAME, seconds, node=n) for n in nodes}

    # The API server applies a new policy a moment later: wait until a token bound to no node is refused.
    unbound = cp.service_account_token(AGENT_NAMESPACE, AGENT_NAME, 600)

    def enforced() -> bool:
        try:  # a dry run changes nothing, even before the policy holds
            cp.request("PATCH", f"/api/v1/nodes/{nodes[0]}?dryRun=All", {}, _MERGE, token=unbound)
        except KubeApiError as e:
            if e.status == 403 and OWN_NODE_POLICY in e.body:
                return True
            raise
        return False

    wait(f"admission policy {OWN_NODE_POLICY}", enforced, 30, cp.log("kube-apiserver"))
    return tokens


def write_secret(path: Path, text: str) -> None:
    """Write `text` to a new file `path` that only its owner can read (it must not exist yet)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class LabKube:
    """The Kubernetes side of one lab (module docstring).

    Args:
        lab_dir: the lab's directory; everything goes under its `kube` folder, the double's log under `logs`.
        nodes: every lab node; the `standby` ones are labelled and tainted as the standby pool.
        gpus: nvidia.com/gpu of each Node.
        spawn: the lab's way to start (and record, for `down`) a process: spawn(name, argv) -> PID.
        record: called with the API server's {url, real, ca_file} as soon as it answers (the lab saves it).
    """

    def __init__(
        self,
        lab_dir: Path,
        nodes: list[str],
        standby: list[str],
        gpus: int,
        *,
        spawn: Callable[..., int],
        record: Callable[[dict[str, Any]], None],
    ) -> None:
        self.lab_dir = lab_dir
        self.dir = lab_dir / "kube"
        self.nodes = nodes
        self.standby = standby
        self.gpus = gpus
        self._spawn = spawn
        self._record = record
        self._api: Any = None
        self.real = False
        self.kueue: KueueController | None = None

    def up(self) -> str:
        """Start the API server (real or double) and create the lab's Nodes, pods, their owners and the
        PodDisruptionBudget; what runs, in words."""
        what = self._up_control_plane() if tools_built() else self._up_double()
        ns = "/api/v1/namespaces"
        self._request("POST", ns, {"metadata": {"name": "slurm"}})
        self._request("POST", ns, {"metadata": {"name": "fleetheal"}})
        # The pods' owners exist for real (the garbage collector deletes pods whose owner is absent);
        # no workload controller runs, so the lab places one pod of each per node itself.
        owners = {
            "slurm": self._owner("slurm", "StatefulSet", "slurm-worker", "slurmd"),
            "fleetheal": self._owner("fleetheal", "DaemonSet", "fleetheal-agent", "fleetheal-agent"),
        }
        for name in self.nodes:
            for namespace, (owner, app) in owners.items():
                pod = {
                    "metadata": {
                        "name": f"{owner['metadata']['name']}-{name}",
                        "labels": {"app.kubernetes.io/name": app},
                        "ownerReferences": [
                            {
                                "apiVersion": "apps/v1",
                                "kind": owner["kind"],
                                "name": owner["metadata"]["name"],
                                "uid": owner["metadata"]["uid"],
                                "controller": True,
                                "blockOwnerDeletion": True,
                            }
                        ],
                    },
                    "spec": {"nodeName": name, "containers": [{"name": "main", "image": PLACEHOLDER_IMAGE}]},
                    "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
                }
                self._create_pod(namespace, pod)
        pdb = {
            "metadata": {"name": "slurm-worker"},
            # One disruption per node the demo isolates over the lab's life (an Xid 79, the lemon, a fault on a lent
            # node): no NodeSet controller runs here, so an evicted slurmd pod is never made again, even once its
            # node is back.
            "spec": {"maxUnavailable": 3, "selector": {"matchLabels": {"app.kubernetes.io/name": "slurmd"}}},
        }
        self._request("POST", "/apis/policy/v1/namespaces/slurm/poddisruptionbudgets", pdb)
        return what

    def _node_specs(self) -> list[tuple[str, dict[str, str], list[dict[str, str]]]]:
        out = []
        for i, name in enumerate(self.nodes):
            pool = "standby" if name in self.standby else "active"
            taints = [{"key": TAINT_STANDBY, "effect": "NoSchedule"}] if pool == "standby" else []
            labels = {LABEL_POOL: pool, LABEL_FAILURE_DOMAIN: f"rack-{'ab'[i % 2]}", LABEL_GPU_POOL: GPU_POOL,
                      LABEL_GPU_TYPE: GPU_POOL}  # fmt: skip
            out.append((name, labels, taints))
        return out

    def _up_control_plane(self) -> str:
        """etcd + kube-apiserver + kube-controller-manager + kube-scheduler (`make tools`), with the agents' access,
        and Kueue with the pool's queues when it is built."""
        cp = KubeControlPlane(self.dir, scheduler=True, workloads=True).start()
        self.real = True
        self._api = cp.client()
        self._record({"url": cp.url, "real": True, "ca_file": str(cp.pki / "ca.crt")})
        for name, labels, taints in self._node_specs():
            cp.add_nodes([name], labels=labels, taints=taints, gpus=self.gpus)
        for name, token in install_agent_access(cp, self.nodes).items():
            path = agent_token_file(self.dir, name, real=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_secret(path, token)
        what = f"kube-apiserver {cp.request('GET', '/version')['gitVersion']} + etcd, kubelets by kwok, at {cp.url}"
        if kueue_built():
            self._up_kueue(cp)
            what += f"; Kueue for namespace {INFERENCE_NAMESPACE}"
        return what

    def _up_kueue(self, cp: KubeControlPlane) -> None:
        self.kueue = KueueController(
            cp, self.dir / "kueue", (INFERENCE_NAMESPACE,), spawn=self._spawn, log=self.lab_dir / "logs" / "kueue.log"
        ).start()
        active = len(self.nodes) - len(self.standby)
        apply_queues(cp, "lab", gpu_type=GPU_POOL, gpus=self.gpus, nodes=active, lendable=LEND_NODES,
                     namespaces=(INFERENCE_NAMESPACE,))  # fmt: skip

    def _up_double(self) -> str:
        self.dir.mkdir()
        token = secrets.token_hex(16)
        write_secret(self.dir / "token", token)
        ready = self.dir / "ready.json"
        self._spawn(
            "kube-apiserver-double",
            [sys.executable, "-m", "fleetheal.lab.kube", "--state", str(self.dir / "state.json"), "--token", token,
             "--kubeconfig", str(self.dir / "kubeconfig"), "--ready-file", str(ready)],
        )  # fmt: skip
        log = self.lab_dir / "logs" / "kube-apiserver-double.log"
        wait("the fake Kubernetes API server", ready.exists, 20, log)
        url = json.loads(ready.read_text())["url"]
        self._api = token_client(url, token)
        self._record({"url": url, "real": False, "ca_file": None})
        from fleetheal.lab.kube import node_object

        for name, labels, taints in self._node_specs():
            self._request("POST", "/api/v1/nodes", node_object(name, labels, taints, self.gpus))
        return f"FakeKubeApiServer (test double: `make tools` builds the real one) at {url}"

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        return api_request(self._api, method, path, body)

    def _owner(self, namespace: str, kind: str, name: str, app: str) -> tuple[dict[str, Any], str]:
        sel = {"matchLabels": {"app.kubernetes.io/name": app}}
        template = {
            "metadata": {"labels": {"app.kubernetes.io/name": app}},
            "spec": {"containers": [{"name": "main", "image": PLACEHOLDER_IMAGE}]},
        }
        spec: dict[str, Any] = {"selector": sel, "template": template}
        if kind == "StatefulSet":
            spec.update(replicas=len(self.nodes), serviceName=name)
        body: dict[str, Any] = {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}
        if not self.real:  # the double holds no workloads: an owner in name only
            body["metadata"]["uid"] = str(uuid.uuid5(uuid.NAMESPACE_DNS, name))
            return body, app
        plural = kind.lower() + "s"
        return self._request("POST", f"/apis/apps/v1/namespaces/{namespace}/{plural}", body), app

    def _create_pod(self, namespace: str, pod: dict[str, Any]) -> None:
        # The service-account controller creates each namespace's `default` account a moment after
        # the namespace; until then pod admission refuses.
        def created() -> bool:
            try:
                self._request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
            except KubeApiError as e:
                if e.status != 403:
                    raise
                return False
            return True

        wait(f"pod {namespace}/{pod['metadata']['name']} to be admitted", created, 30)
