"""Fixtures shared by every test area."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
