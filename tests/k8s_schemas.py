"""Validate Kubernetes objects against the real upstream schemas in ../shared/schemas/ (recipe in
../shared/schemas/README.md): CRD openAPIV3Schemas with unknown fields forbidden and Go's mid-pattern
`(?i)` handled, and the Kubernetes 1.37 strict JSON schemas through a referencing registry. Slinky
NodeSet/LoginSet/Controller fields the CRD leaves open (`x-kubernetes-preserve-unknown-fields`) are
checked as the core types they are (PodSpec, Container).

Used by tests/infra and tests/policies through the session-scoped `k8s_schemas` fixture.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = Path(os.environ.get("FLEETHEAL_SHARED", REPO_ROOT.parent / "shared")) / "schemas"
K8S_DIR = SCHEMAS / "kubernetes" / "v1.37.0-local-strict"
DEFS_URL = "https://kubernetes.io/api/_definitions.json"
CRD_DIRS = ("slinky/crds", "prometheus-operator", "kueue")

#: Open (preserve-unknown-fields) Slinky fields and the core type each really is.
SLINKY_EMBEDDED = {
    "NodeSet": {
        ("spec", "slurmd"): "io.k8s.api.core.v1.Container",
        ("spec", "template", "spec"): "io.k8s.api.core.v1.PodSpec",
    },
    "LoginSet": {
        ("spec", "login"): "io.k8s.api.core.v1.Container",
        ("spec", "template", "spec"): "io.k8s.api.core.v1.PodSpec",
    },
    "Controller": {("spec", "template", "spec"): "io.k8s.api.core.v1.PodSpec"},
    "Accounting": {("spec", "template", "spec"): "io.k8s.api.core.v1.PodSpec"},
    "RestApi": {("spec", "template", "spec"): "io.k8s.api.core.v1.PodSpec"},
}


class _Loader(yaml.CSafeLoader):
    pass


# PyYAML cannot load the AlertmanagerConfig CRD otherwise (a bare `=` enum value).
_Loader.add_constructor("tag:yaml.org,2002:value", yaml.SafeLoader.construct_yaml_str)


def _go_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    flags = 0
    if "(?i)" in pattern:
        pattern = pattern.replace("(?i)", "")
        flags = re.IGNORECASE
    if not re.search(pattern, instance, flags):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_CrdValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _go_pattern})


def _forbid_unknown(node: Any) -> None:
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for v in node.values():
            _forbid_unknown(v)
    elif isinstance(node, list):
        for v in node:
            _forbid_unknown(v)


class SchemaSet:
    """All schemas, loaded once."""

    def __init__(self, root: Path = SCHEMAS) -> None:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is missing: the shared schemas must sit beside the repository (../shared)")
        self.crd_schemas: dict[tuple[str, str], dict[str, Any]] = {}
        self.crd_docs: dict[str, dict[str, Any]] = {}
        for sub in CRD_DIRS:
            for path in sorted((root / sub).glob("*.yaml")):
                doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
                self.crd_docs[doc["metadata"]["name"]] = doc
                for v in doc["spec"]["versions"]:
                    schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
                    _forbid_unknown(schema)
                    key = (f"{doc['spec']['group']}/{v['name']}", doc["spec"]["names"]["kind"])
                    self.crd_schemas[key] = schema
        defs = json.loads((K8S_DIR / "_definitions.json").read_text(encoding="utf-8"))
        self.registry: referencing.Registry[Any] = referencing.Resource.from_contents(defs) @ referencing.Registry()
        self._k8s: dict[str, jsonschema.protocols.Validator] = {}
        self._crd_validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}

    # -- Kubernetes core kinds -------------------------------------------------------------------

    def _k8s_validator(self, filename: str) -> jsonschema.protocols.Validator:
        if filename not in self._k8s:
            schema = json.loads((K8S_DIR / filename).read_text(encoding="utf-8"))
            self._k8s[filename] = jsonschema.Draft202012Validator(schema, registry=self.registry)
        return self._k8s[filename]

    def definition_validator(self, definition: str) -> jsonschema.protocols.Validator:
        key = f"#def:{definition}"
        if key not in self._k8s:
            self._k8s[key] = jsonschema.Draft202012Validator(
                {"$ref": f"{DEFS_URL}#/$defs/{definition}"}, registry=self.registry
            )
        return self._k8s[key]

    @staticmethod
    def k8s_file(api_version: str, kind: str) -> str:
        group, _, version = api_version.rpartition("/")
        prefix = f"-{group.split('.')[0]}" if group else ""
        return f"{kind.lower()}{prefix}-{version}.json"

    def errors(self, obj: dict[str, Any]) -> list[str]:
        """Every schema violation of one object, as 'path: message' strings (empty: valid)."""
        api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        out: list[str] = []
        if (api_version, kind) in self.crd_schemas:
            key = (api_version, kind)
            if key not in self._crd_validators:
                self._crd_validators[key] = _CrdValidator(self.crd_schemas[key])
            out += [
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in self._crd_validators[key].iter_errors(obj)
            ]
            for path, definition in SLINKY_EMBEDDED.get(kind, {}).items() if api_version.startswith("slinky.") else ():
                node: Any = obj
                for part in path:
                    node = node.get(part) if isinstance(node, dict) else None
                if node is not None:
                    out += [
                        f"{'/'.join(path)}/{'/'.join(map(str, e.absolute_path))}: {e.message}"
                        for e in self.definition_validator(definition).iter_errors(node)
                    ]
            return out
        filename = self.k8s_file(api_version, kind)
        if (K8S_DIR / filename).exists():
            validator = self._k8s_validator(filename)
        else:  # a kind with no file of its own (ValidatingAdmissionPolicy): its strict definition
            group, _, version = api_version.rpartition("/")
            definition = f"io.k8s.api.{group.split('.')[0] or 'core'}.{version}.{kind}"
            if definition not in self.registry.contents(DEFS_URL).get("$defs", {}):
                return [f"no schema for {api_version} {kind} (looked for {filename}, {definition} and the CRDs)"]
            validator = self.definition_validator(definition)
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
