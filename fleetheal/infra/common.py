"""Helpers shared by the fleetheal Pulumi components: argument checks, labels, images."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# The policy pack's rules (policies/rules/shared.py) define what "pinned" and the environment label mean; the
# components refuse at construction what the pack would refuse at preview.
from fleetheal.infra.policy.shared import image_is_pinned

#: Labels every object fleetheal creates carries (Kubernetes recommended labels).
MANAGED_BY = {"app.kubernetes.io/managed-by": "fleetheal", "app.kubernetes.io/part-of": "fleetheal"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


class ComponentArgError(ValueError):
    """A component was given a bad argument; the message names the field and the accepted values."""


def labels(component: str, name: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component, **MANAGED_BY}
    if extra:
        out.update(extra)
    return out


def require(args: Mapping[str, Any], component: str, fields: Iterable[str]) -> None:
    """Raise when a required field is missing; check before any child resource is registered."""
    missing = [f for f in fields if args.get(f) is None]
    if missing:
        raise ComponentArgError(f"{component}: missing required field(s) {', '.join(missing)}")


def dns_label(component: str, field: str, value: Any, max_len: int = 63) -> str:
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > max_len:
        raise ComponentArgError(
            f"{component}.{field}: {value!r} is not accepted; use lower-case letters, digits and '-' "
            f"(at most {max_len} characters)"
        )
    return value


def one_of(component: str, field: str, value: Any, accepted: Iterable[str]) -> str:
    choices = tuple(accepted)
    if value not in choices:
        raise ComponentArgError(f"{component}.{field}: {value!r} is not accepted; use one of: {', '.join(choices)}")
    return str(value)


def positive(component: str, field: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ComponentArgError(f"{component}.{field}: {value!r} is not accepted; use an integer >= {low}")
    return value


def quantity(component: str, field: str, value: Any) -> str:
    if not isinstance(value, str) or not _QUANTITY.match(value):
        raise ComponentArgError(
            f"{component}.{field}: {value!r} is not accepted; use a Kubernetes quantity such as 10Gi"
        )
    return value


def pinned_image(component: str, field: str, value: Any) -> str:
    if not isinstance(value, str) or not image_is_pinned(value):
        raise ComponentArgError(
            f"{component}.{field}: {value!r} is not pinned; "
            "use REPOSITORY:TAG (not 'latest') or REPOSITORY@sha256:DIGEST"
        )
    return value


def cluster_dns(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"


#: Who may reach fleetheal's ports: Prometheus pods (scrapes), Alertmanager pods (the remediator's webhook), and
#: pods in namespaces an operator labels as theirs. The Prometheus operator labels its pods with these names.
PROMETHEUS_PODS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
ALERTMANAGER_PODS = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "alertmanager"}},
}
OPERATOR_NAMESPACES = {"namespaceSelector": {"matchLabels": {"fleetheal.io/operators": "true"}}}


def network_policy(
    resource_name: str,
    parent: Any,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    port: int,
    sources: list[Mapping[str, Any]],
) -> Any:
    """A NetworkPolicy admitting only `sources` to `port` of the pods `selector` picks (and nothing else in)."""
    import pulumi
    import pulumi_kubernetes as k8s

    return k8s.networking.v1.NetworkPolicy(
        f"{resource_name}-netpol",
        metadata={"name": name, "namespace": namespace, "labels": dict(labels)},
        spec={
            "podSelector": {"matchLabels": dict(selector)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [dict(s) for s in sources], "ports": [{"protocol": "TCP", "port": port}]}],
        },
        opts=pulumi.ResourceOptions(parent=parent),
    )


def service_monitor(
    resource_name: str,
    parent: Any,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    port: str,
    relabelings: list[dict[str, Any]],
    depends_on: list[Any],
) -> Any:
    """A ServiceMonitor scraping /metrics on the named `port` of the Services matching `selector` every 15 s;
    `labels` must include the ones that make the Prometheus operator select it. The scrape's `job` label is
    the Service's name (the health rules name it: `policies/health-rules.yml`)."""
    import pulumi
    import pulumi_kubernetes as k8s

    return k8s.apiextensions.CustomResource(
        f"{resource_name}-servicemonitor",
        api_version="monitoring.coreos.com/v1",
        kind="ServiceMonitor",
        metadata={"name": name, "namespace": namespace, "labels": dict(labels)},
        spec={
            "selector": {"matchLabels": dict(selector)},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": relabelings}],
        },
        opts=pulumi.ResourceOptions(parent=parent, depends_on=depends_on),
    )


def metrics_service(
    resource_name: str,
    parent: Any,
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    port: int,
    monitoring_labels: Mapping[str, str],
    relabelings: list[dict[str, Any]],
) -> tuple[Any, Any]:
    """A headless Service over a DaemonSet's `metrics` port and the ServiceMonitor scraping it every 15 s.

    Every relabeling list starts from the pod's node name as `node`: alerts name the node to act on.
    """
    import pulumi
    import pulumi_kubernetes as k8s

    service = k8s.core.v1.Service(
        f"{resource_name}-svc",
        metadata={"name": name, "namespace": namespace, "labels": dict(labels)},
        spec={
            "clusterIP": "None",
            "selector": dict(selector),
            "ports": [{"name": "metrics", "port": port, "targetPort": port}],
        },
        opts=pulumi.ResourceOptions(parent=parent),
    )
    monitor = service_monitor(
        resource_name,
        parent,
        name=name,
        namespace=namespace,
        labels={**labels, **monitoring_labels},
        selector=selector,
        port="metrics",
        relabelings=[{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}, *relabelings],
        depends_on=[service],
    )
    return service, monitor
