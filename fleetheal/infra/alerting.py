"""AlertRouting: the PrometheusRule generated from the fault taxonomy, the PrometheusRule on fleetheal's own
health (its blind spots: `policies/health-rules.yml`), and the AlertmanagerConfig that routes fault alerts to the
remediator, authenticated with a bearer token read from a Secret; the health alerts go to the operators'
receivers (Alertmanager's own routes), never to the remediator."""

from __future__ import annotations

from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s

from fleetheal.infra import common

COMPONENT = "AlertRouting"
NAME = "fleetheal"
RECEIVER = "fleetheal-remediator"
#: Alert names the taxonomy generates start with this (fleetheal.generate.alert_name).
ALERT_NAME_REGEX = "Fleetheal.+"


class AlertRoutingArgs(TypedDict):
    namespace: str
    """Namespace of the PrometheusRule and AlertmanagerConfig (the fleetheal system namespace)."""
    rule_groups: list[dict[str, Any]]
    """Prometheus rule groups (fleetheal.generate.alert_rule_groups())."""
    health_rule_groups: list[dict[str, Any]]
    """Prometheus rule groups on fleetheal's own health (fleetheal.generate.health_rule_groups())."""
    webhook_url: str
    """The remediator's webhook URL."""
    token_secret: str
    """Secret (key `token`) with the bearer token, in the same namespace."""
    monitoring_labels: dict[str, str]
    """Labels that make the Prometheus operator select these objects."""


class AlertRouting(pulumi.ComponentResource):
    def __init__(self, name: str, args: AlertRoutingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = dict(args)
        common.require(
            a,
            COMPONENT,
            ("namespace", "rule_groups", "health_rule_groups", "webhook_url", "token_secret", "monitoring_labels"),
        )
        ns = common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.dns_label(COMPONENT, "token_secret", a["token_secret"], 253)
        for key in ("rule_groups", "health_rule_groups"):
            if not a[key] or not all(g.get("rules") for g in a[key]):
                raise common.ComponentArgError(f"{COMPONENT}.{key}: need at least one group, each with rules")
        if not str(a["webhook_url"]).startswith(("http://", "https://")):
            raise common.ComponentArgError(
                f"{COMPONENT}.webhook_url: {a['webhook_url']!r} is not accepted; use an http(s) URL"
            )
        super().__init__("fleetheal:alerting:AlertRouting", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = {**common.labels("alerting", NAME), **a["monitoring_labels"]}

        self.rule, self.health_rule = (
            k8s.apiextensions.CustomResource(
                resource,
                api_version="monitoring.coreos.com/v1",
                kind="PrometheusRule",
                metadata={"name": f"{NAME}-{what}", "namespace": ns, "labels": labels},
                spec={"groups": a[key]},
                opts=child,
            )
            for resource, what, key in (
                (f"{name}-rules", "faults", "rule_groups"),
                (f"{name}-health-rules", "health", "health_rule_groups"),
            )
        )
        self.alertmanager_config = k8s.apiextensions.CustomResource(
            f"{name}-amconfig",
            api_version="monitoring.coreos.com/v1alpha1",
            kind="AlertmanagerConfig",
            metadata={"name": RECEIVER, "namespace": ns, "labels": labels},
            spec={
                "route": {
                    "receiver": RECEIVER,
                    # Faults only: the health alerts (FleethealAgentNotScraped...) have no fault to act on.
                    "matchers": [
                        {"name": "alertname", "matchType": "=~", "value": ALERT_NAME_REGEX},
                        {"name": "fault_id", "matchType": "=~", "value": ".+"},
                    ],
                    "groupBy": ["cluster", "node", "fault_id"],
                    # Isolation is urgent: no batching delay for the first notification.
                    "groupWait": "0s",
                    "groupInterval": "30s",
                    "repeatInterval": "1h",
                },
                "receivers": [
                    {
                        "name": RECEIVER,
                        "webhookConfigs": [
                            {
                                "url": a["webhook_url"],
                                "sendResolved": True,
                                "maxAlerts": 0,
                                "httpConfig": {
                                    "authorization": {
                                        "type": "Bearer",
                                        "credentials": {"name": a["token_secret"], "key": "token"},
                                    },
                                },
                            }
                        ],
                    }
                ],
            },
            opts=child,
        )
        self.register_outputs({"receiver": RECEIVER})
