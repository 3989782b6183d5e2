"""The stdlib training client: what it sends, and that it never raises into a training loop."""

from __future__ import annotations

import ast
import json
import socket
from pathlib import Path

import pytest

from fleetheal.agent import client
from fleetheal.agent.client import TrainingReporter
from fleetheal.agent.training import parse_report


@pytest.fixture
def server(tmp_path):
    path = str(tmp_path / "t.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(1.0)
    yield path, s
    s.close()


def test_reports_are_valid_protocol_and_rate_limited(server):
    path, s = server
    r = TrainingReporter(job="99", rank=2, gpu=5, socket_path=path, min_interval_s=60)
    assert r.report(10, step_time=0.5, loss=1.25)
    assert not r.report(11, step_time=0.5, loss=1.2)  # inside min_interval_s
    assert r.report(12, loss=float("nan"))  # NaN always goes
    first, second = parse_report(s.recv(4096)), parse_report(s.recv(4096))
    assert (first.job, first.rank, first.step, first.step_time, first.loss, first.gpu) == ("99", 2, 10, 0.5, 1.25, 5)
    assert second.step == 12
    assert str(second.loss) == "nan"
    r.end()
    assert parse_report(s.recv(4096)).end
    assert r.sent == 3


def test_environment_defaults(server):
    path, s = server
    env = {
        "SLURM_JOB_ID": "4242",
        "RANK": "9",
        "LOCAL_RANK": "1",
        "CUDA_VISIBLE_DEVICES": "4,6",
        "FLEETHEAL_TRAINING_SOCKET": path,
    }
    r = TrainingReporter(env=env, min_interval_s=0)
    assert (r.job, r.rank, r.gpu, r.socket_path) == ("4242", 9, 6, path)
    r.report(1)
    assert json.loads(s.recv(4096)) == {"v": 1, "job": "4242", "rank": 9, "step": 1, "gpu": 6}
    assert TrainingReporter(env={"CUDA_VISIBLE_DEVICES": "GPU-abc", "LOCAL_RANK": "0"}).gpu is None
    assert TrainingReporter(env={}).gpu is None


def test_no_agent_never_raises(tmp_path):
    r = TrainingReporter(job="j", rank=0, socket_path=str(tmp_path / "nobody-home.sock"), min_interval_s=0)
    for step in range(5):
        assert r.report(step, loss=1.0) is False
    r.end()
    assert r.dropped == 6
    r.close()
    assert r.report(6) is False  # closed: still no exception


def test_bad_arguments_never_raise(server):
    path, _ = server
    r = TrainingReporter(job="j", rank=0, socket_path=path, min_interval_s=0)
    assert r.report("not a step") is False  # type: ignore[arg-type]
    assert r.dropped == 1


def test_client_uses_only_the_standard_library():
    tree = ast.parse(Path(client.__file__).read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= {"__future__", "json", "math", "os", "select", "socket", "time", "collections"}


def test_the_example_training_script_reports_a_nan(server):
    import subprocess
    import sys

    path, s = server
    script = Path(__file__).resolve().parents[2] / "agent" / "examples" / "train_with_fleetheal.py"
    env = {"FLEETHEAL_TRAINING_SOCKET": path, "SLURM_JOB_ID": "123", "SLURM_PROCID": "4", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "5", "--step-time", "0", "--nan-at", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "dropped" in done.stdout
    reports = []
    s.settimeout(0.5)
    try:
        while True:
            reports.append(parse_report(s.recv(4096)))
    except TimeoutError:
        pass
    assert {(r.job, r.rank) for r in reports} == {("123", 4)}
    assert any(r.step == 3 and r.loss is not None and r.loss != r.loss for r in reports)
    assert reports[-1].end
