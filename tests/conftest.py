"""Fixtures shared by every test area."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetheal.lab.controlplane import KubeControlPlane, default_crds, tools_built, tools_dir
from fleetheal.lab.federation import Federation
from fleetheal.lab.postgres import Postgres, PostgresError
from fleetheal.lab.slurm import Release, SlurmError, find_tool

# The Pulumi tests run gRPC servers in this process (the Automation API's language host), and gRPC's
# event engine then takes part in every fork: now and then (3 in 1,000 pexpect spawns, measured) the child
# aborts when the spawn closes its descriptors, before it can exec, and an ansible-runner run of a later
# test fails with rc None ("epoll_wait error: Bad file descriptor" in its stdout). None in 2,000 with
# gRPC's fork support off. The remediator never loads gRPC; only this test session does.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

REPO = Path(__file__).resolve().parent.parent
#: The project's shared folder (schemas, reference data, fixtures) sits beside the clone.
SHARED = Path(os.environ.get("FLEETHEAL_SHARED", REPO.parent / "shared"))


def pytest_report_header() -> str:
    """Which Slurm the Slurm-facing tests run: the first on PATH (`make unit`/`integration`: 26.05 from
    scripts/slurm-tree.sh; `make compat`: Debian's 22.05)."""
    try:
        release = Release.of(find_tool("slurmctld"))
    except SlurmError as exc:
        return f"slurm: none ({exc})"
    return f"slurm: {release.name} (root {release.root})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes the real control plane (`kube`, built by `make tools`) carries the `kube` marker,
    so `make unit` (-m "not (kube or ...)") leaves it to `make integration` whether or not it is marked.
    One that takes the shared Slurm `federation` carries `federation` and `slurm`, so `-m federation`
    selects every test that needs it; one that takes the playbook tests' `slurm` cluster carries `slurm`, so
    `make compat` (-m "slurm or federation") runs every Slurm-facing test on 22.05 as well."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name, marks in (("kube", ("kube",)), ("federation", ("federation", "slurm")), ("slurm", ("slurm",))):
            defs = info.name2fixturedefs.get(name, ()) if info is not None else ()
            if defs and Path(inspect.getfile(defs[-1].func)).name == "conftest.py":  # not a test's own fake
                for mark in marks:
                    item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture(autouse=True)
def _main_thread_event_loop() -> None:
    """Pulumi's mocks (`@pulumi.runtime.test`, fleetheal.infra.mocks) run on the main thread's current event
    loop, and `asyncio.run` (the remediator's service in the remediator and fleet tests) leaves none behind:
    every Pulumi test after such a test failed with "There is no current event loop". Each test starts with
    one, so the tests pass in any order."""
    policy = asyncio.get_event_loop_policy()
    try:
        loop = policy.get_event_loop()
    except RuntimeError:
        loop = None
    if loop is None or loop.is_closed():
        policy.set_event_loop(policy.new_event_loop())


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "fixtures").is_dir():
        pytest.fail(f"shared folder not found at {SHARED} (set FLEETHEAL_SHARED)")
    return SHARED


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Iterator[KubeControlPlane]:
    """One real control plane for the session (etcd, kube-apiserver, kube-controller-manager built by
    `make tools`) with the Slinky, Kueue and prometheus-operator CRDs; tests make their own objects."""
    if not tools_built():
        pytest.fail(
            f"etcd, kube-apiserver and kube-controller-manager are not built in {tools_dir()}: run `make tools` "
            "(scripts/build-tools.sh kubernetes)"
        )
    with KubeControlPlane(tmp_path_factory.mktemp("kube")) as cp:
        cp.install_crds(default_crds(shared))
        yield cp


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """One real PostgreSQL for the session (Debian's package, on loopback, in a temporary directory that
    the `postgres` user can reach when the tests run as root); tests take a database each (`pg_url`)."""
    base = tempfile.mkdtemp(prefix="fleetheal-pg-")
    server: Postgres | None = None
    try:
        try:
            server = Postgres(base)
            server.start()
        except PostgresError as exc:
            pytest.fail(str(exc))
        yield server
    finally:
        if server is not None:
            server.drop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: Postgres) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL (dropped after the test, connections and all)."""
    import psycopg
    from psycopg import sql

    name = f"test_{uuid.uuid4().hex[:16]}"
    admin = postgres_server.url(database="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield postgres_server.url(database=name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def federation() -> Iterator[Federation]:
    """One real Slurm federation for the session (fleetheal.lab.federation: clusters a, b, c with nodes
    a1,a2,b1,b2,c1,c2, 8 fake GPUs each, types h100/h100/a100; slurmdbd and MariaDB on loopback), stopped
    at the end. Tests share it, so each must leave it as found: cancel its jobs (`-M all`), undo cluster
    features and QOS limits, `rejoin` what it `drop`s."""
    base = tempfile.mkdtemp(prefix="fleetheal-fed-")
    fed = Federation(base)
    try:
        try:
            fed.start()
        except SlurmError as exc:
            pytest.fail(f"the Slurm federation did not start: {exc}")
        yield fed
    finally:
        fed.stop()
        shutil.rmtree(base, ignore_errors=True)
