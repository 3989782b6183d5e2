"""DcgmExporter: NVIDIA dcgm-exporter on GPU nodes (optional; skip it when the GPU operator runs one)."""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal import contracts
from fleetheal.infra import agent, common

COMPONENT = "DcgmExporter"
NAME = "dcgm-exporter"
PORT = 9400


class DcgmExporterArgs(TypedDict):
    namespace: str
    """Namespace of the DaemonSet (must exist)."""
    image: str
    """Pinned dcgm-exporter image."""
    monitoring_labels: dict[str, str]
    """Labels that make the Prometheus operator select the ServiceMonitor."""
    runtime_class: str
    """RuntimeClass that injects GPUs (usually `nvidia`); empty for the node default."""


class DcgmExporter(pulumi.ComponentResource):
    def __init__(self, name: str, args: DcgmExporterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(a, COMPONENT, ("namespace", "image", "monitoring_labels", "runtime_class"))
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.pinned_image(COMPONENT, "image", a["image"])
        super().__init__("fleetheal:dcgm:DcgmExporter", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = common.labels("gpu-metrics", NAME)
        sel = {"app.kubernetes.io/name": NAME}
        pod_spec: dict[str, Any] = {
            "affinity": {"nodeAffinity": agent.node_affinity()},
            "tolerations": [{"key": t, "operator": "Exists"} for t in agent.TOLERATED_TAINTS],
            "containers": [
                {
                    "name": NAME,
                    "image": a["image"],
                    "env": [
                        {"name": "DCGM_EXPORTER_LISTEN", "value": f":{PORT}"},
                        {"name": "DCGM_EXPORTER_KUBERNETES", "value": "true"},
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    ],
                    "ports": [{"name": "metrics", "containerPort": PORT}],
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "128Mi"},
                        "limits": {"cpu": "1", "memory": "512Mi"},
                    },
                    # DCGM profiling (DCP) fields need CAP_SYS_ADMIN (NVIDIA dcgm-exporter README).
                    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "runAsNonRoot": False},
                    "volumeMounts": [
                        {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
                    ],
                }
            ],
            "volumes": [{"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources"}}],
        }
        if a["runtime_class"]:
            pod_spec["runtimeClassName"] = a["runtime_class"]
        self.daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-ds",
            metadata={"name": NAME, "namespace": ns, "labels": labels},
            spec={
                "selector": {"matchLabels": sel},
                "template": {"metadata": {"labels": {**labels, **sel}}, "spec": pod_spec},
            },
            opts=child,
        )
        self.service, self.service_monitor = common.metrics_service(
            name,
            self,
            name=NAME,
            namespace=ns,
            labels=labels,
            selector=sel,
            port=PORT,
            monitoring_labels=a["monitoring_labels"],
            relabelings=[],
        )
        self.register_outputs({"daemonset": NAME, "gpu_label": contracts.LABEL_GPU_TYPE})
