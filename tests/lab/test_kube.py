"""The FakeKubeApiServer test double, driven by the official `kubernetes` client and by
`kubernetes.core` modules through ansible-runner, over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client, config, dynamic, watch

from fleetheal.lab.kube import (
    FakeKubeApiServer,
    json_patch,
    label_selector,
    node_object,
    pod_object,
    strategic_merge_patch,
)
from fleetheal.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def server(tmp_path):
    srv = FakeKubeApiServer(state_file=tmp_path / "kube.json").start()
    srv.add("nodes", node_object("n1", {"fleetheal.io/pool": "active"}))
    srv.add(
        "nodes",
        node_object("n2", {"fleetheal.io/pool": "standby"}, [{"key": "fleetheal.io/standby", "effect": "NoSchedule"}]),
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def api(server, tmp_path):
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    api_client = config.new_client_from_config(str(kubeconfig))
    yield api_client
    api_client.close()


def _status(exc: client.ApiException) -> dict:
    return json.loads(exc.body)


def test_discovery_and_version(api):
    assert client.VersionApi(api).get_code().git_version.endswith("test-double")
    dyn = dynamic.DynamicClient(api)
    assert dyn.resources.get(api_version="v1", kind="Node").namespaced is False
    pdb = dyn.resources.get(api_version="policy/v1", kind="PodDisruptionBudget")
    assert pdb.namespaced is True
    assert [n.metadata.name for n in dyn.resources.get(api_version="v1", kind="Node").get().items] == ["n1", "n2"]


def test_list_nodes_by_label_and_patch_kinds(api):
    v1 = client.CoreV1Api(api)
    assert [n.metadata.name for n in v1.list_node(label_selector="fleetheal.io/pool=standby").items] == ["n2"]
    assert [n.metadata.name for n in v1.list_node(label_selector="fleetheal.io/pool in (active,quarantine)").items] == [
        "n1"
    ]
    before = v1.read_node("n1").metadata.resource_version
    # strategic merge (the client's default for a dict body): labels merge, a null deletes one
    node = v1.patch_node(
        "n1", {"metadata": {"labels": {"a": "1", "fleetheal.io/pool": None}}, "spec": {"unschedulable": True}}
    )
    assert node.metadata.labels == {"kubernetes.io/hostname": "n1", "kubernetes.io/os": "linux", "a": "1"}
    assert node.spec.unschedulable is True
    assert int(node.metadata.resource_version) > int(before)
    # JSON patch (a list body)
    node = v1.patch_node("n1", [{"op": "add", "path": "/spec/taints/-", "value": {"key": "k", "effect": "NoExecute"}}])
    assert [(t.key, t.effect) for t in node.spec.taints] == [("k", "NoExecute")]
    # merge patch, forced through the dynamic client
    dyn = dynamic.DynamicClient(api)
    nodes = dyn.resources.get(api_version="v1", kind="Node")
    out = nodes.patch(name="n1", body={"spec": {"taints": None}}, content_type="application/merge-patch+json")
    assert not out.spec.get("taints")
    # the node's status did not move with a spec patch, and status has its own subresource
    patched = v1.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert {c.type: c.status for c in patched.status.conditions}["Ready"] == "False"
    assert patched.status.capacity["nvidia.com/gpu"] == "8"


def test_conflict_not_found_and_invalid(api):
    v1 = client.CoreV1Api(api)
    node = v1.read_node("n1")
    stale = node.metadata.resource_version
    v1.patch_node("n1", {"metadata": {"labels": {"x": "1"}}})
    node.metadata.labels["x"] = "2"
    with pytest.raises(client.ApiException) as exc:
        v1.replace_node("n1", node)  # carries the stale resourceVersion
    assert exc.value.status == 409
    assert _status(exc.value)["reason"] == "Conflict"
    with pytest.raises(client.ApiException) as exc:
        v1.patch_node("n1", {"metadata": {"resourceVersion": stale, "labels": {"x": "3"}}})
    assert exc.value.status == 409
    assert v1.read_node("n1").metadata.labels["x"] == "1"

    with pytest.raises(client.ApiException) as exc:
        v1.read_node("nope")
    assert exc.value.status == 404
    assert _status(exc.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'nodes "nope" not found',
        "reason": "NotFound",
        "code": 404,
        "details": {"name": "nope", "group": "", "kind": "nodes"},
    }

    with pytest.raises(client.ApiException) as exc:
        v1.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}})
    assert exc.value.status == 422
    body = _status(exc.value)
    assert body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"] == "spec.taints[0].effect"
    assert "Sometimes" in body["message"]

    with pytest.raises(client.ApiException) as exc:
        v1.create_node({"metadata": {"name": "n1"}})
    assert exc.value.status == 409
    assert _status(exc.value)["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as exc:
        v1.create_node({"metadata": {"name": "Bad_Name"}})
    assert exc.value.status == 422


def test_pods_by_node_eviction_and_pdb(server, api):
    for i, node in enumerate(["n1", "n1", "n2"]):
        server.add("pods", pod_object(f"web-{i}", node, {"app": "web"}, "ReplicaSet", "web"))
    v1 = client.CoreV1Api(api)
    policy = client.PolicyV1Api(api)
    policy.create_namespaced_pod_disruption_budget(
        "default",
        {"metadata": {"name": "web"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}},
    )
    on_n1 = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").items
    assert sorted(p.metadata.name for p in on_n1) == ["web-0", "web-1"]
    pdb = policy.read_namespaced_pod_disruption_budget("web", "default")
    assert (pdb.status.current_healthy, pdb.status.desired_healthy, pdb.status.disruptions_allowed) == (3, 2, 1)

    evict = client.V1Eviction(metadata=client.V1ObjectMeta(name="web-0", namespace="default"))
    v1.create_namespaced_pod_eviction("web-0", "default", evict)  # 201: one disruption allowed
    with pytest.raises(client.ApiException) as exc:
        v1.read_namespaced_pod("web-0", "default")
    assert exc.value.status == 404

    evict.metadata.name = "web-1"
    with pytest.raises(client.ApiException) as exc:
        v1.create_namespaced_pod_eviction("web-1", "default", evict)
    assert exc.value.status == 429
    body = _status(exc.value)
    assert body["reason"] == "TooManyRequests"
    assert (
        body["details"]["causes"][0]["message"] == "The disruption budget web needs 2 healthy pods and has 2 currently"
    )
    assert v1.read_namespaced_pod("web-1", "default").spec.node_name == "n1"

    # a direct delete is not subject to the budget
    v1.delete_namespaced_pod("web-1", "default")
    assert [p.metadata.name for p in v1.list_namespaced_pod("default").items] == ["web-2"]
    with pytest.raises(client.ApiException) as exc:
        v1.list_pod_for_all_namespaces(field_selector="spec.hostname=x")
    assert exc.value.status == 400


def test_watch_streams_node_events_and_resumes(server, api):
    v1 = client.CoreV1Api(api)
    rv = v1.list_node().metadata.resource_version
    seen: list[tuple[str, str, bool]] = []

    def consume() -> None:
        w = watch.Watch()
        for ev in w.stream(v1.list_node, resource_version=rv, timeout_seconds=5):
            seen.append((ev["type"], ev["object"].metadata.name, bool(ev["object"].spec.unschedulable)))
            if len(seen) == 3:
                w.stop()

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    v1.patch_node("n1", {"spec": {"unschedulable": True}})
    v1.create_node({"metadata": {"name": "n3"}})
    v1.delete_node("n3")
    t.join(10)
    assert seen == [("MODIFIED", "n1", True), ("ADDED", "n3", False), ("DELETED", "n3", False)]

    # without a resourceVersion, a watch starts with the current objects as ADDED
    w = watch.Watch()
    first = [(e["type"], e["object"].metadata.name) for e in w.stream(v1.list_node, timeout_seconds=1)]
    assert first == [("ADDED", "n1"), ("ADDED", "n2")]


def test_state_persists_across_restarts(tmp_path):
    state = tmp_path / "state.json"
    with FakeKubeApiServer(state_file=state) as srv:
        srv.add("nodes", node_object("n1"))
        rv = srv.get("nodes", "n1")["metadata"]["resourceVersion"]
    with FakeKubeApiServer(state_file=state) as srv:
        assert srv.get("nodes", "n1")["metadata"]["resourceVersion"] == rv
        srv.add("nodes", node_object("n2"))
        assert int(srv.get("nodes", "n2")["metadata"]["resourceVersion"]) > int(rv)


def test_bearer_token_required(tmp_path):
    with FakeKubeApiServer(token="s3cret") as srv:
        bad = config.new_client_from_config(str(srv.write_kubeconfig(tmp_path / "kc")))
        assert client.CoreV1Api(bad).list_node().items == []
        from fleetheal.lab.kube import write_kubeconfig

        wrong = config.new_client_from_config(str(write_kubeconfig(tmp_path / "wrong", srv.url, "nope")))
        with pytest.raises(client.ApiException) as exc:
            client.CoreV1Api(wrong).list_node()
        assert exc.value.status == 401


def test_background_process_writes_kubeconfig_and_stops_on_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetheal.lab.kube",
            "--state",
            str(tmp_path / "s.json"),
            "--kubeconfig",
            str(tmp_path / "kc"),
            "--ready-file",
            str(ready),
        ],
    )
    try:
        wait_until(ready.exists, 20, f"{ready}", interval=0.05)
        assert json.loads(ready.read_text())["pid"] == proc.pid
        v1 = client.CoreV1Api(config.new_client_from_config(str(tmp_path / "kc")))
        v1.create_node({"metadata": {"name": "n9"}})
        proc.terminate()
        assert proc.wait(10) == 0
        assert "n9" in (tmp_path / "s.json").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_patch_helpers():
    assert strategic_merge_patch(
        {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]}},
        {"status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "X", "$patch": "delete"}]}},
    ) == {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert json_patch({"a": [1]}, [{"op": "test", "path": "/a/0", "value": 1}, {"op": "remove", "path": "/a/0"}]) == {
        "a": []
    }
    sel = label_selector("pool=active,!lemon,zone notin (a, b)")
    assert sel({"pool": "active", "zone": "c"})
    assert not sel({"pool": "active", "lemon": "1"})
    assert not sel({"pool": "active", "zone": "a"})


PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - kubernetes.core.k8s_taint:
        name: n1
        state: present
        taints: [{key: fleetheal.io/unhealthy, value: xid-79, effect: NoSchedule}]
    - kubernetes.core.k8s_drain:
        name: n1
        state: drain
        delete_options: {ignore_daemonsets: true, wait_timeout: 20}
    - kubernetes.core.k8s:
        state: patched
        kind: Node
        name: n1
        definition: {metadata: {labels: {fleetheal.io/pool: quarantine}}}
    - kubernetes.core.k8s_info:
        kind: Pod
        field_selectors: [spec.nodeName=n1]
      register: left
    - ansible.builtin.assert:
        that: left.resources | map(attribute='metadata.name') | list == ['agent-n1']
"""


@pytest.mark.skipif(shutil.which("ansible-playbook", path=str(VENV_BIN)) is None, reason="ansible not installed")
def test_kubernetes_core_drain_taint_and_label_via_ansible_runner(server, tmp_path):
    import ansible_runner

    server.add("pods", pod_object("slurmd-n1", "n1", {"app": "slurmd"}, "StatefulSet", "slurm-worker"))
    server.add("pods", pod_object("agent-n1", "n1", {"app": "agent"}, "DaemonSet", "agent"))
    server.add(
        "poddisruptionbudgets",
        {"metadata": {"name": "slurmd"}, "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "slurmd"}}}},
    )
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    (tmp_path / "pb.yml").write_text(PLAYBOOK)
    (tmp_path / "runner").mkdir()
    result = ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"),
        playbook=str(tmp_path / "pb.yml"),
        envvars={
            "K8S_AUTH_KUBECONFIG": str(kubeconfig),
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        },
        quiet=True,
    )
    assert (result.status, result.rc) == ("successful", 0), result.stdout.read()
    node = server.get("nodes", "n1")
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [{"key": "fleetheal.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]
    assert node["metadata"]["labels"]["fleetheal.io/pool"] == "quarantine"
