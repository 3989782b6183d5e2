"""What the rules share: the names fleetheal's parts agree on (labels, kinds, the federation script's
format, the membership entry and pinned-image rules) and readers of a resource's kind, name, labels and
the policy's config. Part of the stand-alone policy pack: no import of the fleetheal package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    PolicyConfigSchema,
    ResourceValidationArgs,
    StackValidationArgs,
)

# The names fleetheal's parts agree on (fleetheal/contracts.py, fleetheal/infra/common.py). The pack runs
# without the fleetheal package, so it carries them; tests/policies/test_pack.py keeps them equal.
K8S_PREFIX = "fleetheal.io/"
LABEL_POOL = K8S_PREFIX + "pool"
LABEL_GPU_POOL = K8S_PREFIX + "gpu-pool"
LABEL_GPU_TYPE = K8S_PREFIX + "gpu-type"
LABEL_MEMBERSHIP = K8S_PREFIX + "membership"
LABEL_ENVIRONMENT = K8S_PREFIX + "environment"
MEMBER_ROLES = ("active", "standby")
#: The pool of nodes lent to Kubernetes workloads, and the taint only Kueue-admitted pods tolerate there.
POOL_LENT = "lent"
TAINT_LENT = K8S_PREFIX + "lent"
PRODUCTION = "production"
#: On a federation member's Controller and Accounting (and the manager's federation ConfigMap): manager or worker.
LABEL_FEDERATION_ROLE = K8S_PREFIX + "federation-role"
#: The manager's ConfigMap holding the federation's `sacctmgr` script (app.kubernetes.io/component).
FEDERATION_COMPONENT = "federation"
FEDERATION_SCRIPT_KEY = "apply.sh"
#: The script's statements, one per line (fleetheal.infra.federation writes them, fleetheal.infra.drift reads them):
#: `cluster NAME FEATURES`, `qos NAME PRIORITY`, `grant ACCOUNT CLUSTER QOS|- DEFAULT_QOS|- [USER...]`,
#: `federation NAME CLUSTER...`.
FEDERATION_VERBS = ("cluster", "qos", "grant", "federation")
#: Slurm ClusterNames in a federation (fleetheal.contracts.CLUSTER_NAME_PATTERN; slurmdbd prefixes its tables
#: with them).
SLURM_CLUSTER_NAME = r"[a-z][a-z0-9-]{0,39}"

GPU = "nvidia.com/gpu"
SLINKY = "slinky.slurm.net/v1beta1"
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
COMPONENT_LABEL = "app.kubernetes.io/component"


def parse_membership_entry(entry: str) -> tuple[str, str]:
    """(role, failure domain) of a membership ConfigMap's value; ValueError names what is wrong."""
    parts = entry.split()
    if len(parts) != 2 or parts[0] not in MEMBER_ROLES:
        raise ValueError(f"{entry[:80]!r} is not '<active|standby> <failure domain>'")
    return parts[0], parts[1]


def image_is_pinned(image: str) -> bool:
    """True for REPO@sha256:DIGEST or REPO:TAG with a tag other than `latest`."""
    if "@sha256:" in image:
        return True
    name, sep, tag = image.rpartition(":")
    return bool(sep and name and tag and "/" not in tag and tag != "latest")


def _kind(props: Mapping[str, Any]) -> tuple[str, str]:
    return str(props.get("apiVersion", "")), str(props.get("kind", ""))


def _name(props: Mapping[str, Any]) -> str:
    return str((props.get("metadata") or {}).get("name", "?"))


def _labels(props: Mapping[str, Any]) -> Mapping[str, str]:
    return (props.get("metadata") or {}).get("labels") or {}


def config_defaults(schema: PolicyConfigSchema | None) -> dict[str, Any]:
    """The defaults a policy's config schema declares (what the engine applies when unset)."""
    if schema is None:
        return {}
    return {k: v["default"] for k, v in schema.properties.items() if "default" in v}


def _cfg(args: ResourceValidationArgs | StackValidationArgs, schema: PolicyConfigSchema) -> dict[str, Any]:
    return {**config_defaults(schema), **dict(args.get_config() or {})}


def _pod_containers(pod_spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])


def _production_namespaces(args: StackValidationArgs) -> set[str]:
    return {
        _name(r.props)
        for r in args.resources
        if _kind(r.props) == ("v1", "Namespace") and _labels(r.props).get(LABEL_ENVIRONMENT) == PRODUCTION
    }


PRODUCTION_MARK = f"Namespace '{{ns}}' is labelled {LABEL_ENVIRONMENT}={PRODUCTION}, from fleetheal:environment"
