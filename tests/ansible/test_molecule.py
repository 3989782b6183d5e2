"""Every Molecule scenario under molecule/, run as `molecule test` (converge, idempotence, verify).

Needs the podman image from `molecule/image/build.sh` and the wheelhouse from
`molecule/image/wheelhouse.sh` (the Makefile prepares both); a missing one fails the test with the
command to run. The remediation scenario starts a real Slurm on this machine instead of a container.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from fleetheal.lab.slurm import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (REPO / "molecule").glob("*/molecule.yml"))
IMAGE = os.environ.get("FLEETHEAL_MOLECULE_IMAGE", "localhost/fleetheal-molecule:bookworm")
WHEELHOUSE = Path(os.environ.get("FLEETHEAL_WHEELHOUSE", "/var/cache/fleetheal/wheels"))
#: Scenarios that run on this machine (localhost), without a container.
LOCAL = {"remediation"}
#: State directory of the remediation scenario's Slurm (molecule/remediation/prepare.yml).
REMEDIATION_SLURM = Path("/tmp/fleetheal-molecule-remediation/slurm")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fleetheal's wheel, built once for every scenario: converge and idempotence then install the same
    bytes even while the shared checkout changes under them."""
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, SOURCE_DATE_EPOCH="315532800")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--quiet",
        "-w",
        str(out),
        str(REPO),
    ]
    subprocess.run(cmd, check=True, env=env, timeout=300)
    (built,) = out.glob("fleetheal-*.whl")
    return built


def _environment() -> dict[str, str]:
    import ansible_collections

    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    # Galaxy is unreachable: the collections are the ones the `ansible` package installed.
    env["ANSIBLE_COLLECTIONS_PATH"] = str(Path(next(iter(ansible_collections.__path__))).parent)
    env["ANSIBLE_NOCOLOR"] = "1"
    env["ANSIBLE_FORCE_COLOR"] = "0"
    env["NO_COLOR"] = "1"
    env["PY_COLORS"] = "0"
    return env


def test_every_role_has_a_scenario() -> None:
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks" / "main.yml").exists())
    assert roles == ["dcgm", "gpu_health_agent", "node_validation", "remediator", "slurm_node_health"]
    assert set(roles) <= set(SCENARIOS)
    for name in SCENARIOS:
        verify = (REPO / "molecule" / name / "verify.yml").read_text()
        assert "that: true" not in verify.replace("'", "").replace('"', "")
        assert "assert" in verify or "failed_when" in verify, f"molecule/{name}/verify.yml checks nothing"


#: Scenarios run side by side, this many at a time: one alone kept about one of the two cores busy (Ansible
#: waiting on `podman exec`, 0.3-0.6 s each); two at a time, all six passed in 956 s.
PARALLEL = 2


@pytest.fixture(scope="module")
def machine_wide() -> Iterator[None]:
    """The scenarios' containers and the remediation scenario's Slurm have fixed names on this machine:
    a second test session (two CI runs on one runner) waits for the first instead of colliding with it."""
    path = Path(tempfile.gettempdir()) / "fleetheal-molecule.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # never through a symlink
    with os.fdopen(fd, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _missing() -> str | None:
    """What the container scenarios need and this machine lacks, as the command that provides it."""
    if shutil.which("podman") is None:
        return "podman is not installed (Debian package podman, with runc)"
    if subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode != 0:
        return f"podman image {IMAGE} is missing: run molecule/image/build.sh"
    if not (WHEELHOUSE / ".pins").exists():
        return f"wheelhouse {WHEELHOUSE} is empty: run molecule/image/wheelhouse.sh"
    return None


def _molecule_test(scenario: str, wheel: Path, state: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [str(Path(sys.executable).parent / "molecule"), "-c", "molecule/shared/base.yml", "test", "-s", scenario],
            cwd=REPO,
            # Molecule keys its state (created, prepared, ...) by the checkout's folder name alone, so every
            # clone called "main" shares it, and a state left "prepared" by an earlier run makes it skip
            # prepare (the remediation scenario then finds no Slurm). Each run gets its own.
            env=dict(_environment(), FLEETHEAL_WHEEL=str(wheel), MOLECULE_EPHEMERAL_DIRECTORY=str(state)),
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    finally:
        # The scenario's cleanup stops its Slurm; this catches a Molecule that died or timed out first.
        if scenario == "remediation" and (REMEDIATION_SLURM / "cluster.json").exists():
            SlurmCluster.attach(REMEDIATION_SLURM).stop()


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory, machine_wide: None
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The `molecule test` of every scenario this session selected (`-k` may pick some), started at once
    PARALLEL at a time; each test waits for its own."""
    selected = {
        item.callspec.params["scenario"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_scenario" and hasattr(item, "callspec")
    }
    missing = _missing()
    todo = [s for s in SCENARIOS if s in selected and (s in LOCAL or missing is None)]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {s: pool.submit(_molecule_test, s, wheel, tmp_path_factory.mktemp(f"molecule-{s}")) for s in todo}
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()


@pytest.mark.molecule
@pytest.mark.timeout(3000)  # above the scenario's own 900 s limit, waited behind the others (and another session)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario: str, runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    if scenario not in runs:
        pytest.fail(_missing() or f"scenario {scenario} did not start")
    proc = runs[scenario].result()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Skipping, instances already prepared" not in out, "prepare was skipped on stale Molecule state"
    for step in ("converge", "idempotence", "verify"):
        assert f"{step}: Executed: Successful" in out, f"{step} did not run:\n{out[-3000:]}"
