"""The real control plane (etcd, kube-apiserver, kube-controller-manager from `make tools`) on loopback."""

from __future__ import annotations

import functools
import http.server
import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetheal.lab import kubeapi
from fleetheal.lab.controlplane import ControlPlaneError, KubeControlPlane, default_crds, tools_built
from fleetheal.lab.kubeapi import KubeApiError
from fleetheal.procs import alive
from fleetheal.wait import wait_until

pytestmark = pytest.mark.kube


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Iterator[KubeControlPlane]:
    if not tools_built():
        pytest.fail("etcd/kube-apiserver/kube-controller-manager are not built: run `make tools`")
    with KubeControlPlane(tmp_path_factory.mktemp("kube")) as cp:
        cp.install_crds(default_crds(shared))
        yield cp


def _get(kube: KubeControlPlane, path: str, token: str | None = None) -> int:
    ctx = ssl.create_default_context(cafile=str(kube.pki / "ca.crt"))
    req = urllib.request.Request(kube.url + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    else:
        ctx.load_cert_chain(kube.pki / "admin.crt", kube.pki / "admin.key")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_api_server_speaks_tls_and_refuses_anonymous_requests(kube: KubeControlPlane) -> None:
    assert kube.url.startswith("https://127.0.0.1:")
    assert _get(kube, "/readyz") == 200
    ctx = ssl.create_default_context(cafile=str(kube.pki / "ca.crt"))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(kube.url + "/api/v1/nodes", context=ctx, timeout=10)
    assert err.value.code in (401, 403)


def test_the_kubeconfig_reaches_a_real_kubernetes(kube: KubeControlPlane) -> None:
    from kubernetes import client

    # The official client, configured from the generated kubeconfig alone.
    namespaces = client.CoreV1Api(kube.client()).list_namespace().to_dict()["items"]
    assert {"default", "kube-system"} <= {ns["metadata"]["name"] for ns in namespaces}
    assert kube.request("GET", "/version")["gitVersion"].startswith("v1.37.")


def test_the_slinky_kueue_and_prometheus_operator_crds_are_served(kube: KubeControlPlane) -> None:
    groups = {g["name"] for g in kube.request("GET", "/apis")["groups"]}
    assert {"slinky.slurm.net", "kueue.x-k8s.io", "monitoring.coreos.com"} <= groups
    assert kube.request("GET", "/apis/kueue.x-k8s.io/v1beta1/clusterqueues")["items"] == []
    # The real server validates custom resources against the CRD's structural schema.
    bad = {
        "apiVersion": "slinky.slurm.net/v1beta1",
        "kind": "NodeSet",
        "metadata": {"name": "bad"},
        "spec": {"replicas": "three"},
    }
    with pytest.raises(KubeApiError) as err:
        kube.request("POST", "/apis/slinky.slurm.net/v1beta1/namespaces/default/nodesets", bad)
    assert err.value.status == 422


def test_kwok_makes_the_nodes_ready(kube: KubeControlPlane) -> None:
    kube.add_nodes(["cp-n1", "cp-n2"], labels={"fleetheal.io/pool": "active"}, gpus=8)
    for name in ("cp-n1", "cp-n2"):
        node = kube.request("GET", f"/api/v1/nodes/{name}")
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
        assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("kwok-"), node["status"]["nodeInfo"]
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["fleetheal.io/pool"] == "active"
        assert not node["spec"].get("taints"), "the API server's not-ready taint was left on a Ready node"
    kube.add_nodes(["cp-n3"], taints=[{"key": "fleetheal.io/standby", "effect": "NoSchedule"}])
    assert kube.request("GET", "/api/v1/nodes/cp-n3")["spec"]["taints"] == [
        {"key": "fleetheal.io/standby", "effect": "NoSchedule"}
    ]


def _pod(name: str, node: str, app: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.invalid/sleep:1"}]},
    }


def _wait(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    return wait_until(predicate, timeout, "the condition", interval=0.2)


def test_eviction_obeys_a_pod_disruption_budget_and_kwok_ends_the_pod(kube: KubeControlPlane) -> None:
    kube.add_nodes(["cp-e1"])
    pods = "/api/v1/namespaces/default/pods"
    for name in ("web-1", "web-2"):
        # The service-account controller creates the namespace's `default` account shortly after start.
        assert _wait(functools.partial(_create_ok, kube, pods, _pod(name, "cp-e1", "web")))

    def phase(name: str) -> str | None:
        return kube.request("GET", f"{pods}/{name}")["status"].get("phase")  # type: ignore[no-any-return]

    assert _wait(lambda: phase("web-1") == phase("web-2") == "Running"), "kwok did not start them"
    pdb = {"metadata": {"name": "web"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}}
    kube.request("POST", "/apis/policy/v1/namespaces/default/poddisruptionbudgets", pdb)
    budget = "/apis/policy/v1/namespaces/default/poddisruptionbudgets/web"
    # The disruption controller (kube-controller-manager) computes what the budget allows.
    assert _wait(lambda: kube.request("GET", budget).get("status", {}).get("disruptionsAllowed") == 1)

    evict = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web-1", "namespace": "default"}}
    kube.request("POST", f"{pods}/web-1/eviction", evict)
    assert _wait(lambda: not kube.exists(f"{pods}/web-1")), "the evicted pod stayed Terminating"
    assert _wait(lambda: kube.request("GET", budget)["status"].get("disruptionsAllowed") == 0)
    evict["metadata"]["name"] = "web-2"  # type: ignore[index]
    with pytest.raises(KubeApiError) as err:
        kube.request("POST", f"{pods}/web-2/eviction", evict)
    assert err.value.status == 429  # TooManyRequests: the budget would be violated
    assert kube.exists(f"{pods}/web-2")


def _create_ok(kube: KubeControlPlane, path: str, body: object) -> bool:
    try:
        kube.request("POST", path, body)
    except KubeApiError as e:
        if e.status == 409:
            return True
        if e.status == 403 and "serviceaccount" in e.body:
            return False
        raise
    return True


def test_a_service_account_token_authenticates(kube: KubeControlPlane) -> None:
    token = kube.service_account_token("default", "fleetheal-test")
    assert token.count(".") == 2  # a JWT signed with the control plane's service-account key
    # Authenticated as the account (RBAC gives it nothing): 403, not 401.
    assert _get(kube, "/api/v1/nodes", token=token) == 403
    assert _get(kube, "/api/v1/nodes", token=token + "x") == 401


def test_an_agent_token_taints_its_own_node_and_no_other(kube: KubeControlPlane, tmp_path: Path) -> None:
    """The agent's token is node-scoped on the real API server: RBAC lets it patch every Node, the
    stack's admission policy (installed by the lab) only the Node bound into its token."""
    from fleetheal.agent.fastpath import DONE, FastPathError, KubeNodeTainter
    from fleetheal.contracts import AGENT_NAME as NAME
    from fleetheal.contracts import LABEL_FAULT, LABEL_POOL, OWN_NODE_POLICY, TAINT_STANDBY, TAINT_UNHEALTHY
    from fleetheal.lab.labkube import AGENT_NAMESPACE, install_agent_access

    standby = {"key": TAINT_STANDBY, "effect": "NoSchedule"}
    kube.add_nodes(["ag-a", "ag-b"], labels={LABEL_POOL: "standby"}, taints=[standby])
    tokens = install_agent_access(kube, ["ag-a", "ag-b"])
    token_a = tmp_path / "token-a"
    token_a.write_text(tokens["ag-a"])
    ca = str(kube.pki / "ca.crt")

    # Agent A taints and labels node A ...
    assert KubeNodeTainter("ag-a", kube.url, str(token_a), ca_file=ca).taint("xid-79")[0] == DONE
    node_a = kube.request("GET", "/api/v1/nodes/ag-a")
    assert node_a["spec"]["taints"] == [standby, {"key": TAINT_UNHEALTHY, "value": "xid-79", "effect": "NoSchedule"}]
    assert node_a["metadata"]["labels"][LABEL_FAULT] == "xid-79"
    # ... but not node B, which RBAC alone would allow: the admission policy refuses, and says why.
    with pytest.raises(FastPathError) as err:
        KubeNodeTainter("ag-b", kube.url, str(token_a), ca_file=ca).taint("xid-79")
    assert str(err.value).startswith("kubernetes: 403 Forbidden: ")
    assert f"ValidatingAdmissionPolicy '{OWN_NODE_POLICY}'" in str(err.value)
    assert "the fleetheal agent of node ag-a may change only its own Node, not ag-b" in str(err.value)
    node_b = kube.request("GET", "/api/v1/nodes/ag-b")
    assert node_b["spec"]["taints"] == [standby] and LABEL_FAULT not in node_b["metadata"]["labels"]

    # On its own Node, agent A only adds its taint and label: it cannot lift the standby (or an isolation)
    # taint, change its pool or uncordon itself.
    merge = "application/merge-patch+json"
    for patch, refusal in (
        ({"spec": {"taints": None}}, "removes or changes none"),
        ({"metadata": {"labels": {LABEL_POOL: "active"}}}, "changes no other label"),
        ({"spec": {"unschedulable": True}}, "changes no other label, annotation or cordon"),
    ):
        with pytest.raises(KubeApiError) as api_err:
            kube.request("PATCH", "/api/v1/nodes/ag-a", patch, merge, token=tokens["ag-a"])
        assert api_err.value.status == 403 and refusal in api_err.value.body, patch

    # A token of the same ServiceAccount bound to no node may change no Node at all.
    unbound = kube.service_account_token(AGENT_NAMESPACE, NAME)
    for node in ("ag-a", "ag-b"):
        with pytest.raises(KubeApiError) as api_err:
            kube.request(
                "PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {LABEL_FAULT: "x"}}}, merge, token=unbound
            )
        assert api_err.value.status == 403
        assert "the fleetheal agent token is bound to no node: it may change no Node" in api_err.value.body
    assert kube.request("GET", "/api/v1/nodes/ag-b")["metadata"]["labels"].get(LABEL_FAULT) is None

    # In a cluster the agent's token is the kubelet's projected one, bound to the agent's pod: the API server
    # records the pod's node in it, so the same policy holds the DaemonSet's pod on node B to node B.
    pod = {
        "metadata": {"name": "agent-on-b"},
        "spec": {
            "nodeName": "ag-b",
            "serviceAccountName": NAME,
            "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
        },
    }
    pods = f"/api/v1/namespaces/{AGENT_NAMESPACE}/pods"
    assert _wait(functools.partial(_create_ok, kube, pods, pod))
    uid = kube.request("GET", f"{pods}/agent-on-b")["metadata"]["uid"]
    bound = {"spec": {"boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "agent-on-b", "uid": uid}}}
    path = f"/api/v1/namespaces/{AGENT_NAMESPACE}/serviceaccounts/{NAME}/token"
    pod_token = kube.request("POST", path, bound)["status"]["token"]
    (tmp_path / "token-pod-b").write_text(pod_token)
    assert KubeNodeTainter("ag-b", kube.url, str(tmp_path / "token-pod-b"), ca_file=ca).taint("xid-48")[0] == DONE
    with pytest.raises(KubeApiError) as api_err:  # (node A is tainted already: the tainter would not patch it)
        kube.request(
            "PATCH", "/api/v1/nodes/ag-a", {"metadata": {"labels": {LABEL_FAULT: "x"}}}, merge, token=pod_token
        )
    assert api_err.value.status == 403
    assert "the fleetheal agent of node ag-b may change only its own Node, not ag-a" in api_err.value.body


def test_stop_leaves_no_daemon_behind(tmp_path: Path) -> None:
    if not tools_built():
        pytest.fail("etcd/kube-apiserver/kube-controller-manager are not built: run `make tools`")
    cp = KubeControlPlane(tmp_path / "kube", controller_manager=False, scheduler=True).start()
    pids = dict(cp.pids)
    assert set(pids) == {"etcd", "kube-apiserver", "kube-scheduler", "kwok"}
    # The scheduler binds a pod that names no node; kwok then runs it.
    cp.add_nodes(["sc-1"])
    pods = "/api/v1/namespaces/default/pods"
    unbound = _pod("sched-1", "", "sched")
    del unbound["spec"]["nodeName"]  # type: ignore[index]
    unbound["spec"]["automountServiceAccountToken"] = False  # type: ignore[index]
    # The service-account admission waits for the namespace's `default` account: no controller makes it here.
    cp.request("POST", "/api/v1/namespaces/default/serviceaccounts", {"metadata": {"name": "default"}})
    cp.request("POST", pods, unbound)
    cp.wait_pods_running("default", ["sched-1"])
    assert cp.request("GET", f"{pods}/sched-1")["spec"]["nodeName"] == "sc-1"
    KubeControlPlane.attach(tmp_path / "kube").stop()
    assert not any(alive(p) for p in pids.values())
    assert not (tmp_path / "kube" / "controlplane.json").exists()


def test_missing_binaries_name_the_command_that_builds_them(tmp_path: Path) -> None:
    with pytest.raises(ControlPlaneError, match="make tools"):
        KubeControlPlane(tmp_path / "kube", bin_dir=tmp_path / "nothing").start()


def test_a_429_is_retried_after_its_retry_after_as_client_go_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server answers 429 "storage is (re)initializing" for a moment after a CRD is Established (a CI
    run under load failed on it): `request` waits Retry-After and tries again; a 429 that lasts fails."""
    answers = [429, 429, 200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code = answers.pop(0) if answers else 429
            body = json.dumps({"items": []} if code == 200 else {"reason": "TooManyRequests"}).encode()
            self.send_response(code)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cp = KubeControlPlane(tmp_path)
        cp.url = f"http://127.0.0.1:{server.server_address[1]}"
        # plain HTTP, no client certificate: the `kubernetes` client with a bearer token
        cp._api = lambda token: kubeapi.token_client(cp.url, "t")  # type: ignore[method-assign]
        assert cp.request("GET", "/apis/kueue.x-k8s.io/v1beta1/clusterqueues") == {"items": []}
        monkeypatch.setattr(kubeapi, "TOO_MANY_REQUESTS_S", 0.5)
        with pytest.raises(KubeApiError) as err:
            cp.request("GET", "/api")
        assert err.value.status == 429
    finally:
        server.shutdown()
        server.server_close()
