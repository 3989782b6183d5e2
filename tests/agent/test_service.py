"""The agent's wiring, in process: detections -> state -> metrics, fast path and health file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from fleetheal.agent.check import OK, UNHEALTHY_EXIT, run_check
from fleetheal.agent.client import TrainingReporter
from fleetheal.agent.config import load_config
from fleetheal.agent.fastpath import JobOwners, SlurmDrainer
from fleetheal.agent.service import Agent
from fleetheal.agent.simulated import SimulatedGpuBackend, inject, pci_bus_id

from .test_fastpath import FakeSlurm


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup(tmp_path):
    def make(mode="act", **env):
        base = {
            "FLEETHEAL_AGENT_NODE": "n1",
            "FLEETHEAL_AGENT_MODE": mode,
            "FLEETHEAL_AGENT_METRICS__PORT": "0",
            "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
            "FLEETHEAL_AGENT_TRAINING__ENABLED": "false",
            "FLEETHEAL_AGENT_BACKEND__KIND": "simulated",
            "FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE": str(tmp_path / "sim.json"),
            "FLEETHEAL_AGENT_HEALTH_FILE": str(tmp_path / "health"),
            "FLEETHEAL_AGENT_TRAINING__HANG_TIMEOUT_S": "60",
        }
        base.update(env)
        cfg = load_config(None, env=base)
        clock = Clock()
        fake = FakeSlurm()
        backend = SimulatedGpuBackend(cfg.backend.simulated.state_file, 8, clock=clock, poll_slice_s=0.005)
        drainer = SlurmDrainer("n1", run=fake, dry_run=cfg.observe_only)
        agent = Agent(cfg, backend, drainer=drainer, clock=clock)
        agent.open_backend()
        return agent, fake, clock

    return make


def _value(agent, name, **labels):
    if name == "fleetheal_agent_fault_active":
        labels.setdefault("job_id", "")  # a fault of the node or its GPUs names no job
        labels.setdefault("job_run", "")
    return agent.metrics.registry.get_sample_value(name, labels)


def _drain_queue(agent):
    while not agent.actions.empty():
        item = agent.actions.get_nowait()
        if item is not None:
            agent._act(item)


XID79 = {"node": "n1", "gpu": "3", "fault_id": "xid-79", "class": "hardware", "action": "ISOLATE_AND_RELOCATE"}
XID79["severity"] = "critical"


def test_xid_79_event_drains_with_an_owned_reason_and_sets_metrics(setup, tmp_path):
    agent, fake, clock = setup()
    agent.poll_once()
    assert (tmp_path / "health").read_text() == "ok\n"
    inject(agent.backend.state_file, "xid-79", gpu=3, at=clock.t)
    for ev in agent.backend.wait_events(0.2):
        agent.detect(agent._event_detection(ev))
    _drain_queue(agent)
    ((_, node, state, reason),) = fake.updates
    assert (node, state) == ("nodename=n1", "state=drain")
    assert reason.startswith("reason=fleetheal:xid-79 incident=agent-n1-")
    assert " gpu=3 at=2027-01-15T08:00:00Z" in reason
    assert _value(agent, "fleetheal_agent_fault_active", **XID79) == 1
    assert _value(agent, "fleetheal_agent_faults_total", fault_id="xid-79", **{"class": "hardware"}) == 1
    assert (
        _value(agent, "fleetheal_agent_last_fault_timestamp_seconds", fault_id="xid-79", **{"class": "hardware"})
        == clock.t
    )
    assert _value(agent, "fleetheal_agent_health_state", node="n1", gpu="3") == 2
    assert _value(agent, "fleetheal_agent_health_state", node="n1", gpu="node") == 2
    assert _value(agent, "fleetheal_agent_fastpath_actions_total", action="drain", result="done") == 1
    assert (tmp_path / "health").read_text() == "xid-79\n"

    # The GPU is lost too: the polled condition joins after debounce, and the node is already ours.
    agent.poll_once()
    agent.poll_once()
    assert ("3", "gpu-lost") in {(a.gpu, a.fault.id) for a in agent.tracker.active()}
    _drain_queue(agent)
    assert _value(agent, "fleetheal_agent_fastpath_actions_total", action="drain", result="already") == 1
    assert len(fake.updates) == 1


def test_xid_31_is_reported_and_drains_nothing(setup, tmp_path):
    agent, fake, clock = setup()
    inject(agent.backend.state_file, "xid-31", gpu=1, at=clock.t)
    for ev in agent.backend.wait_events(0.2):
        agent.detect(agent._event_detection(ev))
    _drain_queue(agent)
    assert fake.updates == []
    labels = {"node": "n1", "gpu": "1", "fault_id": "xid-31", "class": "user", "action": "REFUSE_AND_REPORT"}
    assert _value(agent, "fleetheal_agent_fault_active", severity="warning", **labels) == 1
    assert _value(agent, "fleetheal_agent_health_state", node="n1", gpu="1") == 1
    assert (tmp_path / "health").read_text() == "ok\n"


def test_observe_mode_would_drain(setup):
    agent, fake, _clock = setup(mode="observe")
    agent.detect(agent._event_detection(type("E", (), {"fault_id": None, "xid": 48, "gpu": 0, "detail": ""})()))
    _drain_queue(agent)
    assert fake.updates == []
    assert _value(agent, "fleetheal_agent_fastpath_actions_total", action="drain", result="would") == 1


def test_faults_clear_and_the_gauge_goes_to_zero(setup):
    agent, _, clock = setup(FLEETHEAL_AGENT_HEALTH__EVENT_HOLD_S="10")
    inject(agent.backend.state_file, "row-remap-pending", gpu=2, at=clock.t)
    agent.poll_once()
    agent.poll_once()
    labels = {"node": "n1", "gpu": "2", "fault_id": "row-remap-pending", "class": "hardware", "action": "RESET_GPU"}
    assert _value(agent, "fleetheal_agent_fault_active", severity="warning", **labels) == 1
    from fleetheal.agent.simulated import clear

    clear(agent.backend.state_file)
    for _ in range(3):
        clock.t += 1
        agent.poll_once()
    assert _value(agent, "fleetheal_agent_fault_active", severity="warning", **labels) == 0
    assert _value(agent, "fleetheal_agent_health_state", node="n1", gpu="2") == 0


def test_kernel_lines_map_to_gpus_and_unknown_lines_are_counted(setup):
    agent, _fake, _ = setup()
    bus = pci_bus_id(5).removeprefix("0000")  # the kernel writes 0000:1D:00, NVML 00000000:1D:00.0
    agent.kernel_line(
        f"[ 12.3] NVRM: Xid (PCI:{bus[:-2].lower()}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    )
    assert ("5", "xid-79") in {(a.gpu, a.fault.id) for a in agent.tracker.active()}
    agent.kernel_line("NVRM: Xid (PCI:0000:1d:00): garbage, not a code")
    agent.kernel_line("systemd[1]: Started Session 4.")
    agent.kernel_line("NVRM: GPU 0000:1d:00.0: _kfoo: an engine failed in a way no rule knows")
    unknown = {"source": "kernel_log", "rule": "unknown-nvrm"}
    assert _value(agent, "fleetheal_agent_log_lines_unknown_total", **unknown) == 2
    assert "unknown" not in {a.fault.id for a in agent.tracker.active()}, "counted and logged, never an alert"
    agent.kernel_line("NVRM: Xid (PCI:0000:1d:00): 201, pid=1, name=x, a code from a future driver")
    assert _value(agent, "fleetheal_agent_log_lines_unknown_total", source="kernel_log", rule="nvrm-xid") == 1
    assert ("5", "unknown") in {(a.gpu, a.fault.id) for a in agent.tracker.active()}, "an Xid is always raised"
    agent.kernel_line("NVRM: Xid (PCI:0000:99:00): 48, pid=1, name=x, DBE")  # a bus no GPU has
    assert ("00000000:99:00.0", "xid-48") in {(a.gpu, a.fault.id) for a in agent.tracker.active()}


def test_a_process_named_after_a_fault_cannot_make_the_agent_drain(setup):
    """A local user names a process "NCCL timeout" or "EDAC MC0: 1 UE" and crashes it: the kernel prints the
    name, and the agent (kernel rules only) raises nothing."""
    agent, _fake, _ = setup()
    for comm in ("NCCL timeout", "EDAC MC0: 1 UE", "Link is Down", "loss nan", "XID 79 A"):
        agent.kernel_line(f"[ 12.3] {comm}[4242]: segfault at 0 ip 00007f00deadbeef sp 00007ffc00000000 error 4")
    assert agent.tracker.active() == []


def test_training_reports_hang_suspect_and_malformed(setup):
    agent, fake, clock = setup()
    agent.training_report(b"{broken", 0)
    agent.training_report(json.dumps({"job": "77", "rank": 0, "step": "x"}).encode(), 0)
    assert _value(agent, "fleetheal_agent_read_errors_total", source="training") == 2
    for rank in range(4):
        agent.training_report(
            json.dumps({"job": "77", "rank": rank, "step": 10 if rank != 1 else 9, "gpu": rank}).encode(), 0
        )
    assert _value(agent, "fleetheal_agent_training_step", node="n1", job="77", rank="1") == 9
    clock.t += 61
    agent.poll_once()
    assert _value(agent, "fleetheal_agent_training_hang_suspect", node="n1", job="77", rank="1") == 1
    (hang,) = [a for a in agent.tracker.active() if a.fault.id == "job-hang"]
    assert hang.gpu == "1"
    _drain_queue(agent)
    assert fake.updates == []  # job-hang is RESTART_IN_PLACE: the remediator's, not the fast path's


def test_gpu_count_low(setup):
    agent, _, clock = setup(FLEETHEAL_AGENT_BACKEND__EXPECTED_GPUS="8")
    inject(agent.backend.state_file, "gpu-count-low", gpu=7, at=clock.t)
    agent.poll_once()
    agent.poll_once()
    assert ("node", "gpu-count-low") in {(a.gpu, a.fault.id) for a in agent.tracker.active()}
    assert _value(agent, "fleetheal_agent_gpu_count", node="n1") == 7


def test_check_healthy_then_unhealthy_and_drains(setup, capsys):
    agent, fake, _clock = setup()
    cfg = agent.cfg
    assert run_check(cfg, SimulatedGpuBackend(cfg.backend.simulated.state_file, 8), SlurmDrainer("n1", run=fake)) == OK
    assert "healthy: n1, 8 GPUs" in capsys.readouterr().out
    inject(cfg.backend.simulated.state_file, "xid-31", gpu=2)
    assert run_check(cfg, SimulatedGpuBackend(cfg.backend.simulated.state_file, 8), SlurmDrainer("n1", run=fake)) == OK
    assert "warn xid-31 gpu=2" in capsys.readouterr().out
    inject(cfg.backend.simulated.state_file, "xid-79", gpu=3)
    code = run_check(cfg, SimulatedGpuBackend(cfg.backend.simulated.state_file, 8), SlurmDrainer("n1", run=fake))
    out = capsys.readouterr().out
    assert code == UNHEALTHY_EXIT
    assert "FAIL xid-79 gpu=3" in out
    assert "unhealthy: n1" in out
    assert fake.updates and fake.updates[0][-1].startswith("reason=fleetheal:")


def test_a_training_socket_that_cannot_bind_is_counted_not_fatal(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the socket's directory should be")
    env = {
        "FLEETHEAL_AGENT_NODE": "n1",
        "FLEETHEAL_AGENT_METRICS__PORT": "0",
        "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
        "FLEETHEAL_AGENT_FASTPATH__SLURM__ENABLED": "false",
        "FLEETHEAL_AGENT_BACKEND__KIND": "simulated",
        "FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE": str(tmp_path / "sim.json"),
        "FLEETHEAL_AGENT_TRAINING__SOCKET": str(blocker / "training.sock"),
    }
    agent = Agent(load_config(None, env=env))
    agent.start()
    try:
        agent.poll_once()
        assert _value(agent, "fleetheal_agent_read_errors_total", source="training") == 1
        assert _value(agent, "fleetheal_agent_polls_total") == 1
        assert _value(agent, "fleetheal_agent_log_source_up", source="training") == 0  # FleethealAgentLogSourceDown
    finally:
        agent.shutdown()


def test_a_kernel_log_the_agent_cannot_read_is_exported_as_a_source_down(tmp_path):
    """The blind spot alert FleethealAgentLogSourceDown reads this: a kernel log that cannot be opened (here a
    directory) is 0; the same agent reading a real file is 1."""
    (tmp_path / "kern.log").write_text("")
    (tmp_path / "a-directory").mkdir()
    for path, up in ((tmp_path / "a-directory", 0), (tmp_path / "kern.log", 1)):
        env = {
            "FLEETHEAL_AGENT_NODE": "n1",
            "FLEETHEAL_AGENT_METRICS__PORT": "0",
            "FLEETHEAL_AGENT_KERNEL_LOG__PATH": str(path),
            "FLEETHEAL_AGENT_KERNEL_LOG__POSITION_FILE": "",
            "FLEETHEAL_AGENT_TRAINING__ENABLED": "false",
            "FLEETHEAL_AGENT_FASTPATH__SLURM__ENABLED": "false",
            "FLEETHEAL_AGENT_BACKEND__KIND": "simulated",
            "FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE": str(tmp_path / "sim.json"),
        }
        agent = Agent(load_config(None, env=env))
        agent.start()
        try:
            assert _value(agent, "fleetheal_agent_log_source_up", source="kernel_log") == up, path
        finally:
            agent.shutdown()


def test_the_training_socket_is_writable_by_every_user_from_the_moment_it_appears(tmp_path, monkeypatch):
    """CI saw it: a job (here the test's `nobody` sender) found the socket bound but not yet made writable
    and got EACCES. The socket takes its public name only once its mode is set."""
    from fleetheal.agent import sources

    path = tmp_path / "training.sock"
    seen: list[bool] = []
    real_chmod = os.chmod

    def chmod(target, mode, *args, **kwargs):
        seen.append(path.exists())  # a job could already send here, before the mode is set
        return real_chmod(target, mode, *args, **kwargs)

    monkeypatch.setattr(sources.os, "chmod", chmod)
    server = sources.TrainingReportServer(str(path), lambda data, uid: None, lambda text: None)
    server.bind()
    try:
        assert seen == [False]
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o666
        assert [p.name for p in tmp_path.iterdir()] == ["training.sock"]
    finally:
        server.sock.close()
    (tmp_path / "training.sock").unlink()
    # A directory another user can write (not sticky) is refused: the socket there could be swapped for a link.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="other users can write its directory"):
        sources.TrainingReportServer(str(shared / "t.sock"), lambda data, uid: None, lambda text: None).bind()
    shared.chmod(0o775)  # group-writable, for root's own group (a umask of 002): fine
    group = sources.TrainingReportServer(str(shared / "t.sock"), lambda data, uid: None, lambda text: None)
    group.bind()
    group.sock.close()
    (shared / "t.sock").unlink()
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else can replace this process's files
    sticky = sources.TrainingReportServer(str(shared / "t.sock"), lambda data, uid: None, lambda text: None)
    sticky.bind()
    sticky.sock.close()
    (tmp_path / "training.sock").write_text("an operator's file")
    with pytest.raises(OSError, match="not a socket"):
        sources.TrainingReportServer(str(path), lambda data, uid: None, lambda text: None).bind()
    assert path.read_text() == "an operator's file"


def _socket_agent(tmp_path, job_owners=None, **env):
    """An agent with its real training socket in a directory every user can reach."""
    run_dir = Path(tempfile.mkdtemp(prefix="fleetheal-sock-"))
    run_dir.chmod(0o755)
    base = {
        "FLEETHEAL_AGENT_NODE": "n1",
        "FLEETHEAL_AGENT_POLL_INTERVAL_S": "0.001",
        "FLEETHEAL_AGENT_METRICS__PORT": "0",
        "FLEETHEAL_AGENT_KERNEL_LOG__ENABLED": "false",
        "FLEETHEAL_AGENT_FASTPATH__SLURM__ENABLED": "false",
        "FLEETHEAL_AGENT_BACKEND__KIND": "simulated",
        "FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE": str(tmp_path / "sim.json"),
        "FLEETHEAL_AGENT_TRAINING__SOCKET": str(run_dir / "training.sock"),
        **env,
    }
    agent = Agent(load_config(None, env=base), job_owners=job_owners)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    sock = run_dir / "training.sock"
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sock.exists(), "the agent never opened its training socket"
    return agent, thread, sock, run_dir


def test_a_flood_of_reports_for_new_jobs_does_not_stop_the_agent(tmp_path):
    """Found by hand: about a second of reports for new job names killed `fleetheal agent run` ("dictionary
    changed size during iteration": the polling loop read the jobs without the lock), the socket went with
    it, and the memory and metrics grew with every name."""
    agent, thread, sock, run_dir = _socket_agent(tmp_path)
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        deadline, i = time.monotonic() + 1.5, 0
        while time.monotonic() < deadline:
            c.sendto(json.dumps({"job": f"flood-{i}", "rank": 0, "step": 1}).encode(), str(sock))
            i += 1
        c.sendto(json.dumps({"job": "flood-0", "rank": 0, "step": 2}).encode(), str(sock))  # the agent still reads
        deadline = time.monotonic() + 60
        while _value(agent, "fleetheal_agent_training_step", node="n1", job="flood-0", rank="0") != 2:
            assert time.monotonic() < deadline, "the agent stopped reading its socket"
            time.sleep(0.01)
        assert thread.is_alive() and sock.exists()
        assert len(agent.training.jobs) == agent.cfg.training.max_jobs
        refused = _value(agent, "fleetheal_agent_read_errors_total", source="training")
        assert refused == i - agent.cfg.training.max_jobs  # every name past the limit, and nothing else
    finally:
        agent.stop()
        thread.join(10)
        shutil.rmtree(run_dir, ignore_errors=True)


def _send_as(uid: int, path: Path, report: dict) -> None:
    """Send one report from a child process running as `uid` (the test runs as root)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(json.dumps(report).encode(), str(path))
            code = 0
        except BaseException as exc:
            os.write(write_end, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as why:
        error = why.read()
    assert os.waitpid(pid, 0)[1] == 0, f"uid {uid} could not send: {error}"


class FakeSqueue:
    """`squeue -h -j JOB -w NODE ... -o %U` for a cluster where job 4242 of uid 1000 runs on n1."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        job, node = argv[argv.index("-j") + 1], argv[argv.index("-w") + 1]
        out = "1000\n" if (job, node) == ("4242", "n1") else ""
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_a_local_user_cannot_raise_a_fault_for_someone_elses_job(tmp_path):
    """Found by hand: any local user could report a NaN loss for an invented job, or for anyone's job, and
    have every job on the node requeued. The kernel tells the agent who sent each report."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: sending as other users needs root")
    squeue = FakeSqueue()
    owners = JobOwners("n1", "squeue", run=squeue)
    agent, thread, sock, run_dir = _socket_agent(tmp_path, job_owners=owners)
    nan = {"rank": 0, "step": 5, "loss": "nan", "gpu": 0}

    def refused() -> float:
        return _value(agent, "fleetheal_agent_read_errors_total", source="training") or 0

    def faults() -> set[tuple[str, str]]:
        return {(a.fault.id, a.job) for a in agent.tracker.active()}

    try:
        _send_as(65534, sock, {**nan, "job": "4242"})  # someone else's job
        _send_as(65534, sock, {**nan, "job": "local"})  # no Slurm job at all
        _send_as(1000, sock, {**nan, "job": "7"})  # a job that does not run here
        deadline = time.monotonic() + 60
        while refused() < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert faults() == set()
        _send_as(1000, sock, {**nan, "job": "4242"})  # the owner
        deadline = time.monotonic() + 60
        while faults() != {("nan-loss", "4242")}:
            assert time.monotonic() < deadline, faults()
            time.sleep(0.01)
        _send_as(0, sock, {**nan, "job": "4243", "gpu": 1})  # root speaks for any job
        deadline = time.monotonic() + 60
        while ("nan-loss", "4243") not in faults():
            assert time.monotonic() < deadline, faults()
            time.sleep(0.01)
        assert refused() == 3
        assert len(squeue.calls) == 2  # 4242 (then cached) and 7; "local" and root's report ask nothing
    finally:
        agent.stop()
        thread.join(10)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_the_agent_logs_the_one_json_schema(setup):
    """Every fleetheal service writes fleetheal.logs' lines: time, level, logger, msg, then the fields."""
    import io
    import logging

    from fleetheal.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    setup_logging("info", stream)
    try:
        agent, _, clock = setup()
        inject(agent.backend.state_file, "xid-79", gpu=3, at=clock.t)
        agent.wait_events(0)
        logging.getLogger("fleetheal.remediator").info("remediator listening", extra={"url": "http://x"})
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    raised = next(d for d in lines if d["msg"] == "fault raised" and d["fault_id"] == "xid-79")
    assert list(raised)[:4] == ["time", "level", "logger", "msg"]
    assert raised["level"] == "warning" and raised["logger"] == "fleetheal.agent"
    assert raised["time"].endswith("+00:00") and raised["gpu"] == "3" and raised["node"] == "n1"
    remediator = lines[-1]
    assert list(remediator)[:4] == ["time", "level", "logger", "msg"] and remediator["url"] == "http://x"


def _line(job: str, text: str, run: int | None = None, requeues: int | None = None) -> bytes:
    doc: dict[str, object] = {"v": 1, "job": job, "event": "line", "line": text}
    if run is not None:
        doc["run"] = run
    if requeues is not None:
        doc["requeues"] = requeues
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "text",
    [
        "XID 79 GPU has fallen off the bus",
        "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.",
        "ERROR_GPU_IS_LOST",
    ],
)
def test_a_job_printing_a_node_fault_drains_nothing(setup, tmp_path, text):
    """A job's words never move its node: no drain, no health-file verdict for Slurm's health check; the
    job alone is told (REFUSE_AND_REPORT for its claim)."""
    agent, fake, _clock = setup()
    agent.poll_once()
    agent.training_report(_line("4242", text), 0)
    _drain_queue(agent)
    assert fake.updates == []
    assert (tmp_path / "health").read_text() == "ok\n"
    assert {(a.fault.id, a.job, a.source) for a in agent.tracker.active()} <= {
        ("job-output-node-claim", "4242", "job_output")
    }
    assert _value(agent, "fleetheal_agent_fastpath_actions_total", action="drain", result="done") is None


def test_job_output_faults_name_the_job_and_a_second_oom_is_repeated(setup, tmp_path):
    agent, fake, clock = setup()
    agent.training_report(_line("4242", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)"), 0)
    labels = {"node": "n1", "gpu": "node", "fault_id": "nccl-timeout", "class": "transient"}
    labels |= {"action": "RESTART_IN_PLACE", "severity": "warning", "job_id": "4242"}
    assert _value(agent, "fleetheal_agent_fault_active", **labels) == 1
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    agent.training_report(_line("4242", oom, run=0), 0)
    clock.t += 5
    agent.training_report(_line("4242", oom, run=1), 0)
    active = {(a.fault.id, a.job) for a in agent.tracker.active()}
    assert {("cuda-oom", "4242"), ("cuda-oom-repeated", "4242")} <= active
    _drain_queue(agent)
    assert fake.updates == [] and (tmp_path / "health").read_text() == "ok\n"


def test_each_run_of_a_job_raises_its_own_fault_and_repeats_of_one_run_fold(setup):
    """A job restarted in place after its NCCL timeout prints another one minutes later: that is a new fault
    (a new series, so a new alert and a new restart), while the same run's ranks printing it again are one.
    A requeue (Slurm's restart count) starts a new run too, even where the launcher's own count starts over."""
    agent, fake, clock = setup()
    nccl = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)"
    labels = {"node": "n1", "gpu": "node", "fault_id": "nccl-timeout", "class": "transient"}
    labels |= {"action": "RESTART_IN_PLACE", "severity": "warning", "job_id": "4242"}
    agent.training_report(_line("4242", nccl, run=0, requeues=0), 0)
    clock.t += 60  # past the dedup window: a repeat of run 0.0, not a new fault
    agent.training_report(_line("4242", nccl, run=0, requeues=0), 0)
    clock.t += 60  # restarted in place (the launcher's count), well inside the 10-minute hold of the first
    agent.training_report(_line("4242", nccl, run=1, requeues=0), 0)
    clock.t += 60  # requeued by Slurm: the launcher counts from 0 again
    agent.training_report(_line("4242", nccl, run=0, requeues=1), 0)
    for run in ("0.0", "0.1", "1.0"):
        assert _value(agent, "fleetheal_agent_fault_active", job_run=run, **labels) == 1, run
    assert _value(agent, "fleetheal_agent_faults_total", fault_id="nccl-timeout", **{"class": "transient"}) == 4
    first = next(a for a in agent.tracker.active() if a.run == "0.0")
    assert first.occurrences == 2
    _drain_queue(agent)
    assert fake.updates == []


def test_a_job_counting_up_its_run_on_every_line_gets_a_bounded_number_of_series(setup):
    """The run is a number the job's own process sends: a job sending a new one with every line would make the
    agent export a series, and Alertmanager send an alert, per line. At most MAX_RUNS_PER_JOB runs of one job
    hold faults at once; the rest are refused and counted. When its faults clear, its series go with them."""
    from fleetheal.agent.health import MAX_RUNS_PER_JOB

    agent, _fake, clock = setup()
    nccl = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)"
    for run in range(1000):
        agent.training_report(_line("4242", nccl, run=run, requeues=0), 0)
        clock.t += 0.1  # within the judge's rate limit (50 lines a second)
    active = [a for a in agent.tracker.active() if a.job == "4242"]
    assert len({a.run for a in active}) == MAX_RUNS_PER_JOB
    assert _value(agent, "fleetheal_agent_read_errors_total", source="job_output") == 1000 - MAX_RUNS_PER_JOB
    agent.training_report(_line("4243", nccl, run=0, requeues=0), 0)  # another job is not held by it
    assert any(a.job == "4243" for a in agent.tracker.active())
    clock.t += 3600
    agent.poll_once()  # the hold is over: the faults clear and the job's series are gone
    text = generate_latest(agent.metrics.registry).decode()
    assert 'job_id="4242"' not in text and not agent.tracker.active()


def test_a_job_output_line_must_name_a_slurm_job(setup):
    agent, _fake, _clock = setup()
    agent.training_report(_line("local", "CUDA out of memory"), 0)  # would reach every job of the node
    assert agent.tracker.active() == []
    assert _value(agent, "fleetheal_agent_read_errors_total", source="job_output") == 1


def test_a_million_error_lines_keep_the_agent_cheap(setup):
    agent, fake, _clock = setup()
    data = _line("4242", "XID 79 GPU has fallen off the bus")
    started = time.process_time()
    for _ in range(1_000_000):
        agent.training_report(data, 0)
    took = time.process_time() - started
    _drain_queue(agent)
    assert fake.updates == []
    assert len(agent.tracker.active()) == 1
    assert took < 30, f"{took:.1f} s of CPU for a million datagrams"  # the socket's cost, not the rules'


def test_a_users_flood_of_refused_reports_neither_floods_the_log_nor_drowns_anothers_reports(tmp_path):
    """Issue 46: a local user sending refused reports as fast as it can (for a job that is not theirs) wrote a
    WARNING for each (116 MB in 22 s) and crowded another user's reports out of the socket's queue (65 of 100
    dropped). Refusals are counted, logged a few a minute, and a sender's report waits a moment for room."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: sending as other users needs root")
    owners = JobOwners("n1", "squeue", run=FakeSqueue())
    agent, thread, sock, run_dir = _socket_agent(tmp_path, job_owners=owners)
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logging.getLogger("fleetheal.agent").addHandler(handler)
    stop_flood = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the flooding child, as uid 65534
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            flood = json.dumps({"job": "4242", "rank": 0, "step": 1}).encode()
            os.set_blocking(stop_flood[0], False)
            while True:
                for _ in range(1000):
                    with contextlib.suppress(OSError):
                        s.sendto(flood, str(sock))
                with contextlib.suppress(BlockingIOError):
                    if os.read(stop_flood[0], 1):
                        break
        finally:
            os._exit(0)
    try:
        time.sleep(1.0)  # the flood is on
        reporter = TrainingReporter("4243", 0, gpu=0, socket_path=str(sock), min_interval_s=0, env={})
        for step in range(1, 101):
            reporter.report(step)
            time.sleep(0.005)
        os.write(stop_flood[1], b"x")
        os.waitpid(pid, 0)
        deadline = time.monotonic() + 30
        reporter.report(101)  # the flood is over: this one goes at once
        while _value(agent, "fleetheal_agent_training_step", node="n1", job="4243", rank="0") != 101:
            assert time.monotonic() < deadline, f"the agent never read the last report ({reporter.dropped} dropped)"
            time.sleep(0.01)
        refused = _value(agent, "fleetheal_agent_read_errors_total", source="training")
        # Before: 92 of 100 dropped here. A report waits at most SEND_WAIT_S, so a flood may still win a few (0 in
        # most runs; the sender and the agent share this process and its lock, unlike on a node).
        assert reporter.dropped <= 15, f"{reporter.dropped} of 100 reports dropped ({refused:.0f} refused)"
        assert refused > 1000
        assert len(warnings) <= 20, f"{len(warnings)} warnings logged for {refused:.0f} refused reports"
    finally:
        logging.getLogger("fleetheal.agent").removeHandler(handler)
        with contextlib.suppress(OSError):
            os.write(stop_flood[1], b"x")
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        agent.stop()
        thread.join(10)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_job_that_left_the_node_is_forgotten_when_its_prolog_file_goes(setup, tmp_path):
    """Issue 46: a job that crashed or was cancelled (no `end` report) stayed in the 64-job table for
    training.job_expiry_s, an hour. The epilog removes its prolog file when it leaves the node: then it goes."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    agent, _, _ = setup(FLEETHEAL_AGENT_TRAINING__JOB_OWNERS_DIR=str(jobs))
    (jobs / "4242").write_text("job_id=4242\nuid=0\n")
    for job in ("4242", "4243"):  # 4243 never had a file (no prolog here): it stays until it expires
        agent.training_report(json.dumps({"job": job, "rank": 0, "step": 1}).encode(), 0)
    agent.poll_once()
    assert set(agent.training.jobs) == {"4242", "4243"}
    (jobs / "4242").unlink()  # the epilog
    agent.poll_once()
    assert set(agent.training.jobs) == {"4243"}
    assert _value(agent, "fleetheal_agent_training_step", node="n1", job="4242", rank="0") is None
