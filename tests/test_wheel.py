"""The fleetheal wheel works installed, away from the checkout: built from a clean copy of the sources,
installed into a fresh virtualenv, `fleetheal remediator serve` answers /healthz from a temporary working
directory and the remediator's default playbook directory is the wheel's own copy of playbooks/ (roles,
collection and filter plugins included).

The fresh virtualenv gets the wheel alone (`pip install --no-deps --no-index`, offline); its dependencies
come from the project's virtualenv through a `.pth` file naming that site-packages directory. Python adds
such a directory to sys.path without reading the `.pth` files inside it, so the checkout's editable
install of fleetheal stays invisible and `import fleetheal` finds the wheel's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: What the build reads: the package and the folders its links point into (faults.yaml, playbooks/, roles/).
SOURCES = ("pyproject.toml", "README.md", "fleetheal", "policies", "playbooks", "roles")
TOKEN = "wheel-test-token-0123456789"
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check")


def _copy_sources(dest: Path) -> None:
    """The tracked layout without build leftovers (a stale build/ would ship files no longer in the tree)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "venv", ".venv")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    _copy_sources(src)
    subprocess.run(
        [
            *PIP,
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(dist),
            str(src),
        ],
        check=True,
        timeout=120,
    )
    (built,) = dist.glob("fleetheal-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    python = root / "bin" / "python"
    subprocess.run(
        [*PIP, "--python", str(python), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=120,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "fleetheal-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLEETHEAL_", "ANSIBLE_"))}
    return {**env, "FLEETHEAL_REMEDIATOR_TOKEN": TOKEN}


def test_the_wheel_carries_the_playbooks_and_their_roles(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "playbooks").rglob("*"):
        rel = path.relative_to(REPO / "playbooks")
        if path.is_file() and "__pycache__" not in rel.parts:
            assert f"fleetheal/playbooks/{rel.as_posix()}" in names
    # playbooks/roles links to ../roles: the wheel holds a copy of every role under it
    for role in (REPO / "roles").iterdir():
        if (role / "tasks" / "main.yml").is_file():
            assert f"fleetheal/playbooks/roles/{role.name}/tasks/main.yml" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    # the other links into policies/: the taxonomy, the log rules and the policy pack's rules (a package)
    rules = {f"fleetheal/infra/policy/{p.name}" for p in (REPO / "policies" / "rules").glob("*.py")}
    assert {"fleetheal/faults.yaml", "fleetheal/log-rules.yaml", "fleetheal/infra/policy/__init__.py"} <= names
    assert rules <= names


def test_the_installed_remediator_finds_its_playbooks(venv: Path, tmp_path: Path) -> None:
    probe = (
        "import json, fleetheal, fleetheal.taxonomy as t\n"
        "from fleetheal.remediator.config import RunnerConfig\n"
        "from fleetheal.remediator.runner import AnsibleRunner\n"
        "cfg = RunnerConfig()\n"
        "runner = AnsibleRunner(cfg)\n"
        "paths = sorted({str(runner.playbook_path(a.playbook)) for a in t.load().actions.values()})\n"
        "print(json.dumps({'package': fleetheal.__file__, 'dir': cfg.playbook_dir, 'playbooks': paths}))\n"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        cwd=tmp_path,
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = json.loads(out.stdout)
    playbooks = Path(found["dir"])
    assert Path(found["package"]).is_relative_to(venv), found["package"]
    assert playbooks.is_relative_to(venv) and playbooks.name == "playbooks", playbooks
    assert found["playbooks"] and all(Path(p).parent == playbooks.resolve() for p in found["playbooks"])
    # Every playbook parses with its roles, collection modules and task files, where the wheel put them.
    ansible = Path(sys.executable).parent / "ansible-playbook"
    check = subprocess.run(
        [str(ansible), "--syntax-check", "-i", "localhost,", *found["playbooks"]],
        cwd=playbooks,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_installed_remediator_serves_from_a_temporary_directory(venv: Path, tmp_path: Path) -> None:
    config = tmp_path / "remediator.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "cluster": {"name": "wheel", "nodes": {"gpu-000": "rack-0"}},
                "listen": {"host": "127.0.0.1", "port": 0},
                "store": {"path": str(tmp_path / "remediator.sqlite"), "synchronous": "NORMAL"},
                "runner": {"run_dir": str(tmp_path / "runs")},
            }
        )
    )
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(venv / "bin" / "fleetheal"), "remediator", "serve", "--config", str(config)],
            cwd=tmp_path,
            env=_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            for line in log.read_text().splitlines():
                if line.startswith("{") and json.loads(line).get("msg") == "remediator listening":
                    url = json.loads(line)["url"]
            time.sleep(0.1)
        assert url is not None, f"no 'remediator listening' (exit {proc.poll()}):\n{log.read_text()}"
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:  # loopback only
            assert resp.status == 200
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
    assert proc.returncode == 0, log.read_text()
