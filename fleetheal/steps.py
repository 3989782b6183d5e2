"""Remediation steps, written once: the remediator's first responder calls them in-process, and the
playbooks reach them as modules of the repository's collection (`fleetheal.cluster.slurm_node`,
`fleetheal.cluster.slurm_job`, `fleetheal.cluster.k8s_node`), so a human running a runbook does exactly
what the remediator does.

Every step is idempotent per incident (the incident id is written into the Slurm comment of what it
changed, and a step that finds it there reports `done` without acting again), returns `StepResult`s in
the shape of the playbooks' report (`{"step", "outcome", "detail"}`, outcome done | would | skipped |
failed), and honours a dry run ("would ...", nothing changed).

Slurm is driven through its own commands (`scontrol`, `scancel`, `squeue --json`, `sinfo` read by
`fleetheal.slurm_nodes`), with the retries, delay and timeout of `playbooks/vars/remediation.yml`.
Kubernetes through the official client.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetheal import contracts, launch, slurm_nodes

_ACTIVE_JOB_STATES = ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")
#: Slurm's highest settable priority minus the values it reserves.
MAX_PRIORITY = 4294967293


class StepError(RuntimeError):
    """A Slurm or Kubernetes command failed after its retries."""


@dataclass(frozen=True, slots=True)
class StepResult:
    step: str  # slurm_drain, slurm_signal, slurm_requeue, standby_promote, k8s_cordon, k8s_promote
    outcome: str  # done | would | skipped | failed
    detail: str
    changed: bool = False
    #: for a promotion: the standby node promoted for the incident (now or by an earlier run)
    node: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"step": self.step, "outcome": self.outcome, "detail": self.detail}


# --- settings: one source, the playbooks' own defaults ------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The playbook variables the steps need, defaults from `playbooks/vars/remediation.yml`."""

    slurm_env: Mapping[str, str] = field(default_factory=dict)
    slurm_bin_dir: str = ""
    slurm_retries: int = 3
    slurm_retry_delay_s: float = 2.0
    slurm_timeout_s: float = 30.0
    grace_signal: str = "USR1"
    grace_seconds: float = 120.0
    priority_boost: int = 1000
    max_restarts: int = 3
    restart_mode: str = "requeue"
    standby_reason: str = contracts.DRAIN_REASON_PREFIX + "standby"
    quarantine_reason: str = contracts.DRAIN_REASON_PREFIX + "quarantine"
    promote_standby: bool = True
    kubeconfig: str = ""
    k8s_in_cluster: bool = False
    report_dir: str = "/var/lib/fleetheal/reports"

    @classmethod
    def from_vars(cls, values: Mapping[str, Any]) -> Settings:
        """From playbook variables (`fleetheal_<name>`); names it does not use are ignored."""
        kwargs: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            key = f"fleetheal_{f.name}"
            if key not in values:
                continue
            raw = values[key]
            if isinstance(raw, str):
                # vars/remediation.yml writes the owned pool reasons with the one template Ansible would
                # render from the contract; any other template cannot be rendered outside Ansible.
                raw = raw.replace("{{ fleetheal_drain_reason_prefix }}", contracts.DRAIN_REASON_PREFIX)
                if "{{" in raw or "{%" in raw:
                    raise ValueError(f"{key}: {raw!r} is a Jinja template; give the remediator a plain value")
            default = getattr(cls, f.name, None)
            if f.name == "slurm_env":
                kwargs[f.name] = {str(k): str(v) for k, v in dict(raw or {}).items()}
            elif isinstance(default, bool):
                kwargs[f.name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                kwargs[f.name] = int(raw)
            elif isinstance(default, float):
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = str(raw)
        return cls(**kwargs)

    @classmethod
    def load(cls, playbook_dir: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> Settings:
        """`vars/remediation.yml` under `playbook_dir` (when there is one), then `overrides` (the remediator's
        site vars). The field defaults above are that file's values (tests/test_steps.py keeps them equal)."""
        path = Path(playbook_dir) / "vars" / "remediation.yml"
        values = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.is_file() else {}
        values.update(dict(overrides or {}))
        return cls.from_vars(values)

    @property
    def kubernetes(self) -> bool:
        return bool(self.kubeconfig) or self.k8s_in_cluster


# --- Slurm's JSON -------------------------------------------------------------------------------------
# Debian's Slurm 22.05 (openapi v0.0.38): `squeue --json` ignores its filter options and prints every job,
# so selection happens here, by exact job id and node name. The fields whose shape a data parser changes
# (22.05's v0.0.38 to 26.05's v0.0.45) are read by `fleetheal.slurm_nodes`, which also reads the nodes.


def _doc(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.strip():
        parsed = json.loads(value)
        if isinstance(parsed, dict):
            return parsed
    raise ValueError("expected the JSON document printed by `squeue --json`")


_MEMO = "_fleetheal_index"


def _memo(doc: dict[str, Any], key: str, build: Callable[[dict[str, Any]], Any]) -> Any:
    """What `build` derives from `doc`, built once per document: a storm's first responses share one read
    of the fleet, and scanning it whole for each of N incidents made the storm quadratic. Concurrent
    callers may both build; they build the same thing."""
    memo = doc.setdefault(_MEMO, {})
    if key not in memo:
        memo[key] = build(doc)
    return memo[key]


def _stdout_path(job: dict[str, Any]) -> str:
    """The job's output file with Slurm's filename patterns (%j %A %a %x %u %%) expanded. Slurm's default
    when the job named none (22.05 prints "", 26.05 the pattern itself) is `slurm-%j.out`, `slurm-%A_%a.out`
    for an array task; a relative path is relative to the job's working directory."""
    job_id = str(job.get("job_id", ""))
    task = slurm_nodes.number(job.get("array_task_id"), -1)
    path = str(job.get("standard_output") or "") or ("slurm-%A_%a.out" if task >= 0 else "slurm-%j.out")
    subst = {
        "j": job_id,
        "A": str(slurm_nodes.number(job.get("array_job_id")) or job_id),
        "a": "" if task < 0 else str(task),
        "x": str(job.get("name") or ""),
        "u": str(job.get("user_name") or ""),
        "%": "%",
    }
    path = re.sub(r"%([jAaxu%])", lambda m: subst[m.group(1)], path)
    if not path.startswith("/"):
        cwd = str(job.get("current_working_directory") or "")
        return f"{cwd.rstrip('/')}/{path}" if cwd else ""
    return path


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    uid = job.get("user_id")
    return {
        "job_id": str(job.get("job_id")),
        "name": str(job.get("name") or ""),
        "user": str(job.get("user_name") or ""),
        "state": slurm_nodes.job_state(job.get("job_state")),
        "state_reason": str(job.get("state_reason") or ""),
        "nodes": slurm_nodes.job_nodes(job),
        "batch_host": str(job.get("batch_host") or ""),
        "required_nodes": str(job.get("required_nodes") or ""),
        "excluded_nodes": str(job.get("excluded_nodes") or ""),
        "requeue": bool(job.get("requeue")),
        "priority": slurm_nodes.number(job.get("priority")),
        "restart_cnt": slurm_nodes.number(job.get("restart_cnt")),
        "comment": str(job.get("comment") or ""),
        "stdout": _stdout_path(job),
        "uid": -1 if uid is None else int(uid),
    }


def _jobs_by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for job in doc.get("jobs", []):
        by_id.setdefault(str(job.get("job_id")), _summary(job))
    return by_id


def _active_jobs_by_node(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    by_node: dict[str, list[dict[str, Any]]] = {}
    for job in sorted(_memo(doc, "jobs", _jobs_by_id).values(), key=lambda j: int(j["job_id"])):
        if job["state"] in _ACTIVE_JOB_STATES:
            for node in dict.fromkeys(job["nodes"]):
                by_node.setdefault(node, []).append(job)
    return by_node


def _copy(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "nodes": list(job["nodes"])}  # the caller's own: the index is shared


def slurm_job(squeue: Any, job_id: Any) -> dict[str, Any]:
    """One job of `squeue --json` by id (summary fields), or {} when Slurm no longer lists it."""
    job = _memo(_doc(squeue), "jobs", _jobs_by_id).get(str(job_id))
    return _copy(job) if job else {}


def slurm_jobs_on_node(squeue: Any, node: str) -> list[dict[str, Any]]:
    """Active jobs (running, configuring, completing, suspended) that hold an allocation on `node`."""
    return [_copy(j) for j in _memo(_doc(squeue), "on_node", _active_jobs_by_node).get(node, [])]


def _max_priority(doc: dict[str, Any]) -> int:
    best = 0
    for job in doc.get("jobs", []):
        state = slurm_nodes.job_state(job.get("job_state"))
        if state != "PENDING" and state not in _ACTIVE_JOB_STATES:
            continue
        best = max(best, slurm_nodes.number(job.get("priority")))
    return best


def slurm_max_priority(squeue: Any) -> int:
    """The highest priority among pending and active jobs."""
    return int(_memo(_doc(squeue), "max_priority", _max_priority))


def target_jobs(squeue: Any, node: str, job_id: str = "") -> list[dict[str, Any]]:
    """The jobs an action on `node` hits: job `job_id` alone when given (and still active there), else
    every active job on the node. A job-scoped fault never reaches the node's other jobs."""
    if job_id:
        job = slurm_job(squeue, job_id)
        return [job] if job and job["state"] in _ACTIVE_JOB_STATES and node in job["nodes"] else []
    return slurm_jobs_on_node(squeue, node)


# --- Slurm commands ---------------------------------------------------------------------------------------


class _Shared:
    """Concurrent calls share one read: a call waits for the next read to start (which its first waiter
    runs), so a caller always sees at least its own earlier writes, and a storm of N first responses
    costs about two reads, not N. A caller that only needs a read taken after a moment of its own
    (`since`, wall clock: a first response needs one taken after its alert arrived) also takes the last
    read or the one in flight when either started after that moment."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self._fetch = fetch
        self._cond = threading.Condition()
        self._running: Future[Any] | None = None  # the read in flight
        self._claimed = False  # whether a caller is running it
        self._running_since = 0.0  # when (wall clock) the read in flight started
        self._next: Future[Any] | None = None  # the read that callers arriving now wait for
        self._last: tuple[float, Any] | None = None  # (when it started, wall clock; its result)

    def get(self, since: float | None = None) -> tuple[float, Any]:
        """(when the read started, on the monotonic clock; what it read)."""
        with self._cond:
            if since is not None and self._last is not None and self._last[0] >= since:
                return self._last[1]  # type: ignore[no-any-return]
            if since is not None and self._claimed and self._running is not None and self._running_since >= since:
                fut = self._running
                while not fut.done():
                    self._cond.wait()
                return fut.result()  # type: ignore[no-any-return]
            if self._running is None:
                fut = self._running = Future()
            else:
                fut = self._next = self._next or Future()
                while not fut.done() and (self._running is not fut or self._claimed):
                    self._cond.wait()
                if fut.done():
                    return fut.result()  # type: ignore[no-any-return]
            self._claimed = True
            self._running_since = wall = time.time()
        started = time.monotonic()
        try:
            fut.set_result((started, self._fetch()))
        except BaseException as exc:
            fut.set_exception(exc)
        finally:
            with self._cond:
                if not fut.exception():
                    self._last = (wall, fut.result())
                self._running, self._next, self._claimed = self._next, None, False
                self._cond.notify_all()
        return fut.result()  # type: ignore[no-any-return]


class _Batched:
    """Concurrent commands go to Slurm together: what is submitted while a batch runs becomes the next
    batch, run by one of its submitters (a caller never runs a batch after the one holding its command).
    `run_batch` takes the items and returns one error (or None) each."""

    def __init__(self, run_batch: Callable[[list[Any]], list[Exception | None]]) -> None:
        self._run_batch = run_batch
        self._cond = threading.Condition()
        self._busy = False
        self._pending: list[tuple[Any, Future[None]]] = []

    def submit(self, item: Any) -> None:
        fut: Future[None] = Future()
        with self._cond:
            self._pending.append((item, fut))
            while self._busy and not fut.done():
                self._cond.wait()
            if fut.done():
                return fut.result()
            self._busy = True
            batch, self._pending = self._pending, []
        try:
            try:
                errors = self._run_batch([i for i, _ in batch])
            except Exception as exc:
                errors = [exc] * len(batch)
            for (_, done), error in zip(batch, errors, strict=True):
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
        finally:
            for _, done in batch:  # interrupted: nobody waits forever
                if not done.done():
                    done.set_exception(StepError("interrupted while the command ran"))
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return fut.result()


def _scontrol_word(arg: str) -> str:
    """One argument as scontrol's command reader splits a line: quoted when it holds a blank."""
    if '"' in arg or "\n" in arg:
        raise StepError(f"scontrol argument {arg!r} holds a quote or a newline")
    if " " not in arg and "\t" not in arg:
        return arg
    key, sep, value = arg.partition("=")
    return f'{key}="{value}"' if sep else f'"{arg}"'


def _stdin_safe(cmd: Sequence[str]) -> bool:
    """Whether scontrol reading `cmd` from its input stores what argv would: it keeps the quotes around a
    value with a blank (a comment would read '"a b"', and its words would not match), but for a reason."""
    return all((" " not in a and "\t" not in a) or a.lower().startswith("reason=") for a in cmd)


class Slurm:
    """Slurm's commands with the playbooks' retries, delay and timeout.

    Shared by concurrent callers (the first responder's threads): `sinfo()` and `squeue()` share reads
    (`_Shared`), and `scontrol()` and `scancel_signal()` send what is submitted at the same time as one
    command (`scontrol` reading its commands from stdin, one `scancel` per signal)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.env = {**os.environ, **settings.slurm_env}
        self.prefix = (settings.slurm_bin_dir.rstrip("/") + "/") if settings.slurm_bin_dir else ""
        self._sinfo = _Shared(lambda: slurm_nodes.parse_text(self.run("sinfo", *slurm_nodes.NODES_ARGS)))
        self._squeue = _Shared(lambda: _doc(self.run("squeue", "--json")))
        self._scontrol = _Batched(self._scontrol_batch)
        self._scancel = _Batched(self._scancel_batch)

    def run(self, command: str, *args: str, stdin: str | None = None, retries: int | None = None) -> str:
        s = self.settings
        tries = 1 + (s.slurm_retries if retries is None else retries)
        last = ""
        for attempt in range(tries):
            try:
                proc = subprocess.run(
                    [self.prefix + command, *args],
                    env=self.env,
                    input=stdin,
                    capture_output=True,
                    text=True,
                    timeout=s.slurm_timeout_s,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                last = f"{command}: {exc}"
            else:
                if proc.returncode == 0 and not (stdin and proc.stderr.strip()):
                    return proc.stdout
                last = (
                    f"{command} {' '.join(args)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:300]}"
                )
            if attempt + 1 < tries:
                time.sleep(s.slurm_retry_delay_s)
        raise StepError(last)

    def sinfo(self) -> slurm_nodes.Nodes:
        return self.sinfo_at()[1]

    def sinfo_at(self, since: float | None = None) -> tuple[float, slurm_nodes.Nodes]:
        """Every node (`fleetheal.slurm_nodes`) and when (monotonic) the read started; `since`: see `_Shared`."""
        return self._sinfo.get(since)

    def squeue(self, since: float | None = None) -> dict[str, Any]:
        return self._squeue.get(since)[1]  # type: ignore[no-any-return]

    def scontrol(self, *args: str) -> None:
        """One scontrol command (`update ...`, `requeue ...`), sent with the others submitted meanwhile.
        Checked before it joins a batch: a newline in a value would be a second command in scontrol's input,
        and a refused command must fail for its caller only."""
        self.scontrol_seq([tuple(args)])

    def scontrol_seq(self, commands: Sequence[Sequence[str]]) -> None:
        """Commands that must run in this order (a requeue, then the update of the pending job), sent in
        one batch: a storm's requeues then wait for one batch of scontrol, not two."""
        cmds = tuple(tuple(c) for c in commands)
        for cmd in cmds:
            for arg in cmd:
                _scontrol_word(arg)
        self._scontrol.submit(cmds)

    def scancel_signal(self, signal: str, job_ids: Sequence[str]) -> None:
        """`scancel --batch --signal=SIGNAL` to `job_ids`, with the other jobs signalled meanwhile."""
        self._scancel.submit((signal, tuple(job_ids)))

    def _scontrol_batch(self, batch: list[tuple[tuple[str, ...], ...]]) -> list[Exception | None]:
        """Each caller's commands in order: the leading ones scontrol can read from its input go to one
        scontrol together; the rest (a value with a blank, which scontrol reading its input would store
        with its quotes, but for a reason) then run on their own, concurrently across callers."""
        heads: list[tuple[tuple[str, ...], ...]] = []
        tails: list[tuple[tuple[str, ...], ...]] = []
        for cmds in batch:
            n = next((i for i, cmd in enumerate(cmds) if not _stdin_safe(cmd)), len(cmds))
            heads.append(cmds[:n])
            tails.append(cmds[n:])
        errors = self._scontrol_script(heads)
        todo = [i for i, tail in enumerate(tails) if tail and errors[i] is None]
        if len(todo) == 1:
            errors[todo[0]] = _error_of(self._scontrol_again, tails[todo[0]])
        elif todo:
            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                for i, error in zip(
                    todo, pool.map(lambda i: _error_of(self._scontrol_again, tails[i]), todo), strict=True
                ):
                    errors[i] = error
        return errors

    def _scontrol_script(self, heads: list[tuple[tuple[str, ...], ...]]) -> list[Exception | None]:
        lines = [cmd for head in heads for cmd in head]
        if len(lines) <= 1:
            error = _error_of(self.run, "scontrol", *lines[0]) if lines else None
            return [error if head else None for head in heads]
        script = "".join(" ".join(_scontrol_word(a) for a in cmd) + "\n" for cmd in lines)
        if _error_of(self.run, "scontrol", stdin=script + "quit\n", retries=0) is None:
            return [None] * len(heads)
        # Which line failed is not told: each caller's commands again on their own, in order. They are
        # idempotent, but for a requeue, which finds its jobs requeued by the batch already ("pending").
        return [_error_of(self._scontrol_again, head) if head else None for head in heads]

    def _scontrol_again(self, cmds: tuple[tuple[str, ...], ...]) -> None:
        for cmd in cmds:
            try:
                self.run("scontrol", *cmd)
            except StepError as exc:
                if cmd[0] != "requeue" or "pending" not in str(exc).lower():
                    raise

    def _scancel_batch(self, items: list[tuple[str, tuple[str, ...]]]) -> list[Exception | None]:
        errors: list[Exception | None] = [None] * len(items)
        for signal in dict.fromkeys(sig for sig, _ in items):
            mine = [i for i, (sig, _) in enumerate(items) if sig == signal]
            ids = list(dict.fromkeys(j for i in mine for j in items[i][1]))
            flag = f"--signal={signal}"
            if _error_of(self.run, "scancel", "--batch", flag, *ids, retries=0) is not None:
                for i in mine:  # which job failed is not told: each caller's jobs on their own
                    errors[i] = _error_of(self.run, "scancel", "--batch", flag, *items[i][1])
        return errors


def _error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Exception | None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def drain_node(slurm: Slurm, node: str, reason: str, *, dry_run: bool = False, sinfo: Any = None) -> StepResult:
    """Drain `node` with an owned reason; never over a reason fleetheal does not own. `sinfo`: a node read
    taken after the caller was asked to act (default: a new one)."""
    info = slurm_nodes.read(slurm.sinfo() if sinfo is None else sinfo).get(node)
    if info is None:
        raise StepError(f"Slurm does not know node {node}")
    if info.drained and not info.reason_owned():
        return StepResult(
            "slurm_drain",
            "skipped",
            f"{node} is already drained with reason '{info.reason}', which fleetheal does not own: left as it is",
        )
    if info.drained:
        return StepResult("slurm_drain", "done", f"{node} is already drained by fleetheal: '{info.reason}'")
    if dry_run:
        return StepResult("slurm_drain", "would", f"would drain {node} with reason '{reason}'")
    slurm.scontrol("update", f"nodename={node}", "state=DRAIN", f"reason={reason}")
    return StepResult("slurm_drain", "done", f"drained {node} with reason '{reason}'", changed=True)


def signal_jobs(slurm: Slurm, job_ids: Sequence[str], signal: str, *, dry_run: bool = False) -> StepResult:
    """One `scancel --batch --signal` for every job at once (it reaches each batch script in ~0.03 s)."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return StepResult("slurm_signal", "skipped", "no active job to signal")
    if dry_run:
        return StepResult("slurm_signal", "would", f"would send {signal} to jobs [{', '.join(ids)}]")
    slurm.scancel_signal(signal, ids)
    return StepResult("slurm_signal", "done", f"sent {signal} to jobs [{', '.join(ids)}]", changed=True)


def append_job_log(path: str, line: str, uid: int) -> str:
    """Append `line` to a job's output file once (O_APPEND: the running job keeps writing to the same file),
    as its owner could: the file must be a regular file owned by the job's `uid`, opened without following
    a symlink, so a job cannot point its log at a file of someone else's (the remediator's database, a
    system file). Returns what was done, or raises StepError saying why not."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # not even opened: opening a device can act on it
            raise StepError(f"not writing to {path}: it is not a regular file")
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StepError(f"cannot open the job log {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r+b") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
            raise StepError(
                f"not writing to {path}: it is not a regular file of the job's user (uid {uid}) with one link"
            )
        data = line.encode() + b"\n"
        if st.st_size <= 4 << 20 and data in (b"\n" + fh.read()):
            return f"{path} already tells it"
        fh.write(data)
    return f"appended to {path}"


def tell_jobs(
    slurm: Slurm, node: str, incident: str, cause: str, *, job_id: str = "", dry_run: bool = False
) -> list[StepResult]:
    """REFUSE_AND_REPORT: put `cause` in the job's comment and its log, and change nothing else.

    The job is `job_id` when the alert names it. Without one, only a node running a single job tells it
    (the fault can only be that job's); with several, none is told: a guess would rewrite other users'
    jobs. A comment already naming the incident is left as it is."""
    jobs = target_jobs(slurm.squeue(), node, job_id)
    if not jobs:
        why = f"job {job_id} is not active on {node}" if job_id else f"no active job on {node}"
        return [StepResult("job_comment", "skipped", why)]
    if not job_id and len(jobs) > 1:
        ids = ", ".join(j["job_id"] for j in jobs)
        return [
            StepResult(
                "job_comment",
                "skipped",
                f"{len(jobs)} jobs run on {node} ({ids}) and the alert names none: none is told",
            )
        ]
    out = []
    for job in jobs:
        jid = job["job_id"]
        if dry_run:
            would = f"would tell job {jid}: '{cause}' (comment and {job['stdout']})"
            out.append(StepResult("job_comment", "would", would))
            continue
        changed = f"incident={incident}" not in job["comment"].split()
        if changed:
            slurm.scontrol("update", f"jobid={jid}", f"comment={cause}{_launch_words(job)}")
        told = "comment" if changed else "comment already names the incident"
        if job["stdout"]:
            try:
                appended = append_job_log(job["stdout"], cause, int(job["uid"]))
                changed = changed or appended.startswith("appended")
                told += "; " + appended
            except StepError as exc:
                told += f"; log not written: {exc}"
        out.append(StepResult("job_comment", "done", f"told job {jid}: '{cause}' ({told})", changed=changed))
    return out


@dataclass(frozen=True)
class RequeuePlan:
    """What `requeue_plan` decided: results for the jobs left alone, the jobs to requeue, their priority."""

    results: list[StepResult]
    jobs: list[dict[str, Any]]
    priority: int
    node: str = ""


def requeue_plan(slurm: Slurm, node: str, incident: str, *, job_id: str = "", squeue: Any = None) -> RequeuePlan:
    """The jobs an action on `node` hits, less those already requeued for `incident` (their comment names
    it), submitted with --no-requeue, or at their restart limit (each of those gets a result saying why)."""
    s = slurm.settings
    doc = squeue if squeue is not None else slurm.squeue()
    jobs = target_jobs(doc, node, job_id)
    if not jobs:
        what = f"job {job_id} is not active on {node}" if job_id else f"no active job on {node}"
        return RequeuePlan([StepResult("slurm_requeue", "skipped", what)], [], 0, node)
    results: list[StepResult] = []
    act: list[dict[str, Any]] = []
    for job in jobs:
        jid = job["job_id"]
        if f"incident={incident}" in job["comment"].split() and not _shrink_pending(job, node):
            results.append(
                StepResult("slurm_requeue", "done", f"job {jid} was already requeued for incident {incident}")
            )
        elif not job["requeue"]:
            results.append(
                StepResult("slurm_requeue", "skipped", f"job {jid} not requeued: submitted with --no-requeue")
            )
        elif restarts(job) >= s.max_restarts:
            why = f"restart limit reached ({restarts(job)} of {s.max_restarts}) counting restarts in the job"
            results.append(StepResult("slurm_requeue", "skipped", f"job {jid} not requeued: {why}"))
        else:
            act.append(job)
    return RequeuePlan(results, act, min(slurm_max_priority(doc) + s.priority_boost, MAX_PRIORITY), node)


def restarts(job: Mapping[str, Any]) -> int:
    """Every restart the retry limit counts: Slurm's requeues and the launcher's restarts in the job."""
    return int(job["restart_cnt"]) + _in_job_restarts(job["comment"])


def _in_job_restarts(comment: str) -> int:
    return launch.word_count(comment, launch.RESTARTS_WORD) or 0


def _launch_words(job: Mapping[str, Any], *, restarted: bool = False) -> str:
    """The comment words a new comment keeps: the job's checkpoint store, and `fleetheal launch`'s (with one
    more restart in the job)."""
    comment = job["comment"]
    store = [w for w in comment.split() if w.startswith(contracts.CHECKPOINT_WORD)][:1]
    if launch.TAG not in comment.split():
        return " " + store[0] if store else ""
    words = [*store, launch.TAG]
    needed = launch.needed_nodes(comment)
    if needed is not None:
        words.append(f"{launch.NODES_WORD}{needed}")
    in_job = _in_job_restarts(comment) + (1 if restarted else 0)
    if in_job:
        words.append(f"{launch.RESTARTS_WORD}{in_job}")
    return " " + " ".join(words)


def can_shrink(job: Mapping[str, Any], node: str) -> bool:
    """A job run by `fleetheal launch --nodes N` that still has N nodes without `node`, and whose batch
    script (the launcher) does not run on `node`, is relocated inside its allocation instead of requeued."""
    words = job["comment"].split()
    needed = launch.needed_nodes(job["comment"])
    rest = [n for n in job["nodes"] if n != node]
    return (
        launch.TAG in words
        and needed is not None
        and node in job["nodes"]
        and bool(job["batch_host"])
        and job["batch_host"] != node
        and len(rest) >= needed
    )


def _shrink_pending(job: Mapping[str, Any], node: str) -> bool:
    """The order to shrink `node` away is in the job's comment, but the node is still allocated to it
    (the step stopped between the order and the shrink): the shrink is done again."""
    return launch.word_value(job["comment"], launch.SHRINK_WORD) == node and node in job["nodes"]


def shrink_in_job(slurm: Slurm, job: Mapping[str, Any], node: str, incident: str, fault_id: str) -> StepResult:
    """Relocate a job inside its allocation: the incident and the node to drop go into its comment, the
    restart order to its launcher, then `node` leaves the allocation. The launcher restarts the command on
    the nodes that remain (it waits for the shrink); no requeue, no scheduler, no credential wait."""
    jid = job["job_id"]
    rest = [n for n in job["nodes"] if n != node]
    needed = launch.needed_nodes(job["comment"])
    comment = (
        f"{contracts.DRAIN_REASON_PREFIX} shrunk away from {node} after {fault_id}"
        f"{_launch_words(job, restarted=True)} {launch.SHRINK_WORD}{node} incident={incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    slurm.scontrol("update", f"jobid={jid}", "nodelist=" + ",".join(rest))
    return StepResult(
        "slurm_requeue",
        "done",
        f"relocated job {jid} inside its allocation: {node} shrunk away, restarted on {','.join(rest)} "
        f"({needed} needed; fleetheal launch)",
        changed=True,
    )


def requeue_now(
    slurm: Slurm, plan: RequeuePlan, node: str, incident: str, fault_id: str, *, same_nodes: bool = False
) -> list[StepResult]:
    """Requeue the planned jobs with one command, then boost each one's priority and name the incident in
    its comment. A job relocated away from `node` has it excluded; a job restarted in place keeps its
    nodes, and its start waits for Slurm's own begin time after a requeue (the credentials of its previous
    run must have expired on those nodes: starting sooner is refused with "Job credential revoked")."""
    s = slurm.settings
    results: list[StepResult] = []
    jobs = plan.jobs
    if same_nodes:
        in_job = [j for j in jobs if launch.TAG in j["comment"].split()]
        jobs = [j for j in jobs if j not in in_job]
        results = [restart_in_job(slurm, j, node, incident, fault_id) for j in in_job]
    else:
        shrunk = [j for j in jobs if can_shrink(j, node)]
        jobs = [j for j in jobs if j not in shrunk]
        results = [shrink_in_job(slurm, j, node, incident, fault_id) for j in shrunk]
    if not jobs:
        return results
    comment = f"{contracts.DRAIN_REASON_PREFIX} requeued after {fault_id} on {node} incident={incident}"
    commands: list[tuple[str, ...]] = [("requeue", ",".join(j["job_id"] for j in jobs))]
    for job in jobs:
        # The boost and the comment (a job run by `fleetheal launch` keeps the words that say so) go to
        # the job once it is pending again, in the same batch as its requeue.
        args = [
            "update",
            f"jobid={job['job_id']}",
            f"priority={plan.priority}",
            f"comment={comment}{_launch_words(job)}",
        ]
        args.append("reqnodelist=" + ",".join(job["nodes"]) if same_nodes else f"excnodelist={node}")
        commands.append(tuple(args))
    slurm.scontrol_seq(commands)
    for job in jobs:
        where = " on " + ",".join(job["nodes"]) if same_nodes else ""
        # fleetheal.remediator.engine.REQUEUED reads the job id back from this text: keep them in step.
        detail = f"sent {s.grace_signal} to job {job['job_id']}, requeued it{where} with priority {plan.priority}"
        results.append(StepResult("slurm_requeue", "done", detail, changed=True))
    return results


def restart_in_job(slurm: Slurm, job: dict[str, Any], node: str, incident: str, fault_id: str) -> StepResult:
    """Restart a job run by `fleetheal launch` inside its allocation: no requeue, no credential wait.

    The incident goes into the job's comment first, then the restart order (SIGUSR2 to the batch step,
    which is the launcher); the launcher restarts once per incident, so sending it twice is harmless.
    """
    jid = job["job_id"]
    comment = (
        f"{contracts.DRAIN_REASON_PREFIX} restarted in job after {fault_id} on {node}"
        f"{_launch_words(job, restarted=True)} incident={incident}"
    )
    slurm.scontrol("update", f"jobid={jid}", f"comment={comment}")
    slurm.scancel_signal(launch.RESTART_SIGNAL.name.removeprefix("SIG"), [jid])
    where = ",".join(job["nodes"])
    return StepResult(
        "slurm_requeue", "done", f"restarted job {jid} in its allocation on {where} (fleetheal launch)", changed=True
    )


def requeue_would(slurm: Slurm, plan: RequeuePlan, *, same_nodes: bool = False) -> list[StepResult]:
    """What a dry run reports for the planned jobs."""
    s = slurm.settings

    def would(j: dict[str, Any]) -> str:
        then = f"wait {s.grace_seconds:g} s"
        if same_nodes and launch.TAG in j["comment"].split():
            return f"would send {s.grace_signal} to job {j['job_id']}, {then}, restart it in its allocation"
        if not same_nodes and can_shrink(j, plan.node):
            return (
                f"would send {s.grace_signal} to job {j['job_id']}, {then}, shrink {plan.node} away from its "
                "allocation and restart it on the rest"
            )
        where = " on " + ",".join(j["nodes"]) if same_nodes else ""
        return (
            f"would send {s.grace_signal} to job {j['job_id']}, {then}, requeue it{where} with priority {plan.priority}"
        )

    return [StepResult("slurm_requeue", "would", would(j)) for j in plan.jobs]


def requeue_jobs(
    slurm: Slurm,
    node: str,
    incident: str,
    fault_id: str,
    *,
    job_id: str = "",
    same_nodes: bool = False,
    dry_run: bool = False,
) -> list[StepResult]:
    """Grace signal (every job at once), grace period, requeue and priority boost: `requeue_plan`,
    `signal_jobs`, the grace period, `requeue_now`. (The first responder runs the same sequence with an
    asynchronous grace period, so that waiting holds no thread.)"""
    s = slurm.settings
    plan = requeue_plan(slurm, node, incident, job_id=job_id)
    if dry_run:
        return plan.results + requeue_would(slurm, plan, same_nodes=same_nodes)
    if not plan.jobs:
        return plan.results
    signalled = signal_jobs(slurm, [j["job_id"] for j in plan.jobs], s.grace_signal)
    if s.grace_seconds > 0:
        time.sleep(s.grace_seconds)
    return [*plan.results, signalled, *requeue_now(slurm, plan, node, incident, fault_id, same_nodes=same_nodes)]


_PROMOTE_LOCK = threading.Lock()
#: Standby nodes this process promoted -> when their resume ended (infinity while it runs), guarded by
#: _PROMOTE_LOCK. A `sinfo` read that started before then may still show the node as standby, so in that
#: read it is not free: concurrent promotions (the first responder's, across incidents) never pick the
#: same node, and they share their reads.
_CLAIMED: dict[str, float] = {}


def promote_standby(
    slurm: Slurm, node: str, incident: str, *, dry_run: bool = False, read: tuple[float, Any] | None = None
) -> StepResult:
    """Resume one warm-standby node (drained with the owned standby reason) in place of `node`, once per
    incident (the promoted node's Extra field names it). `read`: `Slurm.sinfo_at()` taken after the caller was
    asked to act (default: a new one); promotions claimed since it was taken are not picked again."""
    s = slurm.settings
    taken, read_nodes = slurm.sinfo_at() if read is None else read
    nodes = slurm_nodes.read(read_nodes)
    with _PROMOTE_LOCK:
        done = nodes.with_extra(f"incident={incident}")
        if done:
            detail = f"{', '.join(done)} already promoted for incident {incident}"
            return StepResult("standby_promote", "done", detail, node=done[0])
        for name in [n for n, ended in _CLAIMED.items() if ended < taken]:
            del _CLAIMED[name]  # this read shows what its resume did
        free = [n for n in nodes.with_reason(s.standby_reason) if n != node and n not in _CLAIMED]
        if not free:
            return StepResult(
                "standby_promote", "skipped", f"no standby node (drained with reason '{s.standby_reason}') to promote"
            )
        pick = free[0]
        if dry_run:
            k8s = (
                f", label it {contracts.LABEL_POOL}=active and remove its {contracts.TAINT_STANDBY} taint"
                if s.kubernetes
                else ""
            )
            detail = f"would promote standby node {pick} (resume it{k8s}) in place of {node}"
            return StepResult("standby_promote", "would", detail, node=pick)
        _CLAIMED[pick] = float("inf")
    # In the node's Extra field, not its comment: Slinky's operator rewrites the comment with its pod's identity.
    record = f"{contracts.DRAIN_REASON_PREFIX} promoted for {node} incident={incident}"
    try:
        slurm.scontrol("update", f"nodename={pick}", "state=RESUME", f"extra={record}")
    except BaseException:
        with _PROMOTE_LOCK:  # not resumed: free again
            _CLAIMED.pop(pick, None)
        raise
    with _PROMOTE_LOCK:
        _CLAIMED[pick] = time.monotonic()
    detail = f"promoted standby node {pick} in place of {node}"
    return StepResult("standby_promote", "done", detail, changed=True, node=pick)


# --- Kubernetes ---------------------------------------------------------------------------------------------


class Kube:
    """The Node changes the steps make, through the official client, guarded by resourceVersion."""

    #: Connections kept to the API server: a storm's first responses patch Nodes concurrently, and every
    #: connection the pool cannot keep costs the next request a TLS handshake.
    CONNECTIONS = 64
    #: Seconds for one request (the client has no default: a stopped API server would hold a step, and
    #: the thread running it, for good).
    TIMEOUT_S = 10.0

    @staticmethod
    def preload() -> None:
        """Import the parts of the client a Kube uses. `kubernetes.client` imports its APIs lazily, on first
        use, and building CoreV1Api's validated methods costs about a second of CPU: a process that forks
        workers (Ansible's controller) preloads, so that each worker does not pay it again."""
        from kubernetes import client, config  # noqa: F401

        _ = (client.Configuration, client.ApiClient, client.CoreV1Api, client.VersionApi, client.exceptions)

    def __init__(self, settings: Settings) -> None:
        from kubernetes import client, config

        conf = client.Configuration()
        if settings.kubeconfig:
            config.load_kube_config(config_file=settings.kubeconfig, client_configuration=conf)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
        conf.connection_pool_maxsize = self.CONNECTIONS
        # No silent retries inside the client (urllib3's default is 3, so a stopped API server held each
        # call for 4 timeouts): a step fails in TIMEOUT_S, and the remediator waits for the API server to
        # answer before it retries the attempt.
        conf.retries = 0
        self.core = client.CoreV1Api(client.ApiClient(conf))
        self._exc = client.exceptions.ApiException

    def unavailable(self) -> str | None:
        """None when the API server answers (`GET /version`), else why not."""
        import urllib3
        from kubernetes import client

        try:
            client.VersionApi(self.core.api_client).get_code(_request_timeout=5)
        except (urllib3.exceptions.HTTPError, OSError, self._exc) as exc:
            return f"kubernetes API server: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return None

    def update_node(self, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Read Node `name`, let `change` return a merge patch (or None: nothing to do), apply it with the
        read resourceVersion; a conflict reads again. True when a patch was applied."""
        for _ in range(5):
            try:
                # The raw JSON: the client's models cost milliseconds per Node, and a storm reads hundreds.
                raw = self.core.read_node(name, _preload_content=False, _request_timeout=self.TIMEOUT_S)
                doc = json.loads(raw.data)  # type: ignore[attr-defined]
            except self._exc as exc:
                raise StepError(f"kubernetes: read Node {name}: {exc.status} {exc.reason}") from exc
            patch = change(doc)
            if patch is None:
                return False
            patch.setdefault("metadata", {})["resourceVersion"] = doc["metadata"]["resourceVersion"]
            try:
                self.core.patch_node(name, patch, _preload_content=False, _request_timeout=self.TIMEOUT_S)
            except self._exc as exc:
                if exc.status == 409:
                    continue
                raise StepError(f"kubernetes: patch Node {name}: {exc.status} {exc.reason}") from exc
            return True
        raise StepError(f"kubernetes: Node {name} kept changing (5 conflicts)")


def _taints_without(doc: Mapping[str, Any], key: str) -> list[dict[str, Any]]:
    return [t for t in (doc.get("spec", {}).get("taints") or []) if t.get("key") != key]


def k8s_isolate(kube: Kube | None, node: str, fault_id: str, *, dry_run: bool = False) -> StepResult:
    """Cordon `node` and taint it `fleetheal.io/unhealthy=<fault>:NoSchedule` (one patch). The pods'
    eviction under their PodDisruptionBudgets is the follow-up playbook's (it may take minutes)."""
    if kube is None:
        return StepResult("k8s_cordon", "skipped", f"no Kubernetes API configured: cordon of {node} skipped")
    taint = {"key": contracts.TAINT_UNHEALTHY, "value": fault_id, "effect": "NoSchedule"}
    if dry_run:
        return StepResult(
            "k8s_cordon", "would", f"would cordon {node} and taint it {contracts.TAINT_UNHEALTHY}={fault_id}"
        )

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        spec = doc.get("spec", {})
        mine = [t for t in spec.get("taints") or [] if t.get("key") == contracts.TAINT_UNHEALTHY]
        if spec.get("unschedulable") and mine:
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_FAULT: fault_id}},
            "spec": {
                "unschedulable": True,
                "taints": _taints_without(doc, contracts.TAINT_UNHEALTHY) + (mine or [taint]),
            },
        }

    changed = kube.update_node(node, change)
    what = "cordoned and tainted" if changed else "already cordoned and tainted"
    return StepResult("k8s_cordon", "done", f"{node} {what} {contracts.TAINT_UNHEALTHY}", changed=changed)


def _pods_to_evict(pods: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], list[str]]:
    """What `kubectl drain --ignore-daemonsets --delete-emptydir-data` evicts: (namespace, name) of every
    pod but mirror pods and DaemonSet pods; and the pods no controller manages, which it refuses to
    evict (nothing would recreate them)."""
    evict: list[tuple[str, str]] = []
    unmanaged: list[str] = []
    for pod in pods:
        meta = pod.get("metadata", {})
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
            continue
        owners = meta.get("ownerReferences") or []
        finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if not owners and not finished:
            unmanaged.append(f"{ns}/{name}")
        elif finished or not any(o.get("kind") == "DaemonSet" for o in owners):
            evict.append((ns, name))
    return evict, unmanaged


def k8s_drain(
    kube: Kube | None, node: str, *, timeout_s: float, poll_s: float = 1.0, dry_run: bool = False
) -> StepResult:
    """Evict the pods on `node` through the Eviction API, so that their PodDisruptionBudgets apply, wait up
    to `timeout_s` for them to be gone, then label the node `fleetheal.io/pool=quarantine`. An eviction a
    budget refuses (HTTP 429) fails the step with the server's message, naming the budget (the playbook
    retries exactly that); the node then stays in its pool. Run after `k8s_isolate` (cordoned: nothing
    lands there meanwhile)."""
    if kube is None:
        return StepResult("k8s_drain", "skipped", f"no Kubernetes API configured: drain of {node} skipped")
    if dry_run:
        return StepResult(
            "k8s_drain", "would", f"would evict the pods on {node} and label it {contracts.LABEL_POOL}=quarantine"
        )

    def on_node() -> list[dict[str, Any]]:
        try:
            raw = kube.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _preload_content=False, _request_timeout=kube.TIMEOUT_S
            )
        except kube._exc as exc:
            raise StepError(f"kubernetes: list the pods on {node}: {exc.status} {exc.reason}") from exc
        return list(json.loads(raw.data).get("items") or [])  # type: ignore[attr-defined]

    evict, unmanaged = _pods_to_evict(on_node())
    if unmanaged:
        raise StepError(
            f"kubernetes: {node} runs pods no controller manages, which a drain would lose: {', '.join(unmanaged)}; "
            "move or delete them, then run the playbook again"
        )
    for ns, name in evict:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
        try:
            kube.core.create_namespaced_pod_eviction(
                name,
                ns,
                body,  # type: ignore[arg-type]
                _preload_content=False,
                _request_timeout=kube.TIMEOUT_S,
            )
        except kube._exc as exc:
            if exc.status == 404:
                continue
            try:
                message = json.loads(exc.body or "{}").get("message", "")
            except ValueError:
                message = ""
            raise StepError(f"Failed to delete pod {ns}/{name}: {exc.status} {exc.reason}: {message}") from exc
    deadline = time.monotonic() + timeout_s
    evicted = set(evict)
    left = evicted
    while left:
        left = {(p["metadata"].get("namespace", ""), p["metadata"].get("name", "")) for p in on_node()} & evicted
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    labelled = kube.update_node(
        node,
        lambda doc: (
            None
            if (doc.get("metadata", {}).get("labels") or {}).get(contracts.LABEL_POOL) == "quarantine"
            else {"metadata": {"labels": {contracts.LABEL_POOL: "quarantine"}}}
        ),
    )
    detail = f"{len(evict)} pod(s) evicted from {node}"
    if left:
        names = ", ".join(sorted(f"{ns}/{name}" for ns, name in left))
        detail += f", {len(left)} still terminating after {timeout_s:.0f} s ({names})"
    detail += f"; {contracts.LABEL_POOL}=quarantine"
    return StepResult("k8s_drain", "done", detail, changed=bool(evict) or labelled)


def k8s_promote(kube: Kube | None, node: str, *, dry_run: bool = False) -> StepResult:
    """Label a promoted standby Node `fleetheal.io/pool=active` and remove its standby taint."""
    if kube is None or not node:
        return StepResult("k8s_promote", "skipped", f"no Kubernetes API configured: promotion of {node} skipped")
    if dry_run:
        return StepResult("k8s_promote", "would", f"would label {node} {contracts.LABEL_POOL}=active")

    def change(doc: dict[str, Any]) -> dict[str, Any] | None:
        labels = doc.get("metadata", {}).get("labels") or {}
        taints = doc.get("spec", {}).get("taints") or []
        if labels.get(contracts.LABEL_POOL) == "active" and not any(
            t.get("key") == contracts.TAINT_STANDBY for t in taints
        ):
            return None
        return {
            "metadata": {"labels": {contracts.LABEL_POOL: "active"}},
            "spec": {"taints": _taints_without(doc, contracts.TAINT_STANDBY)},
        }

    changed = kube.update_node(node, change)
    return StepResult(
        "k8s_promote", "done", f"{node} labelled {contracts.LABEL_POOL}=active, standby taint removed", changed=changed
    )


def kube_for(settings: Settings) -> Kube | None:
    return Kube(settings) if settings.kubernetes else None


_SLURM_OUTAGE = (" is DOWN", "timed out", "Unable to contact", "Connection refused", "TimeoutExpired")


class Dependencies:
    """Whether what the steps act through answers now: slurmctld (`scontrol ping`) and, when configured, the
    Kubernetes API server (`/version`). The remediator asks before it retries a failed playbook attempt."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.slurm = Slurm(settings)
        self._kube: Kube | None = None

    def unavailable(self) -> dict[str, str]:
        """{dependency: why} for each one that does not answer (empty: all answer)."""
        down = {}
        try:
            self.slurm.run("scontrol", "ping", retries=0)
        except StepError as exc:
            # An outage is a controller that is DOWN or does not answer. A client with no configuration at
            # all (no Slurm here: tests with stand-in playbooks) is not waited for.
            if any(word in str(exc) for word in _SLURM_OUTAGE):
                down["slurm"] = " ".join(str(exc).split())[:200]
        if self.settings.kubernetes:
            self._kube = self._kube or Kube(self.settings)
            why = self._kube.unavailable()
            if why:
                down["kubernetes"] = why
        return down
