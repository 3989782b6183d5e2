"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

The binaries are built from their Go modules by `scripts/build-tools.sh` (`make tools`) into
`.tools/bin` (or `$FLEETHEAL_TOOLS/bin`); `tools_built()` says whether they are there.

`KubeControlPlane` keeps every file under one state directory: a CA and the certificates of etcd,
the API server and its clients (`cryptography`), the service-account signing key, the etcd data, the
logs, the admin kubeconfig (client certificate in `system:masters`) and `controlplane.json` with the
PIDs, so `KubeControlPlane.attach(state_dir).stop()` finds a running one again. Everything speaks TLS
on 127.0.0.1 only.

The kubelets are kwok's (sigs.k8s.io/kwok, `--manage-all-nodes`, with the default stages kwokctl gives
it): it makes a new Node Ready and a pod bound to a node Running and Ready, and it removes a pod once it is
marked for deletion (without that, an evicted pod stays Terminating for ever). It sends no heartbeats, so
the node-lifecycle controller does not run and `add_nodes` does its one part (the not-ready taint). The
controller manager runs garbage collection, the disruption controller (PodDisruptionBudget status, which
eviction obeys), service accounts, namespaces and the volume binder (a claim binds to a matching volume).
kube-scheduler runs when asked (`scheduler=True`): the lab binds its own pods, Slinky's operator leaves its
pods to the scheduler.

The certificates and kubeconfigs are made by `fleetheal.lab.kubepki`, requests go through
`fleetheal.lab.kubeapi`. This module stays a little over 500 lines because `KubeControlPlane` starts its
daemons in one order, each waiting on the previous one's files and ports, and its API helpers (`request`,
`install_crds`, `add_nodes`, tokens) share the admin credentials it made.

Example::

    with KubeControlPlane(tmp_path / "kube") as kube:
        kube.install_crds(default_crds(shared))
        kube.add_nodes(["n1", "n2"])
        subprocess.run(["kubectl", "--kubeconfig", kube.kubeconfig, "get", "nodes"])
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Self

import yaml

from fleetheal.httpjson import request_json
from fleetheal.lab.kubeapi import KubeApiError, api_request, token_client
from fleetheal.lab.kubepki import SERVICE_CIDR, Pki, cert_kubeconfig
from fleetheal.lab.supervisor import Supervisor, log_tail, spawn
from fleetheal.procs import alive, free_ports, stop_pid
from fleetheal.tools import tools_dir
from fleetheal.wait import WaitTimeout, wait_until

#: The daemons, in start order; kube-controller-manager and kube-scheduler only when asked.
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: Controllers of kube-controller-manager that always run. Not node-lifecycle (kwok sends no heartbeats here),
#: nor taint-eviction (it needs node-lifecycle's pod index), nor the workload controllers (the lab creates
#: the pods it needs itself, owned by real DaemonSet and StatefulSet objects).
CONTROLLERS = (
    "garbage-collector-controller",
    "disruption-controller",
    "serviceaccount-controller",
    "namespace-controller",
    "persistentvolume-binder-controller",
)
#: The workload controllers (`KubeControlPlane(workloads=True)`): Deployments, as inference is served, and Jobs.
WORKLOAD_CONTROLLERS = ("deployment-controller", "replicaset-controller", "job-controller")
#: The CRD folders under ../shared/schemas that the lab and the Pulumi stack need.
CRD_DIRS = ("slinky/crds", "kueue", "prometheus-operator")
KUBELET_LABELS = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
_META_FILE = "controlplane.json"


class ControlPlaneError(RuntimeError):
    """A binary is missing, a daemon did not start, or the API did not answer in time."""


def tools_built() -> bool:
    """True when `make tools` has built the control plane's programs and kwok's stages."""
    return all(os.access(tools_dir() / b, os.X_OK) for b in BINARIES) and kwok_stages().is_file()


def kwok_stages(bin_dir: Path | None = None) -> Path:
    """kwok's stages, copied from its module by `make tools` beside `bin_dir` (default: `tools_dir()`)."""
    return (bin_dir or tools_dir()).parent / "share" / "kwok" / "stages.yaml"


def default_crds(shared: Path) -> list[Path]:
    """The Slinky, Kueue and prometheus-operator CRD files under `shared`/schemas, sorted."""
    return sorted(p for d in CRD_DIRS for p in (shared / "schemas" / d).glob("*.yaml"))


def _component_args(kubeconfig: Path) -> list[str]:
    """The flags kube-controller-manager and kube-scheduler share: one identity, no listener, no election."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        "--leader-elect=false",
    ]


# --- the control plane --------------------------------------------------------------------------


class KubeControlPlane(Supervisor):
    """etcd + kube-apiserver + kube-controller-manager + kwok on 127.0.0.1, TLS everywhere.

    Args:
        state_dir: every file lives here (created if missing; its etcd data is wiped on start).
        controller_manager: also run kube-controller-manager (PDB status, garbage collection, ...).
        scheduler: also run kube-scheduler (pods without a nodeName get one).
        workloads: also run the Deployment, ReplicaSet and Job controllers (WORKLOAD_CONTROLLERS).
        bin_dir: where the binaries are (default: `tools_dir()`).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        controller_manager: bool = True,
        scheduler: bool = False,
        workloads: bool = False,
        bin_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.controller_manager = controller_manager
        self.scheduler = scheduler
        self.workloads = workloads
        self.bin_dir = Path(bin_dir) if bin_dir else tools_dir()
        self.pids: dict[str, int] = {}
        self.url = ""
        self._admin_api: Any = None

    # paths
    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client certificate in group system:masters)."""
        return self.state_dir / "kubeconfig"

    def log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    # life cycle
    def start(self, timeout: float = 90.0) -> Self:
        missing = [b for b in BINARIES if not os.access(self.bin_dir / b, os.X_OK)]
        if not kwok_stages(self.bin_dir).is_file():
            missing.append(str(kwok_stages(self.bin_dir)))
        if missing:
            raise ControlPlaneError(
                f"{', '.join(missing)} not found in {self.bin_dir}: run `make tools` (scripts/build-tools.sh)"
            )
        if self.state_dir.exists() and (self.state_dir / _META_FILE).exists():
            KubeControlPlane.attach(self.state_dir).stop()
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        pki = Pki(self.pki)
        self._admin_api = None  # new certificates
        pki.issue("etcd", "etcd", server=True, client=True)
        pki.issue("apiserver", "kube-apiserver", server=True)
        pki.issue("apiserver-etcd-client", "kube-apiserver-etcd-client", client=True)
        pki.issue("admin", "fleetheal-admin", org="system:masters", client=True)
        pki.issue("controller-manager", "system:kube-controller-manager", client=True)
        pki.issue("scheduler", "system:kube-scheduler", client=True)
        pki.service_account_key()
        etcd_port, peer_port, api_port = free_ports(3)
        self.url = f"https://127.0.0.1:{api_port}"
        cert_kubeconfig(self.kubeconfig, self.url, self.pki, "admin", "fleetheal-admin")
        deadline = time.monotonic() + timeout
        try:
            self._start_etcd(etcd_port, peer_port)
            self._wait_etcd(etcd_port, deadline)
            self._start_apiserver(etcd_port, api_port)
            self._wait_ready(deadline)
            if self.controller_manager:
                self._start_controller_manager()
            if self.scheduler:
                self._start_scheduler()
            self._start_kwok()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        proc = spawn([str(self.bin_dir / name), *args], self.log(name), cwd=self.state_dir)
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        meta = {"pids": self.pids, "url": self.url, "kubeconfig": str(self.kubeconfig)}
        (self.state_dir / _META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    def _start_etcd(self, port: int, peer: int) -> None:
        data = self.state_dir / "etcd"
        if data.exists():
            subprocess.run(["rm", "-rf", str(data)], check=True)
        p = self.pki
        self._spawn(
            "etcd",
            [
                "--name=fleetheal-lab",
                f"--data-dir={data}",
                f"--listen-client-urls=https://127.0.0.1:{port}",
                f"--advertise-client-urls=https://127.0.0.1:{port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=fleetheal-lab=http://127.0.0.1:{peer}",
                f"--cert-file={p / 'etcd.crt'}",
                f"--key-file={p / 'etcd.key'}",
                f"--trusted-ca-file={p / 'ca.crt'}",
                "--client-cert-auth=true",
                # A lab store: losing it on a power cut costs nothing, and fsync on a shared disk is slow.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

    def _wait_etcd(self, port: int, deadline: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(self.pki / "apiserver-etcd-client.crt", self.pki / "apiserver-etcd-client.key")
        url = f"https://127.0.0.1:{port}/health"
        self._wait_up(
            "etcd", lambda: request_json("GET", url, timeout=2, context=ctx).get("health") == "true", deadline
        )

    def _start_apiserver(self, etcd_port: int, port: int) -> None:
        p = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=https://127.0.0.1:{etcd_port}",
                f"--etcd-cafile={p / 'ca.crt'}",
                f"--etcd-certfile={p / 'apiserver-etcd-client.crt'}",
                f"--etcd-keyfile={p / 'apiserver-etcd-client.key'}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # The `kubernetes` Service's endpoints cannot name a loopback address; nothing here needs them.
                "--endpoint-reconciler-type=none",
                f"--secure-port={port}",
                f"--cert-dir={self.state_dir / 'apiserver-certs'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=0",
            ],
        )

    def _wait_ready(self, deadline: float) -> None:
        self._wait_up("kube-apiserver", lambda: api_request(self._api(None), "GET", "/readyz", timeout=5), deadline)

    def _wait_up(self, name: str, check: Callable[[], object], deadline: float) -> None:
        """Until `check()` is true; ControlPlaneError with the log's tail if `name` exits or `deadline` passes."""

        def up() -> object:
            self._check_alive(name)
            return check()

        try:
            wait_until(
                up, deadline - time.monotonic(), f"{name} to answer", interval=0.2, ignore=(OSError, KubeApiError)
            )
        except WaitTimeout as e:
            raise ControlPlaneError(
                f"{name} not ready in time; last lines of {self.log(name)}:\n{self._tail(name)}"
            ) from e

    def _start_controller_manager(self) -> None:
        p = self.pki
        kubeconfig = cert_kubeconfig(
            self.state_dir / "controller-manager.kubeconfig",
            self.url,
            p,
            "controller-manager",
            "system:kube-controller-manager",
        )
        self._spawn(
            "kube-controller-manager",
            [
                *_component_args(kubeconfig),
                f"--controllers={','.join(CONTROLLERS + (WORKLOAD_CONTROLLERS if self.workloads else ()))}",
                f"--root-ca-file={p / 'ca.crt'}",
                f"--service-account-private-key-file={p / 'sa.key'}",
                # Each controller acts as its own ServiceAccount (kube-system), with the RBAC roles the API server
                # bootstraps for it, as on a real cluster.
                "--use-service-account-credentials=true",
                "--v=0",
            ],
        )

    def _start_scheduler(self) -> None:
        kubeconfig = cert_kubeconfig(
            self.state_dir / "scheduler.kubeconfig", self.url, self.pki, "scheduler", "system:kube-scheduler"
        )
        self._spawn("kube-scheduler", [*_component_args(kubeconfig), "--v=0"])

    def _start_kwok(self) -> None:
        # Admin credentials: kwok writes the status of every Node and pod, as the kubelets would.
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--config={kwok_stages(self.bin_dir)}",
                "--manage-all-nodes=true",
                "--node-ip=127.0.0.1",
            ],
        )

    def _check_alive(self, name: str) -> None:
        if not alive(self.pids[name]):
            raise ControlPlaneError(
                f"{name} exited during start-up; last lines of {self.log(name)}:\n{self._tail(name)}"
            )

    def _tail(self, name: str, lines: int = 20) -> str:
        return log_tail(self.log(name), lines)

    def stop(self) -> None:
        """Stop every daemon (controller manager first, etcd last); return once they are gone."""
        for name in reversed(BINARIES):
            pid = self.pids.pop(name, None)
            if pid is not None:
                stop_pid(pid, timeout=15)
        if self.state_dir.exists():
            (self.state_dir / _META_FILE).unlink(missing_ok=True)

    @classmethod
    def attach(cls, state_dir: str | os.PathLike[str]) -> KubeControlPlane:
        """The control plane recorded in state_dir (for stop(), or to use one `fleetheal lab up` started)."""
        cp = cls(state_dir)
        meta = json.loads((cp.state_dir / _META_FILE).read_text())
        cp.pids = {k: int(v) for k, v in meta["pids"].items()}
        cp.url = str(meta["url"])
        return cp

    # objects
    def client(self) -> Any:
        """A `kubernetes.client.ApiClient` with the admin credentials."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def _api(self, token: str | None) -> Any:
        """The admin ApiClient (made once), or one with a bearer `token`."""
        if token is not None:
            return token_client(self.url, token, str(self.pki / "ca.crt"))
        if self._admin_api is None:
            self._admin_api = self.client()
        return self._admin_api

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        *,
        token: str | None = None,
    ) -> Any:
        """One request to the API server through the `kubernetes` client, as admin or with a bearer `token`;
        the decoded JSON answer. Raises KubeApiError on a 4xx/5xx (see `api_request` for the 429 retry)."""
        return api_request(self._api(token), method, path, body, content_type)

    def exists(self, path: str) -> bool:
        """Whether the object at `path` exists (GET answers 404: no)."""
        try:
            self.request("GET", path)
        except KubeApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def install_crds(self, files: Iterable[Path], timeout: float = 60.0) -> list[str]:
        """Create the CRDs in `files` (existing ones are kept) and wait until each is Established; their names."""
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        names = []
        for file in files:
            for doc in yaml.load_all(file.read_text(), Loader=_CrdLoader):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                try:
                    self.request("POST", path, doc)
                except KubeApiError as e:
                    if e.status != 409:
                        raise ControlPlaneError(f"CRD {doc['metadata']['name']} from {file}: {e}") from e
                names.append(doc["metadata"]["name"])
        pending = set(names)

        def established() -> bool:
            for name in sorted(pending):
                conds = self.request("GET", f"{path}/{name}").get("status", {}).get("conditions") or []
                if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                    pending.discard(name)
            return not pending

        try:
            wait_until(established, timeout, "CRDs to be established", interval=0.2)
        except WaitTimeout as e:
            raise ControlPlaneError(f"CRDs not established in {timeout:.0f} s: {', '.join(sorted(pending))}") from e
        return names

    def add_nodes(
        self,
        names: Iterable[str],
        *,
        labels: Mapping[str, str] | None = None,
        gpus: int = 8,
        taints: list[dict[str, str]] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Register Nodes with `gpus` nvidia.com/gpu each, as their kubelets would, and return once kwok has
        made each Ready."""
        capacity = {"cpu": "64", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
        names = list(names)
        for name in names:
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                # The labels a kubelet registers its Node with (workloads select on kubernetes.io/os).
                "metadata": {
                    "name": name,
                    "labels": {**KUBELET_LABELS, "kubernetes.io/hostname": name, **(labels or {})},
                },
                "spec": {"taints": list(taints or [])},
                "status": {"capacity": capacity, "allocatable": capacity},
            }
            self.request("POST", "/api/v1/nodes", body)
            # The API server taints a new Node not-ready until the node-lifecycle controller sees it Ready;
            # that controller does not run here, so do its part: the Node keeps only the taints asked for.
            self.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": list(taints or []) or None}}, _MERGE)
        self.wait_ready("nodes", [f"/api/v1/nodes/{n}" for n in names], timeout)

    def wait_pods_running(self, namespace: str, names: Iterable[str], timeout: float = 30.0) -> None:
        """Until kwok has marked each pod Running and Ready (so PodDisruptionBudgets count it healthy)."""
        self.wait_ready("pods", [f"/api/v1/namespaces/{namespace}/pods/{n}" for n in names], timeout)

    def wait_ready(self, what: str, paths: list[str], timeout: float) -> None:
        """Until each object at `paths` has the condition Ready=True; ControlPlaneError with kwok's log if not."""
        pending = set(paths)

        def ready() -> bool:
            for path in sorted(pending):
                conds = self.request("GET", path).get("status", {}).get("conditions") or []
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                    pending.discard(path)
            return not pending

        try:
            wait_until(ready, timeout, f"{what} to be Ready", interval=0.1)
        except WaitTimeout as e:
            raise ControlPlaneError(
                f"{what} not Ready in {timeout:.0f} s: {', '.join(sorted(pending))}; last lines of "
                f"{self.log('kwok')}:\n{self._tail('kwok')}"
            ) from e

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600, *, node: str | None = None) -> str:
        """A bound token of ServiceAccount namespace/name (TokenRequest API), creating the account if missing.

        With `node`, the token is bound to that Node object: the API server names the node in the caller's
        user info (extra `authentication.kubernetes.io/node-name`) and refuses the token once the Node is gone.
        """
        base = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        try:
            self.request("POST", base, {"metadata": {"name": name}})
        except KubeApiError as e:
            if e.status != 409:
                raise
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if node is not None:
            uid = self.request("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
        req = self.request("POST", f"{base}/{name}/token", {"spec": spec})
        return str(req["status"]["token"])


_MERGE = "application/merge-patch+json"


class _CrdLoader(yaml.SafeLoader):
    """SafeLoader that reads YAML 1.1's `=` (the "value" type, e.g. an enum of match operators in the
    prometheus-operator AlertmanagerConfig CRD) as the plain string Kubernetes' YAML 1.2 reader sees."""


def _plain_string(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    return str(loader.construct_scalar(node)) if isinstance(node, yaml.ScalarNode) else str(node.value)


_CrdLoader.add_constructor("tag:yaml.org,2002:value", _plain_string)
