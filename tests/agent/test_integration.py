"""The agent against a real slurmctld + slurmd (Slurm 26.05 under `make unit`, 22.05 under `make compat`), with
the simulated GPU backend.

The agent runs as its own process (`python -m fleetheal agent run`), exactly as systemd starts it; faults
go in through `fleetheal.agent.simulated.inject`, the kernel log file and the training socket, and the
outcome is read where an operator would read it: `scontrol show node` and the /metrics endpoint.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from fleetheal.agent.simulated import inject, pci_bus_id
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.procs import free_ports

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def _need_slurm() -> None:
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "munged", "unshare") if not shutil.which(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"SKIPPED LOUDLY: needs root and Debian's Slurm packages (missing: {missing or 'root'})")


def _metrics(port: int) -> dict[str, float]:
    """Scrape /metrics into {'name{labels}': value} (labels sorted as prometheus_client prints them)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _series(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    for key, value in metrics.items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
        if key == name and not labels:
            return value
    return None


@pytest.fixture
def cluster(tmp_path):
    _need_slurm()
    c = SlurmCluster(tmp_path / "slurm", nodes=2, gpus_per_node=8)
    c.start()
    try:
        yield c
    finally:
        c.stop(graceful=False)


@pytest.fixture
def agent(cluster, tmp_path):
    port = free_ports()[0]
    cfg = {
        "node": "n1",
        "poll_interval_s": 0.5,
        "health_file": str(tmp_path / "health"),
        "backend": {"kind": "simulated", "simulated": {"gpus": 8, "state_file": str(tmp_path / "sim.json")}},
        "metrics": {"listen": "127.0.0.1", "port": port},
        "kernel_log": {"path": str(tmp_path / "kern.log"), "position_file": str(tmp_path / "kern.pos")},
        "training": {"socket": str(tmp_path / "training.sock")},
        "fastpath": {"slurm": {"slurm_conf": str(cluster.conf_path)}},
    }
    (tmp_path / "kern.log").write_text("")
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetheal", "agent", "run", "--config", str(path)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        cluster.wait_for("agent metrics endpoint", lambda: _can_scrape(port), timeout=20)
        yield {"proc": proc, "port": port, "tmp": tmp_path, "log": tmp_path / "agent.log"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _can_scrape(port: int) -> bool:
    try:
        _metrics(port)
        return True
    except OSError:
        return False


def test_xid_79_drains_xid_31_does_not_and_bad_input_is_counted(cluster, agent):
    port, tmp = agent["port"], agent["tmp"]
    state = tmp / "sim.json"

    # Xid 31 (an application's MMU fault): visible in the metrics, and the node keeps running jobs.
    inject(state, "xid-31", gpu=1)
    cluster.wait_for(
        "xid-31 in metrics",
        lambda: _series(_metrics(port), "fleetheal_agent_fault_active", fault_id="xid-31", gpu="1") == 1,
        timeout=60,
    )
    time.sleep(1.0)  # the fast path would have acted by now
    assert not cluster.node("n1").drained
    m = _metrics(port)
    assert _series(m, "fleetheal_agent_faults_total", fault_id="xid-31") == 1
    assert _series(m, "fleetheal_agent_fastpath_actions_total", action="drain") is None

    # Xid 79 on GPU 3: n1 (and only n1) drained with an owned reason naming the fault and GPU.
    inject(state, "xid-79", gpu=3)
    cluster.wait_for("n1 drained", lambda: cluster.node("n1").drained, timeout=60)
    reason = cluster.node("n1").reason
    assert reason is not None
    assert reason.startswith("fleetheal:xid-79 incident=agent-n1-")
    assert " gpu=3 at=" in reason
    assert not cluster.node("n2").drained
    # the drain is counted once the agent has checked the fleet budget again after it (TIE_WAIT_S)
    cluster.wait_for(
        "the drain counted",
        lambda: _series(_metrics(port), "fleetheal_agent_fastpath_actions_total", action="drain", result="done") == 1,
        timeout=60,
    )
    m = _metrics(port)
    assert _series(m, "fleetheal_agent_fault_active", fault_id="xid-79", gpu="3", action="ISOLATE_AND_RELOCATE") == 1
    assert _series(m, "fleetheal_agent_faults_total", fault_id="xid-79", **{"class": "hardware"}) == 1
    assert _series(m, "fleetheal_agent_fastpath_actions_total", action="drain", result="done") == 1
    assert _series(m, "fleetheal_agent_health_state", gpu="node") == 2
    assert (tmp / "health").read_text().strip() in ("xid-79", "gpu-lost")

    # A garbled kernel line (no rule knows it) and a malformed training report are counted; the agent keeps
    # going.
    with open(tmp / "kern.log", "ab") as fh:
        fh.write(b"\xff\xfe\x00 NVRM: Xid (PCI:0000:1a:00): ##garbled##\n")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b'{"job": "1", "rank": "zero"', str(tmp / "training.sock"))
    cluster.wait_for(
        "read errors counted",
        lambda: (
            (_series(_metrics(port), "fleetheal_agent_log_lines_unknown_total", source="kernel_log") or 0) >= 1
            and (_series(_metrics(port), "fleetheal_agent_read_errors_total", source="training") or 0) >= 1
        ),
        timeout=60,
    )
    # ... and still works: a valid kernel Xid line and a valid report after the bad ones are processed.
    bus = pci_bus_id(5)[4:-2].lower()
    with open(tmp / "kern.log", "a") as fh:
        fh.write(f"NVRM: Xid (PCI:{bus}): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error\n")
    s.sendto(b'{"v": 1, "job": "42", "rank": 0, "step": 7, "loss": 1.5}', str(tmp / "training.sock"))
    cluster.wait_for(
        "valid input after bad input",
        lambda: (
            _series(_metrics(port), "fleetheal_agent_fault_active", fault_id="xid-48", gpu="5") == 1
            and _series(_metrics(port), "fleetheal_agent_training_step", job="42") == 7
        ),
        timeout=60,
    )
    assert agent["proc"].poll() is None, agent["log"].read_text()[-2000:]


def test_check_as_slurm_health_check_program_drains_only_its_node(tmp_path):
    """slurmd runs `fleetheal agent check` as HealthCheckProgram on every node; an injected Xid 79 on n2
    drains n2 by itself, and an operator's drain of n1 keeps its reason."""
    _need_slurm()
    state_dir = tmp_path / "sim"
    state_dir.mkdir()
    cfg = tmp_path / "agent.yaml"
    hc = tmp_path / "healthcheck.sh"
    slurm_dir = tmp_path / "slurm"
    cfg.write_text(
        yaml.safe_dump(
            {
                "backend": {"kind": "simulated", "simulated": {"gpus": 4}},
                "fastpath": {"slurm": {"slurm_conf": str(slurm_dir / "etc" / "slurm.conf")}},
            }
        )
    )
    hc.write_text(
        "#!/bin/sh\n"
        # slurmd runs the program with a bare PATH: give it the Slurm clients this test runs (26.05 or 22.05).
        f"export PATH={shlex.quote(os.environ['PATH'])}\n"
        f'export FLEETHEAL_AGENT_BACKEND__SIMULATED__STATE_FILE="{state_dir}/$SLURMD_NODENAME.json"\n'
        f'cd {REPO} && exec {sys.executable} -m fleetheal agent check --config {cfg} >>"{tmp_path}/hc-$SLURMD_NODENAME.log" 2>&1\n'
    )
    hc.chmod(0o755)
    extra = [f"HealthCheckProgram={hc}", "HealthCheckInterval=2", "HealthCheckNodeState=ANY"]
    with SlurmCluster(slurm_dir, nodes=2, gpus_per_node=4, extra_conf=extra) as c:
        c.scontrol("update", "nodename=n1", "state=drain", "reason=operator: cable reseat")
        inject(state_dir / "n1.json", "xid-79", gpu=0)
        inject(state_dir / "n2.json", "xid-79", gpu=2)
        c.wait_for("n2 drained by the health check", lambda: c.node("n2").drained, timeout=30)
        assert (c.node("n2").reason or "").startswith("fleetheal:xid-79 incident=check-n2-")
        c.wait_for(
            "n1 checked",
            lambda: (tmp_path / "hc-n1.log").exists() and "FAIL" in (tmp_path / "hc-n1.log").read_text(),
            timeout=30,
        )
        assert c.node("n1").reason == "operator: cable reseat"
        assert "their reason is kept" in (tmp_path / "hc-n1.log").read_text()


def test_the_fast_path_never_drains_past_the_fleet_budget(tmp_path):
    """A false-positive storm must not empty the cluster: with 2 fleetheal fault drains in the fleet and a
    budget of 2, the agent of a third node does not drain it; a standby drain and an operator's drain do not
    count; once one drain is lifted, it drains."""
    from fleetheal.agent.fastpath import DONE, OVER_BUDGET, SlurmDrainer
    from fleetheal.contracts import drain_reason

    _need_slurm()
    cluster = SlurmCluster(tmp_path / "slurm", nodes=6, gpus_per_node=0)
    cluster.start()
    try:
        for node, reason in [
            ("n1", drain_reason("xid-79", "inc-1")),
            ("n2", drain_reason("xid-48", "inc-2")),
            ("n5", "fleetheal:standby"),
            ("n6", "admin: bad DIMM"),
        ]:
            cluster.run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")
        agent = SlurmDrainer("n3", slurm_conf=str(cluster.conf_path), budget_nodes=2, budget_share=1.0)
        result, why = agent.drain(drain_reason("xid-79", "agent-n3-1"))
        assert result == OVER_BUDGET and "2 fleetheal fault drains" in why, why
        assert not agent.node_info().drained
        cluster.run("scontrol", "update", "nodename=n2", "state=RESUME")
        assert agent.drain(drain_reason("xid-79", "agent-n3-2"))[0] == DONE
        assert agent.node_info().drained
        # the share: 5 nodes outside the standby pool at 20% allow one drain, and n1 and n3 are two
        n4 = SlurmDrainer("n4", slurm_conf=str(cluster.conf_path), budget_nodes=8, budget_share=0.2)
        assert n4.drain(drain_reason("xid-79", "agent-n4-1"))[0] == OVER_BUDGET
    finally:
        cluster.stop()


def test_a_burst_of_agents_draining_at_once_stays_within_the_fleet_budget(tmp_path):
    """Twelve agents hit by one false positive drain at the same instant: each sees the budget free before
    it drains, so only the check after the drain can hold the line. No more than the budget stay drained,
    at least one does, and the others are left in service with result over_budget."""
    import threading

    from fleetheal.agent.fastpath import DONE, OVER_BUDGET, SlurmDrainer
    from fleetheal.contracts import drain_reason

    _need_slurm()
    cluster = SlurmCluster(tmp_path / "slurm", nodes=12, gpus_per_node=0)
    cluster.start()
    try:
        agents = [
            SlurmDrainer(n, slurm_conf=str(cluster.conf_path), budget_nodes=3, budget_share=1.0)
            for n in cluster.node_names
        ]
        results: dict[str, str] = {}
        go = threading.Barrier(len(agents))

        def one(agent: SlurmDrainer) -> None:
            go.wait()
            results[agent.node] = agent.drain(drain_reason("xid-79", f"agent-{agent.node}-1"))[0]

        threads = [threading.Thread(target=one, args=(a,)) for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(results.values()) <= {DONE, OVER_BUDGET}, results
        drained = [a.node for a in agents if a.node_info().drained]
        assert 1 <= len(drained) <= 3, (drained, results)
        assert sorted(drained) == sorted(n for n, r in results.items() if r == DONE), results
    finally:
        cluster.stop()


def test_only_a_jobs_owner_or_root_may_report_for_it():
    """What the agent believes of a training report's sender (its uid, from the socket) is checked against
    Slurm: the uid must own that job, and the job must run on this node."""
    from fleetheal.agent.fastpath import JobOwners

    _need_slurm()
    root = Path(tempfile.mkdtemp(prefix="fleetheal-owners-"))
    root.chmod(0o755)  # slurmstepd runs the job as its user, from the cluster's spool directory
    cluster = SlurmCluster(root / "slurm", nodes=2, gpus_per_node=0)
    cluster.start()
    nobody = 65534
    try:
        job = cluster.sbatch(
            "#!/bin/sh\nexec sleep 300\n", f"--uid={nobody}", "--nodelist=n1", "--output=/dev/null", "--chdir=/"
        )
        cluster.wait_for("job running", lambda: cluster.job(job).get("JobState") == "RUNNING", timeout=30)
        n1 = JobOwners("n1", slurm_conf=str(cluster.conf_path))
        assert n1.refuse(nobody, job) is None
        assert n1.refuse(0, job) is None  # root may report for any job
        assert n1.refuse(1000, job) == f"uid 1000 does not own job {job} (uid {nobody} does)"
        assert n1.refuse(nobody, "999999") == "job 999999 is not running on n1"
        assert "names none" in (n1.refuse(nobody, "") or "")
        n2 = JobOwners("n2", slurm_conf=str(cluster.conf_path))
        assert n2.refuse(nobody, job) == f"job {job} is not running on n2"
    finally:
        cluster.stop(graceful=False)
        shutil.rmtree(root, ignore_errors=True)


#: A batch job run without `fleetheal launch` that prints, as a real one would: an NCCL watchdog timeout on
#: stderr (merged into its output file), then the kernel's words for a lost GPU (which job output never
#: speaks for) and a claim of a node fault (an uncorrectable ECC error).
PRINTING_JOB = """#!/bin/sh
echo "step 1 loss 2.31"
echo "[rank0]:[E1206 10:00:00.000000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation \
timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600009 \
milliseconds before timing out." >&2
touch {marks}/nccl
while [ ! -e {marks}/go ]; do sleep 0.1; done
echo "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
echo "RuntimeError: CUDA error: uncorrectable ECC error encountered"
exec sleep 300
"""


def test_the_agent_follows_the_output_file_of_a_job_run_without_fleetheal_launch(cluster, agent):
    """Job-scoped faults from a job's own output file: the NCCL timeout it printed is raised for that job
    alone; the ECC error it printed claims a fault of the node, which stays undrained (job-output-node-claim);
    the kernel's Xid line it printed is no fault at all."""
    port, tmp = agent["port"], agent["tmp"]
    marks = tmp / "marks"
    marks.mkdir()
    out = tmp / "job.out"
    job = cluster.sbatch(PRINTING_JOB.format(marks=marks), "-w", "n1", f"--output={out}")
    cluster.wait_for("the job to print", lambda: (marks / "nccl").exists(), timeout=60)
    cluster.wait_for(
        "nccl-timeout raised for the job",
        lambda: _series(_metrics(port), "fleetheal_agent_fault_active", fault_id="nccl-timeout", job_id=job) == 1,
        timeout=60,
    )
    (marks / "go").touch()
    cluster.wait_for(
        "the node claim raised for the job",
        lambda: (
            _series(_metrics(port), "fleetheal_agent_fault_active", fault_id="job-output-node-claim", job_id=job) == 1
        ),
        timeout=60,
    )
    assert not cluster.node("n1").drained  # a job's words never move its node
    assert (tmp / "health").read_text().strip() == "ok"
    assert _series(_metrics(port), "fleetheal_agent_fault_active", fault_id="xid-79") is None
    cluster.run("scancel", job)


#: A batch job run without `fleetheal launch`, requeued after its first NCCL timeout: its second run appends
#: to the same file, prints an out-of-memory, then (told to) a second NCCL timeout.
REQUEUED_JOB = """#!/bin/sh
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  echo "[rank0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7) ran for 600009 milliseconds"
  exec sleep 300
fi
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
while [ ! -e {marks}/go ]; do sleep 0.1; done
echo "[rank0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9) ran for 600009 milliseconds"
exec sleep 300
"""


def test_a_requeued_job_s_next_fault_is_a_new_fault_and_its_old_lines_are_not_judged_again(cluster, agent):
    """The job's first run prints an NCCL timeout; the remediator would requeue it (here: `scontrol requeue`).
    Its second run, appending to the same file, is run 1.0: what it prints raises faults of its own (a new
    series, a new alert), while the first run's line, still in the file, is not judged again."""
    port, tmp = agent["port"], agent["tmp"]
    marks = tmp / "marks"
    marks.mkdir()
    out = tmp / "job.out"
    job = cluster.sbatch(
        REQUEUED_JOB.format(marks=marks), "-w", "n1", "--requeue", "--open-mode=append", f"--output={out}"
    )

    def active(fault: str, run: str) -> bool:
        return _series(_metrics(port), "fleetheal_agent_fault_active", fault_id=fault, job_id=job, job_run=run) == 1

    cluster.wait_for("run 0.0's NCCL timeout", lambda: active("nccl-timeout", "0.0"), timeout=60)
    cluster.scontrol("requeue", job)
    cluster.wait_for("run 1.0's out-of-memory", lambda: active("cuda-oom", "1.0"), timeout=90)
    # Read after run 0.0's line, which comes first in the file: had the follower read it again, it would be
    # active for run 1.0 by now.
    assert not active("nccl-timeout", "1.0")
    (marks / "go").touch()
    cluster.wait_for("run 1.0's own NCCL timeout", lambda: active("nccl-timeout", "1.0"), timeout=60)
    assert active("nccl-timeout", "0.0")  # still held: the two runs' faults are two
    assert not cluster.node("n1").drained
    cluster.run("scancel", job)


def test_a_job_output_file_swapped_for_a_link_is_not_followed(cluster, tmp_path):
    """The job replaces its output file with a symlink to a file it wants read (here a secret of root's with
    an NCCL line in it): the follower refuses the link, says so, and never reads the file behind it."""
    from fleetheal.agent.jobfiles import JobOutputFollower
    from fleetheal.slurm.runner import Runner

    secret = tmp_path / "secret"
    secret.write_text("[rank0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1) ran for 1\n")
    out = tmp_path / "job.out"
    script = f"#!/bin/sh\nrm -f {out}\nln -s {secret} {out}\nexec sleep 300\n"
    job = cluster.sbatch(script, "-w", "n1", f"--output={out}")
    cluster.wait_for("the link", lambda: out.is_symlink(), timeout=60)
    lines: list[tuple[str, str]] = []
    errors: list[str] = []
    follower = JobOutputFollower(
        "n1", lambda j, t, r: lines.append((j, t)), errors.append, runner=Runner(env=cluster.env), discover_s=0
    )
    follower.poll()
    follower.poll()
    assert job in follower.jobs() and not follower.jobs()[job].skip
    assert lines == [] and follower.refused == 1, (lines, errors)
    assert len(errors) == 1 and "not following" in errors[0] and "not a regular file" in errors[0], errors
    cluster.run("scancel", job)


def test_a_flood_of_output_is_read_a_bounded_amount_a_poll(cluster, tmp_path):
    """A job that prints 30 MB of error lines between two polls: the follower reads at most max_bytes of it,
    its newest, and counts the rest as skipped; the fault line printed after the flood is still judged."""
    from fleetheal.agent.jobfiles import JobOutputFollower
    from fleetheal.slurm.runner import Runner

    out = tmp_path / "job.out"
    done = tmp_path / "done"
    script = (
        f"#!/bin/sh\nyes 'error: something failed' | head -c 30000000\n"
        f"echo 'torch.OutOfMemoryError: CUDA out of memory.'\ntouch {done}\nexec sleep 300\n"
    )
    read: list[str] = []
    follower = JobOutputFollower(
        "n1",
        lambda j, t, r: read.append(t),
        lambda why: None,
        runner=Runner(env=cluster.env),
        discover_s=0,
        max_bytes=1 << 20,
    )
    follower.poll()  # the job starts after the follower: its file is read from its start
    job = cluster.sbatch(script, "-w", "n1", f"--output={out}")
    cluster.wait_for("the flood", lambda: done.exists(), timeout=60)
    follower.poll()
    assert follower.skipped_bytes >= 30_000_000 - (1 << 20), follower.skipped_bytes
    text = "\n".join(read)
    assert len(text) <= 1 << 20 and text.endswith("torch.OutOfMemoryError: CUDA out of memory.")
    cluster.run("scancel", job)


def test_the_output_of_a_job_run_by_fleetheal_launch_is_left_to_the_launcher(cluster, tmp_path):
    """The launcher sends its job's flagged lines itself: the follower leaves the job's files alone, so no line
    is judged twice (the word in the job's comment says so)."""
    from fleetheal.agent.jobfiles import JobOutputFollower
    from fleetheal.contracts import LAUNCH_TAG
    from fleetheal.slurm.runner import Runner

    out = tmp_path / "job.out"
    script = (
        "#!/bin/sh\necho '[rank0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)'\nexec sleep 300\n"
    )
    lines: list[str] = []
    follower = JobOutputFollower(
        "n1", lambda j, t, r: lines.append(t), lambda why: None, runner=Runner(env=cluster.env), discover_s=0
    )
    follower.poll()
    job = cluster.sbatch(script, "-w", "n1", f"--output={out}", f"--comment={LAUNCH_TAG}")
    cluster.wait_for("the job's line", lambda: "Watchdog" in (out.read_text() if out.exists() else ""), timeout=60)
    follower.poll()
    assert follower.jobs()[job].skip == "fleetheal launch watches its output"
    assert lines == []
    cluster.run("scancel", job)
