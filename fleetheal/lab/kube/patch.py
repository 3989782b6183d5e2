"""The fake API server's wire semantics on objects: merge, strategic-merge and JSON patches; label and
field selectors.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from fleetheal.lab.kube.model import LABEL_NAME_RE, ApiError, Obj, ResourceType

#: Strategic-merge list keys (from the real types' patchMergeKey tags) for the fields the double holds.
_MERGE_KEYS = {
    "metadata.ownerReferences": "uid",
    "status.conditions": "type",
    "status.addresses": "type",
    "spec.containers": "name",
    "spec.initContainers": "name",
    "spec.volumes": "name",
    "spec.containers.ports": "containerPort",
    "spec.containers.env": "name",
}
_SUPPORTED_FIELDS = {
    "Pod": ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"),
    "Node": ("metadata.name", "spec.unschedulable"),
    "Namespace": ("metadata.name", "status.phase"),
    "PodDisruptionBudget": ("metadata.name", "metadata.namespace"),
}


# ---- patches -------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """Kubernetes strategic merge patch for the fields this double holds.

    Maps merge key by key (null deletes; `$patch: replace|delete` directives), lists are replaced except
    those with a patchMergeKey in the real types (_MERGE_KEYS), merged element by element on that key
    (an element `{"$patch": "delete", key: ...}` removes one). `$setElementOrder/` and `$retainKeys`
    directives are accepted and ignored (ordering and retained keys do not change any outcome here).
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = f"{path}.{key}" if path else key
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and sub in _MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, _MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(out.get(key), value, sub)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(current: list[Any], patch: list[Any], key: str, path: str) -> list[Any]:
    out = copy.deepcopy(current)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(400, "BadRequest", f"{path}: element without merge key {key!r}")
        idx = next((i for i, e in enumerate(out) if isinstance(e, dict) and e.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
        elif idx is None:
            out.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
        else:
            out[idx] = strategic_merge_patch(out[idx], item, path)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(400, "BadRequest", f"json patch: bad path {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch: body must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            kind = op["op"]
            parts = _pointer(op["path"])
            if kind == "test":
                if _walk(doc, parts) != op["value"]:
                    raise ApiError(422, "Invalid", f"json patch: test failed at {op['path']}")
                continue
            if kind in ("move", "copy"):
                src = _pointer(op["from"])
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    parent = _walk(doc, src[:-1])
                    del parent[int(src[-1]) if isinstance(parent, list) else src[-1]]
            elif kind in ("add", "replace"):
                value = copy.deepcopy(op["value"])
            elif kind != "remove":
                raise ApiError(400, "BadRequest", f"json patch: unknown op {kind!r}")
            if not parts:
                doc = value
                continue
            parent = _walk(doc, parts[:-1])
            last = parts[-1]
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif kind == "replace":
                    parent[int(last)] = value
                else:
                    parent.insert(int(last), value)
            else:
                if kind == "replace" and last not in parent:
                    raise KeyError(last)
                parent[last] = value
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"json patch: cannot apply {op!r}: {type(exc).__name__} {exc}") from exc
    return doc


# ---- selectors -----------------------------------------------------------------------------------

_SEL_IN = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A Kubernetes label selector string -> predicate on a label map."""
    reqs: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for req in _split_selector(text):
        m = _SEL_IN.match(req)
        if m:
            reqs.append((m.group(1), m.group(2), frozenset(v.strip() for v in m.group(3).split(","))))
        elif "!=" in req:
            k, v = (part.strip() for part in req.split("!=", 1))
            reqs.append((k, "notin", frozenset({v})))
        elif "=" in req:
            k, v = (part.strip() for part in req.replace("==", "=").split("=", 1))
            reqs.append((k, "in", frozenset({v})))
        elif req.startswith("!"):
            reqs.append((req[1:].strip(), "!", frozenset()))
        elif LABEL_NAME_RE.match(req.split("/")[-1]):
            reqs.append((req, "exists", frozenset()))
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {req!r}")

    def matches(labels: dict[str, str]) -> bool:
        for key, op, values in reqs:
            ok = {
                "in": labels.get(key) in values,
                "notin": labels.get(key) not in values,
                "exists": key in labels,
                "!": key not in labels,
            }[op]
            if not ok:
                return False
        return True

    return matches


def match_label_selector(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector object (matchLabels, matchExpressions) against labels; an empty one matches all."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op)
        if not ok:
            return False
    return True


def _field(obj: Obj, path: str) -> str:
    cur: Any = obj
    for p in path.split("."):
        cur = cur.get(p) if isinstance(cur, dict) else None
    if cur is None:
        return "false" if path == "spec.unschedulable" else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_selector(rt: ResourceType, text: str) -> Callable[[Obj], bool]:
    reqs: list[tuple[str, str, bool]] = []  # (field, value, negated)
    for req in _split_selector(text):
        neg = "!=" in req
        k, v = (part.strip() for part in req.replace("==", "=").replace("!=", "=").split("=", 1))
        if k not in _SUPPORTED_FIELDS[rt.kind]:
            raise ApiError(400, "BadRequest", f"field label not supported: {k}")
        reqs.append((k, v, neg))

    def matches(obj: Obj) -> bool:
        return all((_field(obj, k) == v) != neg for k, v, neg in reqs)

    return matches
