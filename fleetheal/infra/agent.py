"""HealthAgent: the fleetheal node agent DaemonSet on every GPU node, and its ServiceMonitor.

Privileges are the minimum the agent needs: read `/dev/kmsg` (CAP_SYSLOG, the device mounted
read-only) and see the GPUs (the NVIDIA container runtime injects the devices named by
NVIDIA_VISIBLE_DEVICES). It is not privileged, runs with a read-only root filesystem and drops
every other capability. It taints its own node on a fault, so it may patch nodes; RBAC cannot name
"its own" node, so a ValidatingAdmissionPolicy (`own_node_policy`) holds each agent to the Node its
service-account token is bound to, and to adding its fault taint and label there.
"""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s
import yaml

from fleetheal import contracts
from fleetheal.contracts import AGENT_RBAC_RULES, own_node_policy
from fleetheal.infra import common

COMPONENT = "HealthAgent"
NAME = contracts.AGENT_NAME
#: Taints the agent tolerates: it must keep watching standby, isolated and GPU-tainted nodes.
TOLERATED_TAINTS = (contracts.TAINT_STANDBY, contracts.TAINT_UNHEALTHY, "nvidia.com/gpu")


class HealthAgentArgs(TypedDict):
    namespace: str
    """Namespace of the DaemonSet (the fleetheal system namespace; must exist)."""
    image: str
    """Pinned agent image."""
    port: int
    """Metrics and health port (host network)."""
    cluster_name: str
    """Cluster name, exported as the `cluster` label value."""
    monitoring_labels: dict[str, str]
    """Labels that make the Prometheus operator select the ServiceMonitor."""
    runtime_class: str
    """RuntimeClass that injects GPUs (usually `nvidia`); empty to use the node default."""


CONFIG_MOUNT = "/etc/fleetheal"


def agent_config(port: int) -> dict[str, Any]:
    """The agent's YAML config (fleetheal/agent/config.py schema) for the DaemonSet.

    In a pod the agent taints its own Kubernetes node on the fast path; it has no Slurm client, so
    the Slurm side goes through the health file: the Slurm HealthCheckProgram (every
    HealthCheckInterval) and the prolog read it and drain the node or refuse the job.
    """
    return {
        "health_file": contracts.AGENT_HEALTH_FILE,
        "metrics": {"listen": "0.0.0.0", "port": port},  # noqa: S104 - scraped by Prometheus
        "training": {
            "socket": f"{contracts.AGENT_STATE_DIR}/training.sock",
            "job_owners_dir": contracts.AGENT_JOBS_DIR,
        },
        # The root filesystem is read-only: the kernel log's place lives in the state directory (a hostPath, so it
        # outlives the pod; a reboot starts a new boot's log anyway).
        "kernel_log": {"position_file": f"{contracts.AGENT_STATE_DIR}/kernel-log.position"},
        "fastpath": {"slurm": {"enabled": False}, "kubernetes": {"enabled": True}},
    }


def node_affinity() -> dict[str, Any]:
    """Every node in a fleetheal pool, whatever its role (active, standby, quarantine)."""
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": contracts.LABEL_POOL, "operator": "In", "values": list(contracts.POOLS)}]}
            ]
        }
    }


class HealthAgent(pulumi.ComponentResource):
    """The agent DaemonSet, a headless Service for scraping, its ServiceMonitor and RBAC."""

    def __init__(self, name: str, args: HealthAgentArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(
            a, COMPONENT, ("namespace", "image", "port", "cluster_name", "monitoring_labels", "runtime_class")
        )
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.pinned_image(COMPONENT, "image", a["image"])
        port = common.positive(COMPONENT, "port", a["port"])
        if port > 65535:
            raise common.ComponentArgError(f"{COMPONENT}.port: {port} is not accepted; use 1-65535")
        super().__init__("fleetheal:agent:HealthAgent", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = common.labels("agent", NAME)
        sel = {"app.kubernetes.io/name": NAME}

        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata={"name": NAME, "namespace": ns, "labels": labels}, opts=child
        )
        self.role = k8s.rbac.v1.ClusterRole(
            f"{name}-role",
            metadata={"name": NAME, "labels": labels},
            rules=AGENT_RBAC_RULES,
            opts=child,
        )
        self.binding = k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-binding",
            metadata={"name": NAME, "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            subjects=[{"kind": "ServiceAccount", "name": NAME, "namespace": ns}],
            opts=child,
        )
        policy, policy_binding = own_node_policy(ns)
        self.own_node_policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
            f"{name}-own-node",
            metadata={**policy["metadata"], "labels": labels},
            spec=policy["spec"],
            opts=child,
        )
        self.own_node_binding = k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
            f"{name}-own-node-binding",
            metadata={**policy_binding["metadata"], "labels": labels},
            spec=policy_binding["spec"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.own_node_policy]),
        )
        self.config_map = k8s.core.v1.ConfigMap(
            f"{name}-config",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            data={"agent.yaml": yaml.safe_dump(agent_config(port), sort_keys=True)},
            opts=child,
        )
        pod_spec: dict[str, Any] = {
            "serviceAccountName": NAME,
            # The kubelet's projected token is bound to this pod, and the API server names the pod's node in
            # it: what `own_node_policy` compares with the Node being patched.
            "automountServiceAccountToken": True,
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "priorityClassName": "system-node-critical",
            "affinity": {"nodeAffinity": node_affinity()},
            "tolerations": [{"key": t, "operator": "Exists"} for t in TOLERATED_TAINTS],
            "containers": [
                {
                    "name": "agent",
                    "image": a["image"],
                    "args": ["agent", "run", "--config", f"{CONFIG_MOUNT}/agent.yaml"],
                    "env": [
                        # the Kubernetes node name, which is also the Slurm node name in fleetheal
                        {"name": "FLEETHEAL_AGENT_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "FLEETHEAL_CLUSTER", "value": a["cluster_name"]},
                        # The NVIDIA container runtime mounts these GPUs' device nodes and NVML.
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
                    ],
                    "ports": [{"name": "metrics", "containerPort": port, "hostPort": port}],
                    "readinessProbe": {
                        "httpGet": {"path": contracts.AGENT_READY_PATH, "port": port},
                        "periodSeconds": 10,
                    },
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "64Mi"},
                        "limits": {"cpu": "500m", "memory": "256Mi"},
                    },
                    "securityContext": {
                        "privileged": False,
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        # Reading /dev/kmsg needs CAP_SYSLOG when kernel.dmesg_restrict=1; nothing else.
                        "capabilities": {"drop": ["ALL"], "add": ["SYSLOG"]},
                    },
                    "volumeMounts": [
                        {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True},
                        {"name": "state", "mountPath": contracts.AGENT_STATE_DIR},
                        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}},
                {"name": "state", "hostPath": {"path": contracts.AGENT_STATE_DIR, "type": "DirectoryOrCreate"}},
                {"name": "config", "configMap": {"name": NAME}},
            ],
        }
        if a["runtime_class"]:
            pod_spec["runtimeClassName"] = a["runtime_class"]
        self.daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-ds",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={
                "selector": {"matchLabels": sel},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
                "template": {"metadata": {"labels": {**labels, **sel}}, "spec": pod_spec},
            },
            # a changed config must reach the pods: the DaemonSet waits for the ConfigMap
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.config_map]),
        )
        self.service, self.service_monitor = common.metrics_service(
            name,
            self,
            name=NAME,
            namespace=ns,
            labels=labels,
            selector=sel,
            port=port,
            monitoring_labels=a["monitoring_labels"],
            # Every fleetheal alert must carry `cluster` (the remediator checks it); set here it does not
            # depend on the Prometheus server's external labels.
            relabelings=[{"action": "replace", "targetLabel": "cluster", "replacement": a["cluster_name"]}],
        )
        # Only Prometheus may reach the metrics port. The agent runs in the host's network: a CNI enforces this on
        # such pods only where it applies policies to host endpoints (Cilium's host firewall, Calico's host
        # endpoints); the endpoint's connection guard holds either way (fleetheal/connguard.py).
        self.network_policy = common.network_policy(
            name,
            self,
            name=NAME,
            namespace=ns,
            labels=labels,
            selector=sel,
            port=port,
            sources=[common.PROMETHEUS_PODS],
        )
        self.register_outputs({"daemonset": NAME})
