"""Rules on who can reach fleetheal's workloads and what their service accounts may do: every binding of the
agent's or the remediator's ServiceAccount names a role the stack declares as that component's (whose rules the
least-privilege rules read), and every workload of theirs is behind a NetworkPolicy that admits named sources.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import ReportViolation, StackValidationArgs

from .shared import COMPONENT_LABEL, _kind, _labels, _name

RBAC = "rbac.authorization.k8s.io/v1"
#: The components whose service accounts and workloads these rules guard.
GUARDED = ("agent", "remediator")
WORKLOADS = (("apps/v1", "Deployment"), ("apps/v1", "DaemonSet"), ("apps/v1", "StatefulSet"))


def _namespace(props: Mapping[str, Any]) -> str:
    return str((props.get("metadata") or {}).get("namespace") or "")


def validate_service_accounts_bound_to_own_roles(args: StackValidationArgs, report: ReportViolation) -> None:
    """A binding of the agent's or the remediator's ServiceAccount names a role of the stack labelled as that
    component's. Before, the least-privilege rule read only roles labelled as the remediator's, so a binding of
    its ServiceAccount to cluster-admin passed."""
    accounts: dict[tuple[str, str], str] = {}
    roles: dict[tuple[str, str, str], str] = {}
    for r in args.resources:
        api, kind = _kind(r.props)
        component = _labels(r.props).get(COMPONENT_LABEL, "")
        if (api, kind) == ("v1", "ServiceAccount") and component in GUARDED:
            accounts[(_namespace(r.props), _name(r.props))] = component
        elif api == RBAC and kind in ("Role", "ClusterRole"):
            roles[(kind, _namespace(r.props) if kind == "Role" else "", _name(r.props))] = component
    for r in args.resources:
        api, kind = _kind(r.props)
        if api != RBAC or kind not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = r.props.get("roleRef") or {}
        ref_kind, ref_name = str(ref.get("kind", "")), str(ref.get("name", ""))
        where = _namespace(r.props) if ref_kind == "Role" else ""
        for subject in r.props.get("subjects") or []:
            if subject.get("kind") != "ServiceAccount":
                continue
            account = (str(subject.get("namespace") or _namespace(r.props)), str(subject.get("name", "")))
            owner = accounts.get(account)
            if owner is None or roles.get((ref_kind, where, ref_name)) == owner:
                continue
            report(
                f"{kind} '{_name(r.props)}' gives the {owner}'s ServiceAccount {account[0]}/{account[1]} the "
                f"{ref_kind} '{ref_name}', which the stack does not declare as the {owner}'s: its rules escape "
                f"the least-privilege checks (a binding to cluster-admin would pass). Fix: bind the {owner}'s "
                f"ServiceAccount only to the roles labelled {COMPONENT_LABEL}={owner} that the stack declares.",
                None,
            )


def _covers(policy: Mapping[str, Any], namespace: str, pod_labels: Mapping[str, str]) -> bool:
    """`policy` (a NetworkPolicy's props) restricts ingress to the pods with `pod_labels` in `namespace`, and
    admits only named sources."""
    spec = policy.get("spec") or {}
    if _namespace(policy) != namespace or "Ingress" not in (spec.get("policyTypes") or []):
        return False
    selector = spec.get("podSelector") or {}
    if selector.get("matchExpressions"):
        return False
    if any(pod_labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(rule.get("from") for rule in spec.get("ingress") or [])


def validate_workloads_behind_network_policy(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every workload of the agent and the remediator is selected by a NetworkPolicy of its namespace that restricts
    ingress to named sources (no rule open to everyone)."""
    policies = [r.props for r in args.resources if _kind(r.props) == ("networking.k8s.io/v1", "NetworkPolicy")]
    for r in args.resources:
        if _kind(r.props) not in WORKLOADS:
            continue
        component = _labels(r.props).get(COMPONENT_LABEL, "")
        if component not in GUARDED:
            continue
        template = ((r.props.get("spec") or {}).get("template") or {}).get("metadata") or {}
        pod_labels = template.get("labels") or {}
        if not any(_covers(p, _namespace(r.props), pod_labels) for p in policies):
            report(
                f"{_kind(r.props)[1]} '{_name(r.props)}' ({component}) has no NetworkPolicy restricting who reaches "
                "it. Any pod of the cluster could then send the remediator alerts or hold the agent's metrics port. "
                "Fix: a NetworkPolicy in its namespace whose podSelector picks its pods, with policyTypes [Ingress] "
                "and ingress only from Prometheus (metrics), Alertmanager (the webhook) and operators' namespaces.",
                None,
            )
