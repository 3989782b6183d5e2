"""awaitReadiness: declared in Pulumi.yaml, checked in config.py; false registers the skipAwait transform.

The transform is exercised here as a function (Pulumi's mock engine does not call transforms);
tests/infra/test_engine.py checks its effect on the objects in a real cluster.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pytest
from pulumi.runtime import rpc

from fleetheal.infra import config, program, project


def _values(**over: Any) -> dict[str, Any]:
    return {**project.stack_values("dev"), **over}


def _transform(type_: str, props: dict[str, Any], custom: bool = True) -> pulumi.ResourceTransformResult | None:
    opts = pulumi.ResourceOptions()
    result = program.skip_await(pulumi.ResourceTransformArgs(custom, type_, "r", props, opts))
    assert result is None or result.opts is opts
    return result


def test_await_readiness_defaults_to_true_and_takes_booleans() -> None:
    assert project.declarations()["awaitReadiness"].default is True
    assert config.from_values(_values()).await_readiness is True
    assert config.from_values(_values(awaitReadiness="false")).await_readiness is False
    assert config.from_values(_values(awaitReadiness=False)).await_readiness is False
    with pytest.raises(config.ConfigError, match="fleetheal:awaitReadiness: expected true or false, got 'no'"):
        config.from_values(_values(awaitReadiness="no"))


def test_skip_await_annotates_kubernetes_objects_and_keeps_their_annotations() -> None:
    props = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "n", "annotations": {"a": "b"}},
        "spec": {"replicas": 1},
    }
    result = _transform("kubernetes:apps/v1:Deployment", props)
    assert result is not None
    assert result.props["metadata"] == {
        "name": "d",
        "namespace": "n",
        "annotations": {"a": "b", program.SKIP_AWAIT: "true"},
    }
    assert result.props["spec"] == {"replicas": 1}
    assert props["metadata"]["annotations"] == {"a": "b"}  # the input is not modified

    no_metadata = _transform("kubernetes:core/v1:NodePatch", {"spec": {}})
    assert no_metadata is not None
    assert no_metadata.props["metadata"] == {"annotations": {program.SKIP_AWAIT: "true"}}


def test_skip_await_keeps_secret_metadata_secret() -> None:
    result = _transform("kubernetes:core/v1:Secret", {"metadata": rpc.wrap_rpc_secret({"name": "s"})})
    assert result is not None
    assert rpc.is_rpc_secret(result.props["metadata"])
    assert rpc.unwrap_rpc_secret(result.props["metadata"]) == {
        "name": "s",
        "annotations": {program.SKIP_AWAIT: "true"},
    }


def test_skip_await_leaves_everything_else_alone() -> None:
    assert _transform("kubernetes:helm.sh/v3:Release", {"chart": "c"}) is None
    assert _transform("aws:eks/nodeGroup:NodeGroup", {"labels": {}}) is None
    assert _transform("fleetheal:infra:Remediator", {}, custom=False) is None
    # a preview before the metadata is known: `up` sees the resolved value and annotates it
    assert _transform("kubernetes:core/v1:ConfigMap", {"metadata": pulumi.output.Unknown()}) is None
