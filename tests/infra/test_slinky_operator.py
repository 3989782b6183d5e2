"""The real Slinky slurm-operator (v1.1.0, `make tools`) against the objects the program declares.

One lab for the module: the real control plane with kube-scheduler and kwok's kubelets; Nodes named like
the stack's GPU pool (3 active, 1 warm standby), labelled and tainted by the remediator's membership
controller from the stack's membership ConfigMap; a Slurm 26.05 cluster of the same four nodes with
JWT authentication and SlurmUser=slurm, as Slinky's images run it, served by slurmrestd on
127.0.0.1:6820; and the operator, started with the command line of the program's operator Deployment and
authenticated as the program's operator ServiceAccount (so the program's RBAC is what it gets).

Every object of the stack is created with `fieldValidation=Strict` on the CRDs the operator ships: a field
that operator's CRD does not know fails the test instead of being dropped.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetheal import contracts, steps
from fleetheal.infra import config, mocks, program, project, stack_model
from fleetheal.lab.controlplane import KubeControlPlane, default_crds, tools_built
from fleetheal.lab.kubeapi import KubeApiError
from fleetheal.lab.kubepki import write_kubeconfig
from fleetheal.lab.slinky import (
    OPERATOR,
    RESTAPI_PORT,
    SlinkyLabError,
    SlurmOperator,
    Slurmrestd,
    jwt_conf,
    operator_built,
    operator_crds,
)
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.remediator.membership import MembershipController
from fleetheal.slurm import nodes as slurm_nodes
from fleetheal.wait import wait_until

from ..ansible.conftest import Playbooks
from ..conftest import SHARED

# The timeout covers a wait for another test session's operator on this machine (port 6820's lock, up to
# Slurmrestd's 1800 s), which the first test that starts a slurmrestd pays.
pytestmark = [pytest.mark.kube, pytest.mark.slurm, pytest.mark.timeout(2400)]

POOL = "h100"
ACTIVE = ["gpu-h100-01", "gpu-h100-02", "gpu-h100-03"]
STANDBY = ["gpu-h100-04"]
VERSION = "1.1.0"  # the operator tools/slurm-operator builds
SLINKY = "slinky.slurm.net"
#: The stack's API groups (all but apiextensions: the operator's own CRDs replace the program's).
GROUPS = {
    "",
    "rbac.authorization.k8s.io",
    "apps",
    "policy",
    "admissionregistration.k8s.io",
    "kueue.x-k8s.io",
    "monitoring.coreos.com",
    SLINKY,
}
#: Long enough for the operator to reconcile a change several times (Node and pod events trigger it).
SETTLE_S = 8.0


@dataclass
class Lab:
    kube: KubeControlPlane
    slurm: SlurmCluster
    cfg: stack_model.StackConfig
    operator: SlurmOperator
    settings: steps.Settings

    def nodeset_pods(self) -> dict[str, dict[str, Any]]:
        """Node name -> the live NodeSet pod bound to it."""
        path = f"/api/v1/namespaces/{self.cfg.slurm_namespace}/pods"
        pods = self.kube.request("GET", f"{path}?labelSelector=app.kubernetes.io/component%3Dworker")["items"]
        return {
            p["spec"]["nodeName"]: p
            for p in pods
            if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
        }

    def node(self, name: str) -> slurm_nodes.Node:
        return self.slurm.node(name)


def _path(kube: KubeControlPlane, obj: dict[str, Any]) -> str:
    """The collection path of `obj` (its kind's plural from discovery)."""
    group_version = obj["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    resources = kube.request("GET", base)["resources"]
    plural = next(r["name"] for r in resources if r["kind"] == obj["kind"] and "/" not in r["name"])
    ns = (obj.get("metadata") or {}).get("namespace")
    return f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"


def _create(kube: KubeControlPlane, obj: dict[str, Any]) -> None:
    try:
        kube.request("POST", f"{_path(kube, obj)}?fieldValidation=Strict", obj)
    except KubeApiError as e:
        if e.status != 409:
            raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {e}") from e


def _stack() -> tuple[stack_model.StackConfig, list[dict[str, Any]]]:
    values = project.stack_values("dev")
    values["gpuPools"] = [
        {"name": POOL, "gpuType": "h100", "gpusPerNode": 8, "nodeNames": ACTIVE, "standbyNodeNames": STANDBY}
    ]
    values["slinkyVersion"] = VERSION
    cfg = config.from_values(values)
    records = mocks.run(lambda: program.build(cfg), stack="dev")
    objects = [
        dict(r.inputs)
        for r in records
        if r.custom
        and r.is_kubernetes_object
        and not r.is_patch
        and r.inputs["kind"] != "CustomResourceDefinition"  # the operator's own CRDs are installed instead
        and r.inputs["apiVersion"].rpartition("/")[0] in GROUPS
    ]
    objects.sort(key=lambda o: o["kind"] != "Namespace")  # namespaces first (the custom resources go last: _lab)
    return cfg, objects


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    if not (tools_built() and operator_built()):
        pytest.fail("the control plane, kwok or the slurm-operator are not built: run `make tools`")
    # Not under pytest's private (0700) temporary root: slurmctld (as slurm) and slurmrestd (as nobody) read here.
    base = Path(tempfile.mkdtemp(prefix="fleetheal-slinky-"))
    base.chmod(0o755)
    try:
        yield from _lab(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _lab(base: Path) -> Iterator[Lab]:
    slurm_user = pwd.getpwnam("slurm")
    key = os.urandom(32)
    key_file = base / "jwt.key"
    key_file.write_bytes(key)
    os.chown(key_file, slurm_user.pw_uid, slurm_user.pw_gid)
    key_file.chmod(0o400)
    cfg, objects = _stack()
    with KubeControlPlane(base / "kube", scheduler=True) as kube:
        kube.install_crds(operator_crds())
        kube.install_crds(p for p in default_crds(SHARED) if "slinky" not in p.parts)  # Kueue, prometheus-operator
        kube.add_nodes([*ACTIVE, *STANDBY], gpus=8)
        for obj in objects:
            if obj["kind"] == "Namespace" or obj["apiVersion"].partition("/")[0] != SLINKY:
                _create(kube, obj)
        # The keys the stack expects to exist (Pulumi.dev.yaml sets none: an SRE creates them).
        for name, item, value in (
            (cfg.slurm_key_secret, "slurm.key", os.urandom(1024)),
            (cfg.slurm_jwt_secret, "jwt.key", key),
            (cfg.accounting_db_password_secret, "password", os.urandom(16).hex().encode()),
        ):
            secret = {"metadata": {"name": name}, "data": {item: _b64(value)}}
            kube.request("POST", f"/api/v1/namespaces/{cfg.slurm_namespace}/secrets", secret)
        # The shared ReadWriteMany volume the stack's claim asks for, as the cluster's storage would provide it.
        volume = {
            "metadata": {"name": "shared"},
            "spec": {
                "storageClassName": cfg.shared_storage_class,
                "accessModes": ["ReadWriteMany"],
                "capacity": {"storage": cfg.shared_storage_size},
                "hostPath": {"path": str(base / "shared")},
            },
        }
        kube.request("POST", "/api/v1/persistentvolumes", volume)
        # Pool labels and the standby taint, as the remediator's membership controller applies them.
        MembershipController(_core(kube), cfg.system_namespace).sync()
        for obj in objects:
            if obj["apiVersion"].partition("/")[0] == SLINKY:
                _create(kube, obj)
        slurm = SlurmCluster(
            base / "slurm",
            nodes=len(ACTIVE) + len(STANDBY),
            node_prefix="gpu-h100-0",
            cluster_name=cfg.cluster_name,
            gpu_type="h100",
            extra_conf=jwt_conf(key_file),
            slurm_user="slurm",
        )
        with slurm:
            settings = steps.Settings(
                slurm_env={"SLURM_CONF": str(slurm.conf_path)}, kubeconfig=str(kube.kubeconfig), slurm_retries=1
            )
            for node in STANDBY:  # a warm standby: drained with the owned standby reason
                slurm.scontrol("update", f"nodename={node}", "state=DRAIN", f"reason={settings.standby_reason}")
            with Slurmrestd(slurm, base / "slurmrestd.log"):
                deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == OPERATOR)
                account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
                token = kube.service_account_token(deployment["metadata"]["namespace"], account)
                kubeconfig = write_kubeconfig(
                    base / "operator.kubeconfig", kube.url, kube.pki / "ca.crt", account, {"token": token}
                )
                args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
                with SlurmOperator(kubeconfig, args, base / "operator.log") as operator:
                    yield Lab(kube, slurm, cfg, operator, settings)


def _b64(value: bytes) -> str:
    import base64

    return base64.b64encode(value).decode()


def _core(kube: KubeControlPlane) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube.client())


def _wait(what: str, check: Callable[[], object], timeout: float = 60.0) -> None:
    wait_until(check, timeout, what, interval=0.5)


def _holds(what: str, check: Callable[[], bool], seconds: float = SETTLE_S) -> None:
    """`check()` stays true for `seconds` (no flapping), sampled every 0.2 s."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert check(), what
        time.sleep(0.2)


def test_a_second_slurmrestd_on_the_operators_port_is_refused(tmp_path: Path) -> None:
    """Port 6820 is the operator's: with anything listening there (another lab, or a local user's listener that
    would receive the operator's tokens), the lab refuses to start its slurmrestd."""
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with contextlib.suppress(OSError):  # taken already (this module's lab): the same case
            squatter.bind(("127.0.0.1", RESTAPI_PORT))
            squatter.listen()
        with pytest.raises(SlinkyLabError, match=r"127\.0\.0\.1:6820 is taken"):
            Slurmrestd(SlurmCluster(tmp_path / "slurm"), tmp_path / "slurmrestd.log").start()
    finally:
        squatter.close()


def test_the_operator_accepts_and_reconciles_the_stack(lab: Lab) -> None:
    ns, cluster = lab.cfg.slurm_namespace, lab.cfg.cluster_name

    # Each custom resource's workload: slurmctld, slurmdbd, slurmrestd and the login pods.
    def owners() -> set[str]:
        items = [
            *lab.kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/statefulsets")["items"],
            *lab.kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"],
        ]
        return {ref["kind"] for o in items for ref in o["metadata"].get("ownerReferences") or []}

    _wait("a workload per custom resource", lambda: {"Controller", "Accounting", "RestApi", "LoginSet"} <= owners())
    # slurm.conf carries the program's extraConf (the agent's hooks, requeue, the partitions).
    controller = lab.kube.request("GET", f"/apis/{SLINKY}/v1beta1/namespaces/{ns}/controllers/{cluster}")
    configs = lab.kube.request("GET", f"/api/v1/namespaces/{ns}/configmaps")["items"]
    slurm_conf = next(c["data"]["slurm.conf"] for c in configs if "slurm.conf" in (c.get("data") or {}))
    for line in controller["spec"]["extraConf"].splitlines():
        assert line in slurm_conf.splitlines(), line
    # One slurmd pod per active node, none on the standby: scheduled by kube-scheduler, run by kwok.
    _wait("a NodeSet pod on each active node", lambda: sorted(lab.nodeset_pods()) == ACTIVE)
    pods = lab.nodeset_pods()
    for node, pod in pods.items():
        assert pod["spec"]["hostname"] == node  # the Slurm node name, DaemonSet mode
        assert pod["metadata"]["labels"][contracts.LABEL_GPU_POOL] == POOL
    _wait("kwok to run them", lambda: all(p["status"].get("phase") == "Running" for p in lab.nodeset_pods().values()))
    # The operator reached Slurm through slurmrestd with its own token: it records each pod on its node.
    _wait(
        "the operator to write the pod into each Slurm node's comment",
        lambda: all(pods[n]["metadata"]["name"] in lab.node(n).comment for n in ACTIVE),
    )
    assert lab.operator.running


def _watch_reasons(lab: Lab, node: str, stop: threading.Event, seen: list[str]) -> None:
    while not stop.is_set():
        seen.append(lab.node(node).reason)
        time.sleep(0.1)


def test_isolation_and_a_standby_promotion_as_fleetheal_does_them(lab: Lab) -> None:
    """The first responder's order: drain in Slurm with fleetheal's reason, cordon and taint, evict, quarantine;
    then promote the standby node (resume it, label it active, remove its standby taint). The operator moves
    slurmd's pod with the pool labels and leaves fleetheal's Slurm state alone."""
    failed, standby = ACTIVE[0], STANDBY[0]
    slurm, kube = steps.Slurm(lab.settings), steps.Kube(lab.settings)
    _wait("the NodeSet pods", lambda: sorted(lab.nodeset_pods()) == ACTIVE)
    reason = contracts.drain_reason("xid-79", "inc-op-1", gpu="1")
    assert steps.drain_node(slurm, failed, reason).changed
    assert steps.k8s_isolate(kube, failed, "xid-79").outcome == "done"
    assert steps.k8s_drain(kube, failed, timeout_s=30).outcome == "done"
    promoted = steps.promote_standby(slurm, failed, "inc-op-1")
    assert (promoted.outcome, promoted.node) == ("done", standby)
    assert steps.k8s_promote(kube, standby).changed

    _wait(
        "slurmd's pod to leave the failed node for the promoted one",
        lambda: sorted(lab.nodeset_pods()) == [*ACTIVE[1:], standby],
    )
    _holds(
        "fleetheal's drain of the failed node and the promoted node's resume hold under the operator",
        lambda: (lab.node(failed).reason, lab.node(failed).drained, lab.node(standby).drained) == (reason, True, False),
    )
    pod = lab.nodeset_pods()[standby]
    # The operator keeps its pod's identity in the Slurm node's comment; fleetheal's record of the promotion is
    # in the node's Extra field, which the operator leaves alone: a retry of the incident promotes nothing more.
    _wait(
        "the operator's pod record on the promoted node", lambda: pod["metadata"]["name"] in lab.node(standby).comment
    )
    assert "incident=inc-op-1" in lab.node(standby).extra.split()
    again = steps.promote_standby(slurm, failed, "inc-op-1")
    assert (again.outcome, again.node, again.changed) == ("done", standby, False)


def test_rejoin_uncordons_before_it_resumes_so_the_operator_never_drains_the_node(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node cordoned while its slurmd pod still runs (an eviction that a budget refused): the operator
    leaves fleetheal's drain alone. Rejoin then returns it to service, and the operator never drains it with
    its own reason on the way (it would, were the Slurm node resumed while the Kubernetes node is cordoned)."""
    # ansible-runner finds ansible-playbook on PATH: the one installed beside this interpreter.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    node = ACTIVE[1]
    slurm, kube = steps.Slurm(lab.settings), steps.Kube(lab.settings)
    _wait("a NodeSet pod on the node", lambda: node in lab.nodeset_pods())
    reason = contracts.drain_reason("xid-48", "inc-op-2", gpu="3")
    assert steps.drain_node(slurm, node, reason).changed
    assert steps.k8s_isolate(kube, node, "xid-48").outcome == "done"
    _holds("the operator leaves fleetheal's drain of a cordoned node alone", lambda: lab.node(node).reason == reason)
    assert node in lab.nodeset_pods()
    # Revalidation passed: fleetheal's standby reason (fleetheal_standby_reason), as revalidate.yml leaves it.
    lab.slurm.scontrol("update", f"nodename={node}", f"reason={lab.settings.standby_reason} incident=inc-op-2")

    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_reasons, args=(lab, node, stop, seen), daemon=True)
    watcher.start()
    try:
        playbooks = Playbooks(lab.slurm, tmp_path)
        extra = playbooks.base_vars(
            fleetheal_node=node,
            fleetheal_incident_id="inc-op-2",
            fleetheal_action="REJOIN",
            fleetheal_fault_id="xid-48",
            fleetheal_cluster=lab.cfg.cluster_name,
            fleetheal_kubeconfig=str(lab.kube.kubeconfig),
            fleetheal_slurm_namespace=lab.cfg.slurm_namespace,
        )
        run = playbooks.run("rejoin.yml", extra)
        assert run.rc == 0, run.stdout[-4000:]
        assert run.report is not None and run.report["status"] == "done"
        _holds("the node stays in service", lambda: not lab.node(node).drained)
    finally:
        stop.set()
        watcher.join()
    assert len(seen) > 20, "the watcher stopped reading the node"  # the rejoin and 8 s after it, every 0.1 s
    assert not any(r.startswith("slurm-operator:") for r in seen), sorted(set(seen))
    node_doc = lab.kube.request("GET", f"/api/v1/nodes/{node}")
    assert not node_doc["spec"].get("unschedulable")


def test_a_cordon_without_fleetheals_drain_hands_the_slurm_node_to_the_operator(lab: Lab) -> None:
    """Why fleetheal drains in Slurm before it cordons, and uncordons before it resumes: a cordoned node whose
    Slurm node carries no reason of someone else's is drained by the operator, with the operator's reason,
    which fleetheal does not own (its drain then leaves the node alone); uncordoned, the operator undrains it."""
    node = ACTIVE[2]
    slurm, kube = steps.Slurm(lab.settings), steps.Kube(lab.settings)
    _wait("a NodeSet pod on the node", lambda: node in lab.nodeset_pods())
    assert not lab.node(node).drained
    assert steps.k8s_isolate(kube, node, "xid-63").outcome == "done"
    _wait("the operator to drain the node", lambda: lab.node(node).reason.startswith("slurm-operator:"))
    assert lab.node(node).drained
    drain = steps.drain_node(slurm, node, contracts.drain_reason("xid-63", "inc-op-3"))
    assert drain.outcome == "skipped" and "which fleetheal does not own" in drain.detail

    lab.kube.request(
        "PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": None}}, "application/merge-patch+json"
    )
    _wait("the operator to undrain the node", lambda: not lab.node(node).drained)


def test_a_second_lab_operator_waits_for_the_port_instead_of_failing_on_it(tmp_path: Path) -> None:
    """Port 6820 is the operator's, fixed: two test sessions on one machine take turns on its lock (here a
    private lock file, so that this test never waits for another session's operator)."""
    from fleetheal.lab.slinky import _port_lock
    from fleetheal.wait import WaitTimeout

    path = tmp_path / "port.lock"
    first = _port_lock(wait_s=5, path=path)
    try:
        with pytest.raises(WaitTimeout, match="another lab's operator"):
            _port_lock(wait_s=0.6, path=path)
        released = threading.Timer(0.3, first.close)
        released.start()
        second = _port_lock(wait_s=60, path=path)  # takes it once the first closes
        second.close()
        released.join()
    finally:
        first.close()


def test_the_port_lock_never_follows_a_symlink_a_local_user_planted(tmp_path: Path) -> None:
    """The lock lives in the temporary directory, which every local user can write: a symlink planted at
    its name must not make the lab (root) open, create or truncate the file it points to."""
    from fleetheal.lab.slinky import _port_lock

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    planted = tmp_path / "port.lock"
    planted.symlink_to(target)
    with pytest.raises(OSError):
        _port_lock(wait_s=1, path=planted)
    assert target.read_text() == "keep me\n"
