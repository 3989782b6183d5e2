"""Fixtures shared by every test area."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The Pulumi tests run gRPC servers in this process (the Automation API's language host), and gRPC's
# event engine then takes part in every fork: now and then (3 in 1,000 pexpect spawns, measured) the child
# aborts when the spawn closes its descriptors, before it can exec, and an ansible-runner run of a later
# test fails with rc None ("epoll_wait error: Bad file descriptor" in its stdout). None in 2,000 with
# gRPC's fork support off. The remediator never loads gRPC; only this test session does.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

REPO = Path(__file__).resolve().parent.parent
#: The project's shared folder (schemas, reference data, fixtures) sits beside the clone.
SHARED = Path(os.environ.get("FLEETHEAL_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "fixtures").is_dir():
        pytest.fail(f"shared folder not found at {SHARED} (set FLEETHEAL_SHARED)")
    return SHARED


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
