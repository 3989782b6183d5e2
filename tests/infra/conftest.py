"""Fixtures for the Pulumi program tests: the real schemas (loaded once) and the example stack."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fleetheal.infra import config, mocks, project, stack_model
from tests.k8s_schemas import SchemaSet


@pytest.fixture(scope="session")
def k8s_schemas() -> SchemaSet:
    return SchemaSet()


@pytest.fixture(scope="session")
def dev_values() -> dict[str, Any]:
    return project.stack_values("dev")


@pytest.fixture
def dev_config(dev_values: dict[str, Any]) -> stack_model.StackConfig:
    return config.from_values(dev_values)


@pytest.fixture
def run_mocked() -> Callable[[Callable[[], Any]], list[mocks.Recorded]]:
    """Run a program under a fresh set of Pulumi mocks (set_mocks is global: one set per test)."""

    def _run(program: Callable[[], Any]) -> list[mocks.Recorded]:
        return mocks.run(program)

    return _run
