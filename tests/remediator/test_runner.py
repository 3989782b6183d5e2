"""The ansible-runner wrapper, with real ansible-runner and the recording test playbook."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetheal import taxonomy
from fleetheal.procs import cmdline
from fleetheal.remediator.config import ConfigError
from fleetheal.remediator.rundirs import kill_leftovers, prune_run_dirs
from fleetheal.remediator.runner import (
    RUN_MARKER,
    STOP_GRACE_S,
    AnsibleRunner,
    RunnerInputError,
    StepRequest,
    check_extravars,
    run_dir_for,
)
from fleetheal.remediator.scrub import remove_stale_secret_files, scrub_tree, secret_site_vars, secret_vars_dir
from fleetheal.wait import wait_until
from tests.remediator.conftest import TOKEN, make_config

TAX = taxonomy.load()

SECRET = "aws-secret-value-0123456789"


def request(incident=1, step=1, attempt=1, node="gpu-001", **extra):
    extravars = {
        "fleetheal_incident_id": f"inc-{incident:06d}",
        "fleetheal_node": node,
        "fleetheal_fault_id": "xid-79",
        "fleetheal_fault_class": "hardware",
        "fleetheal_action": "ISOLATE_AND_RELOCATE",
        "fleetheal_cluster": "lab",
        "fleetheal_dry_run": False,
        "fleetheal_job_id": "",
        "fleetheal_gpu": "3",
        "fleetheal_paused": False,
        "fleetheal_budget_remaining": 2,
        **extra,
    }
    return StepRequest(incident, step, attempt, "ISOLATE_AND_RELOCATE", "isolate_and_relocate.yml", extravars)


def records(tmp_path):
    path = tmp_path / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("FLEETHEAL_REMEDIATOR_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("FLEETHEAL_UNRELATED", "not-for-ansible")


def test_a_run_gets_exactly_the_validated_variables_and_feeds_the_timeline(tmp_path, secret_env):
    cfg = make_config(tmp_path)
    runner = AnsibleRunner(cfg.runner, secrets=[TOKEN])
    events = []
    outcome = runner.run(request(), events.append, lambda: False)
    assert outcome.ok, outcome
    start, finish = records(tmp_path)
    assert start["phase"] == "start" and finish["phase"] == "finish"
    assert start["node"] == "gpu-001" and start["gpu"] == "3" and start["action"] == "ISOLATE_AND_RELOCATE"
    assert start["dry_run"] is False and start["incident"] == "inc-000001"
    assert start["extra_vars"] == sorted(request().extravars)
    kinds = [e.kind for e in events]
    assert kinds[0] == "process" and events[0].pid
    assert "playbook_start" in kinds and "task_start" in kinds and "task_changed" in kinds
    assert events[-1].kind == "stats" and "failures=0" in events[-1].detail
    assert outcome.run_dir == str(run_dir_for(cfg.runner.run_dir, request()))


def test_site_vars_reach_the_playbook_beneath_the_incident_variables(tmp_path):
    site = {"fleetheal_grace_seconds": 3, "fleetheal_slurm_env": {"SLURM_CONF": "/lab/slurm.conf"}}
    cfg = make_config(tmp_path, runner={"site_vars": site})
    outcome = AnsibleRunner(cfg.runner).run(request(), lambda e: None, lambda: False)
    assert outcome.ok, outcome
    start, _ = records(tmp_path)
    assert start["extra_vars"] == sorted([*request().extravars, *site])
    written = json.loads((Path(outcome.run_dir) / "env" / "extravars").read_text())
    assert written == site  # the site's settings only; the incident's are its host's variables
    hosts = json.loads((Path(outcome.run_dir) / "inventory" / "hosts.json").read_text())
    assert hosts["fleetheal_incidents"]["hosts"]["inc-000001"]["fleetheal_node"] == "gpu-001"
    assert oct((Path(outcome.run_dir) / "inventory" / "hosts.json").stat().st_mode & 0o777) == "0o600"


def test_one_run_serves_many_incidents_each_with_its_own_result_and_timeline(tmp_path):
    """Three incidents, one ansible-playbook: the one whose inputs its playbook rejects fails alone,
    a request the runner refuses never joins, and each timeline holds its own host's task results."""
    cfg = make_config(tmp_path)
    bad = request(incident=2, step=2, node="gpu-002", fleetheal_fault_id="xid-13")
    unsafe = request(incident=4, step=4, node="gpu-004 -e x=y")
    batch = [request(incident=1, step=1, node="gpu-001"), bad, request(incident=3, step=3, node="gpu-003"), unsafe]
    events: dict[int, list] = {r.incident_id: [] for r in batch}
    outcomes = AnsibleRunner(cfg.runner).run_batch([(r, events[r.incident_id].append) for r in batch], lambda: False)
    first, second, third, refused = outcomes
    assert first.ok and third.ok and second.status == "failed", outcomes
    assert isinstance(refused, RunnerInputError) and not events[4]
    assert "one run for 3 incidents" in first.detail
    assert first.run_dir == second.run_dir == str(run_dir_for(cfg.runner.run_dir, batch[0]))
    pids = {e.pid for evs in events.values() for e in evs if e.kind == "process"}
    assert len(pids) == 1  # one ansible-playbook
    starts = {r["incident"]: r["node"] for r in records(tmp_path) if r["phase"] == "start"}
    assert starts == {"inc-000001": "gpu-001", "inc-000003": "gpu-003"}  # no variable crossed hosts
    for iid, evs in events.items():
        hosts = {
            e.detail.rsplit("(", 1)[-1].split(")")[0]
            for e in evs
            if e.kind in ("task_ok", "task_changed", "task_failed")
        }
        assert hosts <= {f"inc-{iid:06d}"}, (iid, hosts)
    assert any(e.kind == "task_failed" for e in events[2]) and not any(e.kind == "task_failed" for e in events[1])


def test_a_run_that_never_reaches_the_incidents_host_is_not_a_success(tmp_path):
    """A playbook whose play matches no host exits 0; that is no remediation."""
    (tmp_path / "pb").mkdir()
    (tmp_path / "pb" / "nothing.yml").write_text(
        "- hosts: fleetheal_no_such_group\n  gather_facts: false\n  tasks: [{ansible.builtin.ping: {}}]\n"
    )
    cfg = make_config(tmp_path, runner={"playbook_dir": str(tmp_path / "pb")})
    req = StepRequest(1, 1, 1, "ISOLATE_AND_RELOCATE", "nothing.yml", request().extravars)
    outcome = AnsibleRunner(cfg.runner).run(req, lambda e: None, lambda: False)
    assert outcome.status == "failed" and "never ran" in outcome.detail


def test_artifacts_keep_no_secret_and_not_the_whole_environment(tmp_path, secret_env):
    cfg = make_config(tmp_path)
    runner = AnsibleRunner(cfg.runner, secrets=[TOKEN])
    outcome = runner.run(request(), lambda e: None, lambda: False)
    assert outcome.ok
    run_dir = run_dir_for(cfg.runner.run_dir, request())
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data, path
        assert SECRET.encode() not in data, path
        assert b"not-for-ansible" not in data, path
    command = json.loads((run_dir / "artifacts" / "run" / "command").read_text())
    env = command["env"]
    assert "FLEETHEAL_UNRELATED" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert "FLEETHEAL_REMEDIATOR_TOKEN" not in env
    assert env["FLEETHEAL_TEST_RECORD"] == str(tmp_path / "record.jsonl")  # configured on purpose
    assert env[RUN_MARKER] == runner.marker(run_dir)  # no secret: who started the run, and where
    assert set(env) <= set(cfg.runner.env_passthrough) | {"FLEETHEAL_TEST_RECORD", RUN_MARKER} | {
        k for k in env if k.startswith(("ANSIBLE_", "AWX_", "RUNNER_", "ORIGINAL_STDOUT_CALLBACK"))
    }
    assert oct((run_dir / "env" / "extravars").stat().st_mode & 0o777) == "0o600"


def test_every_step_attempt_has_its_own_private_directory(tmp_path):
    cfg = make_config(tmp_path)
    runner = AnsibleRunner(cfg.runner)
    first = runner.run(request(incident=1, step=1, node="gpu-001"), lambda e: None, lambda: False)
    second = runner.run(request(incident=2, step=2, node="gpu-002"), lambda e: None, lambda: False)
    assert first.ok and second.ok and first.run_dir != second.run_dir
    nodes = [r["node"] for r in records(tmp_path) if r["phase"] == "start"]
    assert nodes == ["gpu-001", "gpu-002"]  # no variable leaked from the first run into the second


def test_a_run_past_its_timeout_is_killed(tmp_path):
    cfg = make_config(
        tmp_path,
        runner={
            "timeout_s": 2,
            "envvars": {"FLEETHEAL_TEST_RECORD": str(tmp_path / "r"), "FLEETHEAL_TEST_HOLD_S": "60"},
        },
    )
    t0 = time.monotonic()
    outcome = AnsibleRunner(cfg.runner).run(request(), lambda e: None, lambda: False)
    assert outcome.status == "timeout" and outcome.detail == "playbook killed after 2 s"
    assert time.monotonic() - t0 < 20
    assert run_processes(tmp_path) == {}  # stopped like a canceled run: all of it


def test_a_failing_playbook_reports_the_failed_task(tmp_path):
    cfg = make_config(tmp_path)
    events = []
    # A fault id whose taxonomy action differs: the playbook's own assertion fails.
    outcome = AnsibleRunner(cfg.runner).run(request(fleetheal_fault_id="xid-13"), events.append, lambda: False)
    assert outcome.status == "failed"
    failed = [e.detail for e in events if e.kind == "task_failed"]
    assert failed and "Check the inputs like a real remediation playbook" in failed[0]


@pytest.mark.parametrize(
    "extra",
    [
        {"fleetheal_node": "gpu-001 -e @/etc/shadow"},
        {"fleetheal_node": "{{ lookup('pipe', 'id') }}"},
        {"fleetheal_job_id": "1;reboot"},
        {"ansible_connection": "ssh"},
        {"fleetheal_gpu": 3.0},
        {"fleetheal_budget_remaining": -1},
        {"fleetheal_budget_remaining": "1 -e x=y"},
    ],
)
def test_unvalidated_variables_never_reach_ansible(tmp_path, extra):
    cfg = make_config(tmp_path)
    with pytest.raises(RunnerInputError):
        AnsibleRunner(cfg.runner).run(request(**extra), lambda e: None, lambda: False)
    assert not (tmp_path / "runs").exists()


def test_check_extravars_accepts_the_contract():
    assert check_extravars(request().extravars)["fleetheal_dry_run"] is False


def test_a_playbook_outside_the_playbook_dir_is_refused(tmp_path):
    cfg = make_config(tmp_path)
    runner = AnsibleRunner(cfg.runner)
    with pytest.raises(RunnerInputError, match="outside"):
        runner.playbook_path("../../etc/passwd")
    with pytest.raises(RunnerInputError, match="does not exist"):
        runner.playbook_path("missing.yml")


def test_leftovers_of_an_interrupted_step_are_killed(tmp_path):
    run_dir = tmp_path / "runs" / "inc-000001" / "step3-attempt1"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", str(run_dir / "env" / "extravars")],
        start_new_session=True,
    )
    try:
        # until the child has exec'ed (its command line names the run dir)
        wait_until(lambda: str(run_dir) in cmdline(proc.pid), 10, "the child to exec", interval=0.01)
        assert kill_leftovers(str(run_dir)) == []
        assert proc.wait(timeout=5) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    other = tmp_path / "runs" / "inc-000001" / "step3-attempt10"  # a prefix must not match
    assert kill_leftovers(str(other)) == []


# --- the processes of a stopped or crashed run ---------------------------------------------------------------

#: A playbook like a remediation step mid-way: a task left a detached process (setsid, reparented to init),
#: and a command runs (a drain). Every process of a run carries the run's RUN_MARKER, which tells them apart.
HOLD_PLAYBOOK = """\
- name: Hold like a long remediation step
  hosts: fleetheal_incidents
  gather_facts: false
  tasks:
    - name: Leave a detached process
      ansible.builtin.shell: "setsid sleep 301 </dev/null >/dev/null 2>&1 &"
      changed_when: true
    - name: Run a long command
      ansible.builtin.command: sleep 300
      changed_when: true
"""


def hold_config(tmp_path: Path):
    (tmp_path / "playbooks").mkdir(exist_ok=True)
    (tmp_path / "playbooks" / "hold.yml").write_text(HOLD_PLAYBOOK)
    return make_config(tmp_path, runner={"playbook_dir": str(tmp_path / "playbooks")})


def hold_request(incident: int = 1) -> StepRequest:
    r = request(incident=incident, step=incident)
    return StepRequest(r.incident_id, r.step_id, r.attempt, r.action, "hold.yml", r.extravars)


def run_processes(root: Path) -> dict[int, str]:
    """Live processes whose RUN_MARKER names a run under `root`, with their command lines: read from /proc
    directly, not through fleetheal.procs, which these tests check."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        value = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(f"{RUN_MARKER}=".encode())), "")
        if str(root) in value and state != b"Z":
            found[int(entry)] = line
    return found


def sleeping(root: Path) -> list[str]:
    """The two `sleep`s of the hold playbook's runs under `root`, once both run."""
    return sorted(line for line in run_processes(root).values() if line.startswith("sleep "))


@pytest.fixture
def reaper(tmp_path):
    """Whatever a test started, SIGKILLed at its end even when it failed: every process of a run under
    `tmp_path` (found as run_processes finds them) and the processes the test hands to `reaper.append`."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 10
    while (left := run_processes(tmp_path)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def start_in_thread(runner: AnsibleRunner, req: StepRequest) -> tuple[threading.Thread, threading.Event, list]:
    cancel = threading.Event()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(runner.run(req, lambda e: None, cancel.is_set)), daemon=True)
    thread.start()
    return thread, cancel, out


def sessions(pids) -> set[int]:
    out = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            out.add(os.getsid(pid))
    return out


def test_a_canceled_run_leaves_no_process_behind(tmp_path, reaper):
    """SIGTERM of the remediator cancels its runs (engine.stop sets the cancel flag): every process of the
    run goes, the worker Ansible forked into a session of its own and what a task detached included."""
    cfg = hold_config(tmp_path)
    thread, cancel, out = start_in_thread(AnsibleRunner(cfg.runner), hold_request())
    try:
        wait_until(lambda: sleeping(tmp_path) == ["sleep 300", "sleep 301"], 90, "the playbook's commands")
        # The cause: Ansible's worker (and so the command it runs) is not in ansible-playbook's session,
        # which is all ansible-runner's cancel kills, and the detached `sleep 301` is in neither.
        assert len(sessions(run_processes(tmp_path))) >= 3, run_processes(tmp_path)
        t0 = time.monotonic()
        cancel.set()
        thread.join(STOP_GRACE_S + 30)
        took = time.monotonic() - t0
    finally:
        cancel.set()
        thread.join(30)
    (outcome,) = out
    assert outcome.status == "canceled" and outcome.detail == "playbook canceled"
    assert run_processes(tmp_path) == {}  # nothing of the run survives: the run returned after they all went
    assert took < STOP_GRACE_S + 5  # a lost lead's fence waits for this (2 s by default; slack for a busy CI)


CRASHING_RUNNER = """\
import sys
from pathlib import Path
from tests.remediator.test_runner import AnsibleRunner, hold_config, hold_request
cfg = hold_config(Path(sys.argv[1]))
AnsibleRunner(cfg.runner).run(hold_request(), lambda e: None, lambda: False)
"""


def test_the_next_start_stops_what_a_crashed_remediators_run_left(tmp_path, reaper):
    """The remediator is SIGKILLed mid-run (nothing of its own clean-up runs): ansible-playbook, its worker
    and their commands run on. The next start (an AnsibleRunner) stops them all, and never a run of a
    remediator that is still alive (another replica on the host; here this test process)."""
    cfg = hold_config(tmp_path)
    crashed = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RUNNER, str(tmp_path)], cwd=Path(__file__).resolve().parents[2]
    )
    reaper.append(crashed)
    live_root = tmp_path / "runs" / "inc-000002"
    thread, cancel, out = start_in_thread(AnsibleRunner(cfg.runner), hold_request(incident=2))
    try:
        orphan_root = tmp_path / "runs" / "inc-000001"
        wait_until(lambda: sleeping(orphan_root) == ["sleep 300", "sleep 301"], 90, "the crashing run's commands")
        wait_until(lambda: sleeping(live_root) == ["sleep 300", "sleep 301"], 90, "the live run's commands")
        crashed.send_signal(signal.SIGKILL)
        assert crashed.wait(10) == -signal.SIGKILL
        time.sleep(0.5)
        left = run_processes(orphan_root)
        assert sleeping(orphan_root) == ["sleep 300", "sleep 301"], left  # the leak a crash leaves
        assert any("ansible-playbook" in line for line in left.values()), left
        live = run_processes(live_root)

        assert AnsibleRunner(cfg.runner).stop_orphans() == []  # what the constructor did: nothing left to stop
        assert run_processes(orphan_root) == {}
        assert run_processes(live_root) == live  # this process's run is untouched
    finally:
        cancel.set()
        thread.join(STOP_GRACE_S + 30)
    (outcome,) = out
    assert outcome.status == "canceled" and run_processes(tmp_path) == {}


def test_scrub_tree_masks_secret_values(tmp_path):
    (tmp_path / "a").write_text(f"x {SECRET} y")
    (tmp_path / "b").write_text("clean")
    assert scrub_tree(tmp_path, [SECRET]) == 1
    assert (tmp_path / "a").read_text() == "x *** y"
    assert os.path.exists(tmp_path / "b")


REFILL_TOKEN = "refill-token-9f8e7d6c5b4a3210"

#: A playbook that uses a secret site setting as a real one does (the refill request, no_log) and also
#: leaks it (a debug task without no_log), to show that no copy of it stays in the run directory.
SECRET_PLAYBOOK = """\
- hosts: fleetheal_incidents
  gather_facts: false
  tasks:
    - name: Use the token (a real playbook sends it in a header, no_log)
      ansible.builtin.copy:
        content: "{{ fleetheal_standby_refill_token }}"
        dest: "{{ lookup('ansible.builtin.env', 'FLEETHEAL_TEST_RECORD') }}"
        mode: "0600"
      no_log: true
    - name: A careless task prints it
      ansible.builtin.debug:
        msg: "token is {{ fleetheal_standby_refill_token }} and grace {{ fleetheal_grace_seconds }}"
"""


def test_secret_site_vars_reach_the_playbook_but_no_file_of_the_run(tmp_path):
    """Issue 15: a secret site setting (the standby refill token) must never be written in the run
    directory (env/extravars, command, job events, stdout...), yet the playbook gets its value."""
    (tmp_path / "pb").mkdir()
    (tmp_path / "pb" / "secret.yml").write_text(SECRET_PLAYBOOK)
    site = {"fleetheal_standby_refill_token": REFILL_TOKEN, "fleetheal_grace_seconds": 7}
    cfg = make_config(tmp_path, runner={"playbook_dir": str(tmp_path / "pb"), "site_vars": site})
    req = StepRequest(1, 1, 1, "ISOLATE_AND_RELOCATE", "secret.yml", request().extravars)
    seen: list = []
    observed: list[bytes] = []
    leftover_secret_files: list[Path] = []

    def on_event(event):  # while the playbook runs, not only after the final scrub
        seen.append(event)
        if event.kind == "task_start" and "careless" in event.detail:
            observed.extend(p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink())
            leftover_secret_files.extend(Path(secret_vars_dir()).glob(f"fleetheal-secret-vars-{os.getpid()}-*"))

    run_dir = run_dir_for(cfg.runner.run_dir, req)
    outcome = AnsibleRunner(cfg.runner, secrets=[TOKEN]).run(req, on_event, lambda: False)
    assert outcome.ok, outcome
    assert (tmp_path / "record.jsonl").read_text() == REFILL_TOKEN  # the playbook got the value
    assert all(REFILL_TOKEN not in e.detail for e in seen)
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files
    for path in files:
        assert REFILL_TOKEN.encode() not in path.read_bytes(), path
    assert observed and all(REFILL_TOKEN.encode() not in data for data in observed)
    assert json.loads((run_dir / "env" / "extravars").read_text()) == {"fleetheal_grace_seconds": 7}
    assert not leftover_secret_files  # the in-memory vars file was gone once the playbook had started
    assert not list(Path(secret_vars_dir()).glob(f"fleetheal-secret-vars-{os.getpid()}-*"))


def test_which_site_vars_are_secret(tmp_path):
    site = {
        "fleetheal_standby_refill_token": "t0k3n-value",
        "fleetheal_bmc_password": "pw-value",
        "fleetheal_slurm_env": {"SLURM_JWT": "jwt-value"},
        "fleetheal_bmc_secret": "short",
        "fleetheal_grace_seconds": 3,
        "fleetheal_kubeconfig": "/etc/k",
    }
    cfg = make_config(tmp_path, runner={"site_vars": site, "secret_vars": ["fleetheal_slurm_env"]})
    runner = AnsibleRunner(cfg.runner)
    assert set(secret_site_vars(cfg.runner)) == {
        "fleetheal_standby_refill_token",
        "fleetheal_bmc_password",
        "fleetheal_slurm_env",
        "fleetheal_bmc_secret",
    }
    assert runner.plain_vars == {"fleetheal_grace_seconds": 3, "fleetheal_kubeconfig": "/etc/k"}
    assert {"t0k3n-value", "pw-value", "jwt-value"} <= set(runner.secrets)
    assert "short" not in runner.secrets  # never written to a run directory, but too short to mask
    with pytest.raises(ConfigError, match="secret_vars"):
        make_config(tmp_path, runner={"secret_vars": ["AWS_KEY"]})


def test_secret_files_of_a_dead_remediator_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"fleetheal-secret-vars-{dead.pid}-abc.json"
    mine = tmp_path / f"fleetheal-secret-vars-{os.getpid()}-abc.json"
    other = tmp_path / "unrelated.json"
    for path in (stale, mine, other):
        path.write_text("{}")
    assert remove_stale_secret_files(str(tmp_path)) == 1
    assert not stale.exists() and mine.exists() and other.exists()


DAY = 86400.0


def make_run(root: Path, ref: str, name: str, age_days: float) -> Path:
    path = root / ref / name
    (path / "artifacts" / "run").mkdir(parents=True)
    (path / "artifacts" / "run" / "stdout").write_text("x" * 100)
    when = time.time() - age_days * DAY
    os.utime(path, (when, when))
    return path


def test_prune_removes_only_the_old_run_directories_of_finished_incidents(tmp_path):
    """Issue 15: run directories were never pruned. Old ones of finished incidents go; those of unfinished
    incidents (the engine resumes from them), recent ones, and anything not named like a run stay."""
    from fleetheal.remediator.alerts import validate_alert
    from fleetheal.remediator.engine import Engine
    from fleetheal.remediator.store import Store
    from tests.remediator.conftest import RecordingRunner, alert

    cfg = make_config(tmp_path, runner={"keep_runs_days": 14})
    store = Store(cfg.store.path)
    created = store.ingest([validate_alert(alert(node=f"gpu-00{i}"), cfg, TAX) for i in range(1, 5)]).created
    done, failed, acting, batched = created
    store.set_state(done, "done")
    store.set_state(failed, "failed")
    store.set_state(acting, "acting")
    store.set_state(batched, "acting")
    root = Path(cfg.runner.run_dir)
    old_done = make_run(root, f"inc-{done:06d}", "step4-attempt1", 30)
    new_done = make_run(root, f"inc-{done:06d}", "step9-attempt2", 1)
    old_failed = make_run(root, f"inc-{failed:06d}", "step5-attempt1", 20)
    old_acting = make_run(root, f"inc-{acting:06d}", "step6-attempt1", 40)
    # `batched` ran in a batch whose directory is its finished neighbour's: that one stays too
    shared = make_run(root, f"inc-{failed:06d}", "step7-attempt1", 40)
    step = store.start_step(batched, "playbook")
    store.set_step_run_dir(step, str(shared))
    stray = root / "inc-000999" / "notes"
    stray.mkdir(parents=True)
    os.utime(stray, (0, 0))
    engine = Engine(cfg, store, RecordingRunner(), TAX)
    removed = asyncio.run(engine.prune_runs())
    assert sorted(removed) == sorted([str(old_done), str(old_failed)])
    assert not old_done.exists() and not old_failed.exists()
    assert new_done.exists() and old_acting.exists() and shared.exists() and stray.exists()
    store.set_state(batched, "done")
    assert asyncio.run(engine.prune_runs()) == [str(shared)]
    assert not (root / f"inc-{failed:06d}").exists()  # emptied incident directories go as well
    assert (root / f"inc-{done:06d}").exists()


def test_prune_keeps_at_most_keep_runs_and_never_a_young_one(tmp_path):
    root = tmp_path / "runs"
    ages = [0.001, 0.01, 2, 3, 4]  # days; the first two are younger than PRUNE_MIN_AGE_S
    runs = [make_run(root, f"inc-{i:06d}", "step1-attempt1", age) for i, age in enumerate(ages, 1)]
    assert prune_run_dirs(str(root), 0, 0) == []  # no limit at all
    removed = prune_run_dirs(str(root), 0, 1, busy={str(root / "inc-000004")})
    assert sorted(removed) == [str(runs[2]), str(runs[4])]
    assert [r.exists() for r in runs] == [True, True, False, True, False]
    assert prune_run_dirs(str(root), 1, 0) == [str(runs[3])]  # by age, once inc-000004 is finished
