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
from fleetheal.infra import common

COMPONENT = "HealthAgent"
NAME = "fleetheal-agent"
#: The agent's ClusterRole (also the lab's): the fast path taints and labels its own node before any alert
#: travels. RBAC cannot restrict this to the agent's own node: `own_node_policy` does.
AGENT_RBAC_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
#: The user-info extra in which the API server names the Node a service-account token is bound to: a token
#: bound to a Node, or to a Pod (the kubelet's projected token: the API server records the pod's node in it,
#: feature ServiceAccountTokenPodNodeInfo, GA in Kubernetes 1.32).
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: Name of the ValidatingAdmissionPolicy (and of its binding) that keeps each agent to its own Node.
OWN_NODE_POLICY = "fleetheal-agent-own-node"
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


def own_node_policy(namespace: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ValidatingAdmissionPolicy and its binding that make the agent's token node-scoped (the stack
    declares them beside the agent's RBAC; the lab installs these same objects on its API server).

    For an update (PATCH or PUT) of a Node by the agent's ServiceAccount (`namespace`/fleetheal-agent):
    - the Node must be the one named in the token (`NODE_NAME_EXTRA`); a token bound to no node may change
      no Node at all;
    - on its own Node the agent may only add the `fleetheal.io/unhealthy` taint and set the
      `fleetheal.io/fault` label: it removes or changes no taint (an isolation taint put there by the
      remediator stays), changes no other label (not its pool) nor annotation, and does not uncordon.
    Reading Nodes stays open to the agent, as it is to every kubelet.
    """
    user = f"system:serviceaccount:{namespace}:{NAME}"
    unhealthy, fault = contracts.TAINT_UNHEALTHY, contracts.LABEL_FAULT
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": OWN_NODE_POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
                ]
            },
            "matchConditions": [
                {"name": "is-the-fleetheal-agent", "expression": f"request.userInfo.username == '{user}'"}
            ],
            "variables": [
                {
                    "name": "boundNode",
                    "expression": f"'{NODE_NAME_EXTRA}' in request.userInfo.extra"
                    f" ? request.userInfo.extra['{NODE_NAME_EXTRA}'] : []",
                },
                {"name": "oldTaints", "expression": "has(oldObject.spec.taints) ? oldObject.spec.taints : []"},
                {"name": "newTaints", "expression": "has(object.spec.taints) ? object.spec.taints : []"},
                {"name": "oldLabels", "expression": "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}"},
                {"name": "newLabels", "expression": "has(object.metadata.labels) ? object.metadata.labels : {}"},
            ],
            "validations": [
                {
                    "expression": "variables.boundNode == [object.metadata.name]",
                    "messageExpression": (
                        "size(variables.boundNode) == 0"
                        " ? 'the fleetheal agent token is bound to no node: it may change no Node'"
                        " : 'the fleetheal agent of node ' + variables.boundNode[0]"
                        " + ' may change only its own Node, not ' + object.metadata.name"
                    ),
                    "reason": "Forbidden",
                },
                {
                    "expression": "variables.oldTaints.all(t, t in variables.newTaints)"
                    f" && variables.newTaints.all(t, t in variables.oldTaints || t.key == '{unhealthy}')",
                    "message": f"the fleetheal agent may only add the {unhealthy} taint; it removes or changes none",
                    "reason": "Forbidden",
                },
                {
                    "expression": f"variables.newLabels.all(k, k == '{fault}'"
                    " || (k in variables.oldLabels && variables.oldLabels[k] == variables.newLabels[k]))"
                    f" && variables.oldLabels.all(k, k == '{fault}' || k in variables.newLabels)"
                    " && (has(object.metadata.annotations) ? object.metadata.annotations : {})"
                    " == (has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {})"
                    " && (has(object.spec.unschedulable) && object.spec.unschedulable)"
                    " == (has(oldObject.spec.unschedulable) && oldObject.spec.unschedulable)",
                    "message": f"the fleetheal agent may only set the {fault} label; it changes no other label,"
                    " annotation or cordon",
                    "reason": "Forbidden",
                },
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": OWN_NODE_POLICY},
        "spec": {"policyName": OWN_NODE_POLICY, "validationActions": ["Deny"]},
    }
    return policy, binding


def agent_config(port: int) -> dict[str, Any]:
    """The agent's YAML config (fleetheal/agent/config.py schema) for the DaemonSet.

    In a pod the agent taints its own Kubernetes node on the fast path; it has no Slurm client, so
    the Slurm side goes through the health file: the Slurm HealthCheckProgram (every
    HealthCheckInterval) and the prolog read it and drain the node or refuse the job.
    """
    return {
        "health_file": contracts.AGENT_HEALTH_FILE,
        "metrics": {"listen": "0.0.0.0", "port": port},  # noqa: S104 - scraped by Prometheus
        "training": {"socket": f"{contracts.AGENT_STATE_DIR}/training.sock"},
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
                    "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 10},
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
        self.register_outputs({"daemonset": NAME})
