"""Run the fleetheal program without the Pulumi CLI: Pulumi's own mock engine, recording every
resource registration. `fleetheal render`, the tests and the benchmark use it.

`RecordingMocks` is a test double of the Pulumi engine (pulumi.runtime.Mocks): like the engine with a
provider plugin, it answers each registration with an id and the inputs echoed back as outputs. It
does not talk to Kubernetes, so what it records is exactly what the program asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi

SECRET_SIG = "4dabf18193072939515e22adb298388d"  # noqa: S105 - Pulumi's secret marker, not a secret
#: Type tokens that are Kubernetes objects but not plain objects to render (Helm releases hold values).
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"


@dataclass(frozen=True, slots=True)
class Recorded:
    """One resource registration: type token, logical name, inputs (secrets unwrapped, integral
    floats turned back into ints) and whether any input was secret."""

    type: str
    name: str
    inputs: dict[str, Any]
    custom: bool
    secret_paths: tuple[str, ...] = ()

    @property
    def is_kubernetes_object(self) -> bool:
        return self.type.startswith("kubernetes:") and "apiVersion" in self.inputs and "kind" in self.inputs

    @property
    def is_patch(self) -> bool:
        return self.type.endswith("Patch")


def clean(value: Any, path: str = "", secrets: list[str] | None = None) -> Any:
    """Unwrap mock secrets ({sig: ..., value: v}) and turn integral floats (how mocks return every
    number) back into ints, so objects read like the manifests a person would write."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == "1b47061264138c4ac30d75fd1eb44270" and "value" in value:
            if secrets is not None:
                secrets.append(path)
            return clean(value["value"], path, secrets)
        return {k: clean(v, f"{path}.{k}" if path else k, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v, f"{path}[{i}]", secrets) for i, v in enumerate(value)]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass
class RecordingMocks(pulumi.runtime.Mocks):
    """Answers registrations like a provider would and keeps them, in order."""

    records: list[Recorded] = field(default_factory=list)

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[Any, Any]]:
        secrets: list[str] = []
        inputs = clean(dict(args.inputs), "", secrets)
        self.records.append(Recorded(args.typ, args.name, inputs, bool(args.custom), tuple(secrets)))
        return f"{args.name}-id", dict(args.inputs)

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[Any, Any], list[tuple[str, str]] | None]:
        return {}, None


def run(
    program: Callable[[], Any],
    project: str = "fleetheal",
    stack: str = "dev",
    recorder: RecordingMocks | None = None,
) -> list[Recorded]:
    """Run `program` (which registers resources) under fresh mocks (or `recorder`); return the records.

    Raises whatever the program raises (a ConfigError or ComponentArgError before any registration).
    """
    mocks = recorder if recorder is not None else RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=False)

    @pulumi.runtime.test  # type: ignore[untyped-decorator]
    def _body() -> Any:
        program()
        return None

    _body()
    return mocks.records
