"""Rules on the remediator: least-privilege RBAC, Alertmanager's authenticated webhook, and its
replicas (more than one only with a shared PostgreSQL store and leader election; production runs several).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import yaml
from pulumi_policy import (
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    StackValidationArgs,
)

from .shared import (
    COMPONENT_LABEL,
    PRODUCTION_MARK,
    _cfg,
    _kind,
    _labels,
    _name,
    _production_namespaces,
)

REMEDIATOR_SCHEMA = PolicyConfigSchema(
    properties={
        "remediatorSecrets": {
            "type": "array",
            "items": {"type": "string"},
            "default": ["fleetheal-remediator-token", "fleetheal-remediator-store"],
            "description": "The only Secrets the remediator may read (its own: its token, its store's URI).",
        },
    }
)


def validate_remediator_rbac(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """The remediator's RBAC has no wildcard and reads no Secret but its own."""
    props = args.props
    if _kind(props)[0] != "rbac.authorization.k8s.io/v1" or _kind(props)[1] not in ("ClusterRole", "Role"):
        return
    if _labels(props).get(COMPONENT_LABEL) != "remediator":
        return
    own = list(_cfg(args, REMEDIATOR_SCHEMA)["remediatorSecrets"])
    kind = _kind(props)[1]
    for i, rule in enumerate(props.get("rules") or []):
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            if "*" in (rule.get(field) or []):
                report(
                    f"{kind} '{_name(props)}' rule {i} grants '*' in {field}. The remediator drains nodes on "
                    "alerts; a wildcard lets a compromised or buggy remediator do anything else too. "
                    "Fix: list the exact apiGroups, resources and verbs it needs.",
                    None,
                )
        if "secrets" in (rule.get("resources") or []):
            names = list(rule.get("resourceNames") or [])
            extra = [n for n in names if n not in own]
            if kind == "ClusterRole" or not names or extra or set(rule.get("verbs") or []) - {"get"}:
                report(
                    f"{kind} '{_name(props)}' rule {i} lets the remediator read Secrets beyond its own "
                    f"({', '.join(own)}). Secrets hold Slurm, JWT and database keys that remediation never needs. "
                    "Fix: a namespaced Role with resources [secrets], verbs [get] and resourceNames set to the "
                    "remediator's own Secrets (its token, its store's URI).",
                    None,
                )


def validate_alertmanager_receiver_authenticated(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Every Alertmanager webhook receiver presents credentials from a Secret."""
    props = args.props
    if _kind(props)[1] != "AlertmanagerConfig" or not _kind(props)[0].startswith("monitoring.coreos.com/"):
        return
    for receiver in (props.get("spec") or {}).get("receivers") or []:
        for i, hook in enumerate(receiver.get("webhookConfigs") or []):
            http = hook.get("httpConfig") or {}
            auth = http.get("authorization") or {}
            ok = (
                bool((auth.get("credentials") or {}).get("name"))
                or bool(http.get("bearerTokenSecret"))
                or bool(((http.get("basicAuth") or {}).get("password") or {}).get("name"))
                or bool(http.get("oauth2"))
            )
            if not ok:
                report(
                    f"AlertmanagerConfig '{_name(props)}' receiver '{receiver.get('name')}' webhook {i} sends alerts "
                    "without credentials. Anyone who can reach the remediator could then make it drain nodes. "
                    "Fix: set httpConfig.authorization "
                    "{type: Bearer, credentials: {name: <token Secret>, key: token}}.",
                    None,
                )


@functools.lru_cache(maxsize=4)
def _remediator_yaml(text: str) -> Any:
    """remediator.yaml parsed once per evaluation, not once per rule (with 25,000 nodes listed it is ~1 MB),
    with libyaml where PyYAML has it; None when it is not YAML (the remediator refuses it too; here it
    counts as no shared store). Read only: the result is shared."""
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except yaml.YAMLError:
        return None


def _remediators(args: StackValidationArgs) -> list[tuple[Any, str, int, Mapping[str, Any]]]:
    """(resource, namespace, replicas, parsed remediator.yaml) of every remediator Deployment in the stack.

    The config is the remediator.yaml of the ConfigMaps its pods mount ({} when none is in the stack).
    """
    config_maps = {
        (str((r.props.get("metadata") or {}).get("namespace", "")), _name(r.props)): r.props
        for r in args.resources
        if _kind(r.props) == ("v1", "ConfigMap")
    }
    out = []
    for r in args.resources:
        if _kind(r.props) != ("apps/v1", "Deployment") or _labels(r.props).get(COMPONENT_LABEL) != "remediator":
            continue
        ns = str((r.props.get("metadata") or {}).get("namespace", ""))
        spec = r.props.get("spec") or {}
        pod = (spec.get("template") or {}).get("spec") or {}
        replicas = spec.get("replicas", 1)  # Kubernetes' default when it is left out
        if isinstance(replicas, bool) or not isinstance(replicas, int | float):
            continue  # not known yet (a preview): `up` checks it
        cfg: Mapping[str, Any] = {}
        for volume in pod.get("volumes") or []:
            cm = config_maps.get((ns, str((volume.get("configMap") or {}).get("name"))))
            text = ((cm or {}).get("data") or {}).get("remediator.yaml")
            doc = _remediator_yaml(text) if isinstance(text, str) else None
            if isinstance(doc, Mapping):
                cfg = doc
        out.append((r, ns, int(replicas), cfg))
    return out


def _shared_store(cfg: Mapping[str, Any]) -> bool:
    """The remediator keeps its incidents in PostgreSQL (store.url_file), not in SQLite on its pod's volume."""
    return bool((cfg.get("store") or {}).get("url_file"))


REMEDIATOR_FIX_STORE = (
    "set fleetheal:remediatorStore to postgres (the URI in the Secret fleetheal:remediatorStoreSecret names) or "
    "postgres-in-cluster (with fleetheal:remediatorDbPassword set as a secret)"
)


def validate_remediator_replicas_shared_store(args: StackValidationArgs, report: ReportViolation) -> None:
    """More than one remediator replica only with a PostgreSQL store and leader election."""
    for r, _ns, replicas, cfg in _remediators(args):
        if replicas <= 1:
            continue
        if not _shared_store(cfg):
            problem = "on the embedded SQLite store (its config sets no store.url_file)"
        elif (cfg.get("leader_election") or {}).get("enabled") is not True:
            problem = "without leader election (its config does not set leader_election.enabled: true)"
        else:
            continue
        report(
            f"Deployment '{_name(r.props)}' runs {replicas} remediator replicas {problem}. SQLite cannot be shared "
            "between pods, and replicas that do not elect a leader each act on every alert: one fault drained, "
            f"requeued and replaced twice. Fix: {REMEDIATOR_FIX_STORE}, which also turns on leader election; "
            "or set fleetheal:remediatorReplicas to 1.",
            r.urn,
        )


def validate_production_remediator_shared_store(args: StackValidationArgs, report: ReportViolation) -> None:
    """A production remediator keeps its incidents in PostgreSQL, not on one pod's volume."""
    production = _production_namespaces(args)
    for r, ns, _replicas, cfg in _remediators(args):
        if ns in production and not _shared_store(cfg):
            report(
                f"Deployment '{_name(r.props)}' runs in production ({PRODUCTION_MARK.format(ns=ns)}) with its "
                "incident store in SQLite on one pod's volume (its config sets no store.url_file). When that node "
                "fails, remediation stops until the pod and its ReadWriteOnce volume are back (a volume on a lost "
                "node may never be), and SQLite lets no second replica take over. "
                f"Fix: {REMEDIATOR_FIX_STORE}, and fleetheal:remediatorReplicas to 2 or more.",
                r.urn,
            )


PRODUCTION_SCHEMA = PolicyConfigSchema(
    properties={
        "productionMinReplicas": {
            "type": "integer",
            "minimum": 2,
            "default": 2,
            "description": "Remediator replicas a production stack runs, at least.",
        },
    }
)


def validate_production_remediator_replicas(args: StackValidationArgs, report: ReportViolation) -> None:
    """A production remediator runs at least productionMinReplicas replicas."""
    need = int(_cfg(args, PRODUCTION_SCHEMA)["productionMinReplicas"])
    production = _production_namespaces(args)
    for r, ns, replicas, _config in _remediators(args):
        if ns in production and replicas < need:
            report(
                f"Deployment '{_name(r.props)}' runs {replicas} remediator replica(s) in production "
                f"({PRODUCTION_MARK.format(ns=ns)}); it needs at least {need} (productionMinReplicas). With fewer, "
                "losing or draining one node stops remediation: no GPU fault is handled until the pod is back. "
                f"Fix: set fleetheal:remediatorReplicas to {need} or more (with "
                "fleetheal:remediatorStore postgres or postgres-in-cluster); the replicas run on different nodes.",
                r.urn,
            )
