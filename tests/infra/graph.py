"""Helpers over the resources a mocked Pulumi run recorded."""

from __future__ import annotations

from typing import Any

from fleetheal.infra import mocks
from tests.k8s_schemas import SchemaSet


def objects(records: list[mocks.Recorded]) -> list[dict[str, Any]]:
    return [r.inputs for r in records if r.is_kubernetes_object and r.type != mocks.HELM_RELEASE]


def assert_all_valid(schemas: SchemaSet, records: list[mocks.Recorded]) -> int:
    """Every emitted Kubernetes object validates against its real schema; returns how many were checked."""
    checked = 0
    failures = []
    for obj in objects(records):
        errs = schemas.errors(obj)
        if errs:
            failures.append(f"{obj['kind']} {obj['metadata'].get('name')}: {errs[:3]}")
        checked += 1
    assert not failures, "\n".join(failures)
    return checked


def by_kind(records: list[mocks.Recorded], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects(records) if o["kind"] == kind]
