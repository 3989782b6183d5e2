"""Rules on what runs on every GPU node: container images pinned, and the fleetheal node agent (its
requests and limits, and its reach over every GPU NodeSet's nodes: selectors and tolerations).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pulumi_policy import (
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    StackValidationArgs,
)

from .shared import (
    GPU,
    SLINKY,
    _cfg,
    _kind,
    _name,
    _pod_containers,
    image_is_pinned,
)


def _images(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, image reference) for every `image` field: strings, and Helm {repository, tag, digest}."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            p = f"{path}.{k}" if path else str(k)
            if k == "image" and isinstance(v, str):
                yield p, v
            elif k == "image" and isinstance(v, Mapping) and "repository" in v:
                if v.get("digest"):
                    yield p, f"{v['repository']}@{v['digest']}"
                else:
                    yield p, f"{v['repository']}:{v.get('tag') or ''}"
            else:
                yield from _images(v, p)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _images(v, f"{path}[{i}]")


def validate_images_pinned(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """Every container image is pinned to a tag other than `latest` or to a digest."""
    for path, image in _images(args.props):
        if not image_is_pinned(image):
            report(
                f"{args.name}: image '{image}' at {path} is not pinned. 'latest' or a missing tag changes under "
                "you: two GPU nodes can run different agents or slurmd builds and a rollback cannot restore the "
                "old one. Fix: use REPOSITORY:TAG with a release tag, or REPOSITORY@sha256:DIGEST.",
                None,
            )


AGENT_SCHEMA = PolicyConfigSchema(
    properties={
        "agentDaemonSet": {
            "type": "string",
            "default": "fleetheal-agent",
            "description": "Name of the node agent DaemonSet.",
        },
    }
)


def validate_agent_resources(args: ResourceValidationArgs, report: ReportViolation) -> None:
    """The node agent's containers set CPU and memory requests and limits."""
    props = args.props
    cfg = _cfg(args, AGENT_SCHEMA)
    if _kind(props) != ("apps/v1", "DaemonSet") or _name(props) != cfg["agentDaemonSet"]:
        return
    pod = ((props.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in _pod_containers(pod):
        res = c.get("resources") or {}
        missing = [
            f"{kind}.{r}"
            for kind in ("requests", "limits")
            for r in ("cpu", "memory")
            if not (res.get(kind) or {}).get(r)
        ]
        if missing:
            report(
                f"DaemonSet '{_name(props)}' container '{c.get('name')}' has no {', '.join(missing)}. The agent "
                "runs on every GPU node next to training jobs: without requests it is evicted first under "
                "pressure (and stops detecting faults), without limits a leak starves the job. "
                "Fix: set resources.requests and resources.limits for cpu and memory.",
                None,
            )


def _selector_matches(term: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for expr in term.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), list(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op in ("Gt", "Lt"):
            return False  # never true for the label sets compared here; be conservative
    return True


def pod_selects(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a pod spec (nodeSelector + required node affinity) accepts a node with `labels`."""
    for k, v in (pod.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(_selector_matches(t, labels) for t in terms)


def _tolerates(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("operator") == "Exists" and not t.get("key"):
            if not t.get("effect") or t.get("effect") == taint.get("effect"):
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if t.get("effect") and taint.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


def validate_gpu_nodesets_run_agent(args: StackValidationArgs, report: ReportViolation) -> None:
    """Every GPU NodeSet's nodes also run the fleetheal node agent."""
    cfg = _cfg(args, AGENT_SCHEMA)
    agents = [
        r
        for r in args.resources
        if _kind(r.props) == ("apps/v1", "DaemonSet") and _name(r.props) == cfg["agentDaemonSet"]
    ]
    agent_pod = (((agents[0].props.get("spec") or {}).get("template") or {}).get("spec") or {}) if agents else None
    for r in args.resources:
        if _kind(r.props) != (SLINKY, "NodeSet"):
            continue
        spec = r.props.get("spec") or {}
        slurmd_res = (spec.get("slurmd") or {}).get("resources") or {}
        if not ((slurmd_res.get("limits") or {}).get(GPU) or (slurmd_res.get("requests") or {}).get(GPU)):
            continue
        pod = (spec.get("template") or {}).get("spec") or {}
        node_labels = dict(pod.get("nodeSelector") or {})
        problem = None
        if agent_pod is None:
            problem = f"there is no '{cfg['agentDaemonSet']}' DaemonSet in the stack"
        elif not pod_selects(agent_pod, node_labels):
            problem = f"the agent's node selection does not match the NodeSet's nodeSelector {node_labels}"
        else:
            for tol in pod.get("tolerations") or []:
                taint = {"key": tol.get("key"), "value": tol.get("value"), "effect": tol.get("effect") or "NoSchedule"}
                if tol.get("key") and not _tolerates(list(agent_pod.get("tolerations") or []), taint):
                    problem = f"the agent does not tolerate the taint '{tol.get('key')}' the NodeSet tolerates"
                    break
        if problem:
            report(
                f"NodeSet '{_name(r.props)}' runs slurmd on GPU nodes without the fleetheal agent: {problem}. "
                "A GPU fault on those nodes would go undetected, so the node is never drained and jobs keep "
                "landing on it. Fix: make the agent DaemonSet's node affinity cover the NodeSet's nodeSelector "
                "and tolerate its taints (fleetheal.infra.agent.node_affinity).",
                r.urn,
            )
