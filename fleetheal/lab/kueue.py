"""Kueue's real controller in the lab: it admits the workloads of the namespaces it manages to the stack's
ClusterQueues (`fleetheal.infra.kueue.manifests`) on the lab's control plane, gates their pods until then, and
gives admitted pods their flavour's node selector and tolerations, as in a cluster.

`make tools` builds it (tools/kueue, v0.19.2) and copies its CRDs (the ones `../shared/schemas/kueue` holds) and
webhook configurations, which `KueueController.start` installs. It runs it outside the
cluster on the admin kubeconfig (a cluster gives it its own ServiceAccount and ClusterRole), as a cert-manager
install does it: the certificate is the lab's (a CA of its own, `kubepki.Pki`), written where Kueue's
`webhook.certDir` looks, and the webhook configurations carry that CA. They call the controller at a loopback
URL instead of through its Service (the lab has no Service network); only the webhooks of the frameworks it
manages are registered (Deployments, Jobs, plain pods, and Kueue's own objects), the pod and workload ones for its
namespaces only, so no other pod (slurmd's, the lab's own) ever waits on it.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import yaml

from fleetheal.infra.stack_model import GpuPool
from fleetheal.lab.controlplane import KubeControlPlane
from fleetheal.lab.kubepki import Pki
from fleetheal.lab.supervisor import Supervisor, spawn, wait_ready
from fleetheal.procs import alive, free_ports, stop_pid
from fleetheal.tools import tools_dir, tools_share

BINARY = "kueue"
#: Kueue's namespace (its events, and what its install calls kueue-system).
NAMESPACE = "kueue-system"
#: Where Kueue's metrics server reads its certificate when it does not manage its certificates itself.
METRICS_CERTS = "/etc/kueue/metrics/certs"
#: Off: the on-demand visibility API server (pending workloads' positions; nothing in the lab reads it), whose
#: certificate, too, would be a mount at a fixed path.
FEATURE_GATES = "VisibilityOnDemand=false"
#: The integrations the lab runs: inference as Deployments, batch work as Jobs, plain pods.
FRAMEWORKS = ("batch/job", "deployment", "pod")
#: Webhook paths kept: Kueue's own objects, and the frameworks above.
_PATHS = ("-kueue-x-k8s-io-", "-apps-v1-deployment", "-batch-v1-job", "--v1-pod")
#: Webhooks that see users' objects: only those of the managed namespaces.
_WORKLOAD_PATHS = ("-apps-v1-deployment", "-batch-v1-job", "--v1-pod")


class KueueLabError(RuntimeError):
    """Kueue is not built, or did not become ready."""


def webhooks_file() -> Path:
    return tools_share() / "kueue" / "webhooks.yaml"


def crd_files() -> list[Path]:
    return sorted((tools_share() / "kueue" / "crds").glob("*.yaml"))


def kueue_built() -> bool:
    """True when `make tools` has built Kueue and copied its CRDs and webhook configurations."""
    return os.access(tools_dir() / BINARY, os.X_OK) and webhooks_file().is_file() and bool(crd_files())


def webhook_configurations(url: str, ca: bytes, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, calling `url` and trusting `ca`, for the lab's frameworks; the ones that see
    users' objects only in `namespaces`."""
    selector = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": [*namespaces]}]}
    out = []
    for doc in yaml.safe_load_all(webhooks_file().read_text()):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if not any(p in path for p in _PATHS):
                continue
            hook["clientConfig"] = {"url": url + path, "caBundle": base64.b64encode(ca).decode()}
            if any(p in path for p in _WORKLOAD_PATHS):
                hook["namespaceSelector"] = selector
            hooks.append(hook)
        name = "kueue-" + doc["metadata"]["name"]
        out.append({**doc, "metadata": {"name": name}, "webhooks": hooks})
    return out


def apply_queues(
    cp: KubeControlPlane,
    cluster_name: str,
    *,
    gpu_type: str,
    gpus: int,
    nodes: int,
    lendable: int,
    namespaces: Sequence[str],
) -> list[str]:
    """The stack's queues (`fleetheal.infra.kueue.manifests`) for one GPU pool of `nodes` nodes of `gpus` GPUs that
    lends `lendable` of them at most (its lendMaxPercent rounded up to that), all of its quota in the small queue
    (the lab has one workload size); the API paths made, last made first."""
    from fleetheal.infra import kueue as queues

    pool = GpuPool(gpu_type, gpu_type, gpus, nodes, 0, lend_max_percent=-(-lendable * 100 // nodes))

    rendered = queues.manifests(
        {"cluster_name": cluster_name, "pools": (pool,), "namespaces": tuple(namespaces), "large_share_percent": 0,
         "borrowing_limit_percent": 100, "lending_limit_percent": 100}
    )  # fmt: skip
    made: list[str] = []
    for doc in (*rendered["flavors"], *rendered["cluster_queues"], *rendered["local_queues"]):
        meta = doc["metadata"]
        where = f"namespaces/{meta['namespace']}/" if "namespace" in meta else ""
        plural = doc["kind"].lower() + "s"
        cp.request("POST", f"/apis/{queues.API}/{where}{plural}", doc)
        made.insert(0, f"/apis/{queues.API}/{where}{plural}/{meta['name']}")
    return made


class KueueController(Supervisor):
    """Kueue's controller for `namespaces` of the control plane `cp` (module docstring); its files under
    `state_dir`. `spawn`: how to start it and record it (the lab's: name, argv, env -> PID; its log is the lab's
    logs/kueue.log); by default `supervisor.spawn`, logging to state_dir/kueue.log."""

    def __init__(
        self,
        cp: KubeControlPlane,
        state_dir: Path,
        namespaces: Sequence[str],
        *,
        spawn: Callable[..., int] | None = None,
        log: Path | None = None,
    ) -> None:
        self.cp = cp
        self.state_dir = state_dir
        self.namespaces = tuple(namespaces)
        self.log = log or state_dir / "kueue.log"
        self._spawn = spawn
        self.pid: int | None = None
        self._hooks: list[dict[str, Any]] = []

    def start(self, timeout: float = 90.0) -> Self:
        binary = tools_dir() / BINARY
        if not kueue_built():
            raise KueueLabError(f"{binary} or what it installs ({webhooks_file().parent}) not found: run `make tools`")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.cp.install_crds(crd_files())
        health, metrics, port = free_ports(3)
        certs = self.state_dir / "kueue-certs"
        pki = Pki(certs)  # tls.crt and tls.key, where Kueue's webhook server reads them
        pki.issue("tls", "kueue-webhook", server=True)
        for ns in (NAMESPACE, *self.namespaces):
            if not self.cp.exists(f"/api/v1/namespaces/{ns}"):
                self.cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                                "metadata": {"name": ns}})  # fmt: skip
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
            "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "managedJobsNamespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [*self.namespaces]}
                ]
            },
            "integrations": {"frameworks": [*FRAMEWORKS]},
        }
        config_file = self.state_dir / "kueue-config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {**os.environ, "KUBECONFIG": str(self.cp.kubeconfig)}
        # Its metrics server reads its certificate from a fixed path, /etc/kueue/metrics/certs, where a cert-manager
        # install mounts it: the same mount, made in a mount namespace of its own (the path is only a mount point
        # here; nothing is written under /etc).
        mount = 'mkdir -p "$1" && mount --bind "$0" "$1" && shift && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mount, str(certs), METRICS_CERTS,
                str(binary), f"--config={config_file}", f"--feature-gates={FEATURE_GATES}"]  # fmt: skip
        if self._spawn is None:
            proc = spawn(argv, self.log, env=env)
            self.pid = proc.pid
        else:
            self.pid = self._spawn(BINARY, argv, env)
        pid = self.pid
        try:
            self._hooks = webhook_configurations(f"https://127.0.0.1:{port}", (certs / "ca.crt").read_bytes(),
                                                 self.namespaces)  # fmt: skip
            for doc in self._hooks:
                kind = "mutating" if doc["kind"] == "MutatingWebhookConfiguration" else "validating"
                self.cp.request("POST", f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations", doc)
            url = f"http://127.0.0.1:{health}/readyz"
            wait_ready(BINARY, url, lambda: alive(pid), self.log, timeout=timeout, error=KueueLabError)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Its webhooks first: with the controller gone they would refuse every pod of its namespaces.
        for doc in self._hooks:
            kind = "mutating" if doc["kind"] == "MutatingWebhookConfiguration" else "validating"
            path = f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{doc['metadata']['name']}"
            with contextlib.suppress(Exception):
                self.cp.request("DELETE", path)
        self._hooks = []
        if self.pid is not None:
            stop_pid(self.pid, timeout=10)
            self.pid = None
