"""Run remediation playbooks through ansible-runner. The only module that imports `ansible_runner`.

One run serves a batch of step attempts of the same playbook (one per incident, each on its own node):
each incident is one host of the inventory group `fleetheal_incidents` (local connection, the
incident's variables as its host variables), and Ansible's forks run them side by side, so 150
follow-ups cost one ansible-playbook start-up instead of 150. A host's result is its own: the others
failing does not fail it. A human runs the same playbook with `-e fleetheal_node=...` on the group
`fleetheal_control` instead (the playbooks' `hosts:` line).

Each run gets its own private data directory, the one of its first step attempt
(`<run_dir>/<incident>/step<S>-attempt<A>/`): ansible-runner rewrites the inventory there and passes any
`env/extravars` it finds to later runs, so a shared directory would leak one run's variables into the next.

What reaches Ansible:
- variables: only the names in `contracts.PLAYBOOK_VARS`, with values the alert validator let through
  (checked again here: plain names, booleans, small counts), as host variables of the incident's host
  in `inventory/hosts.json`; the site settings (`runner.site_vars`, never a per-incident name) as extra
  variables in `env/extravars`, except the secret ones (`secret_site_vars`: names ending in `_token`,
  `_password`, `_passphrase`, `_secret`, `_credentials`, `_api_key`, `_private_key`, and those listed in
  `runner.secret_vars`). Those never touch a run directory: they go to a 0600 file in memory (/dev/shm)
  outside it, given as `-e @file` and removed the moment ansible-playbook has read it (its first
  event, `playbook_on_start`) or when the run ends; a crash leaves one only until the next start-up;
- environment: the allow-listed variables of `runner.env_passthrough`, `runner.envvars` and what
  ansible-runner sets for itself. Anything whose name looks like a secret, and any value equal to a
  known secret (the bearer token), is dropped before the runner writes its `command` artifact, which
  otherwise stores the whole environment.
Events are scrubbed of every known secret value (the bearer token, secret environment variables, secret
site settings) before ansible-runner writes them; after the run every artifact file is scrubbed once more
(what a careless task without `no_log` printed to `stdout`).

The processes of a run: ansible-runner starts ansible-playbook in a session (and process group) of its
own, and Ansible's workers each call setsid: a forked worker, the module it runs and the commands that
module starts (a drain, a requeue) are in the worker's session, not ansible-playbook's. ansible-runner
stops a canceled or timed-out run by SIGKILL of ansible-playbook's group alone, which leaves Ansible no
chance to pass the signal on (its SIGTERM handler does): the workers and their commands ran on, orphaned,
and nothing killed them later (their command lines do not name the run directory, so
`rundirs.kill_leftovers` missed them). So every process of a run carries the environment variable
`RUN_MARKER` (`<owner pid>@<owner start ticks>:<run directory>`, inherited through fork, exec and setsid);
- a canceled (the engine's stop at SIGTERM, a lost lead) or timed-out run is stopped here, not by
  ansible-runner: every marked process gets SIGTERM (Ansible's own hand-on then works), SIGKILL after
  `STOP_GRACE_S`, and the run returns once none is left; whatever still carries the marker when a run
  ends for any reason (an exception too) is stopped the same way;
- after a crash (SIGKILL of the remediator: nothing of that ran), the next start-up (`AnsibleRunner()`)
  stops every marked process under `runner.run_dir` whose owner, the remediator that started it, is gone
  (pid and start time in clock ticks, so a reused pid does not pass for it). A live owner's runs (another
  replica on the host) are never touched.
Remediation playbooks leave no process behind on purpose (a daemon is the service manager's to start).

Run directories are pruned (rundirs.py's `prune_run_dirs`, called by the engine at start-up and hourly):
older than `runner.keep_runs_days` days or beyond the `runner.keep_runs` newest, never one of an
unfinished incident. The secrets' handling is in scrub.py.

Engine-facing API: the engine hands each playbook attempt to `Batcher.run`, which waits for a playbook slot
(`runner.max_concurrent`) with the other attempts of the same playbook and runs them together, at most
`runner.max_hosts_per_run` per run. A batch's run is `AnsibleRunner.run_batch([(request, on_event), ...],
cancel)`, which returns one outcome (or the RunnerInputError that refused it) per request; tests substitute
any object with the same method (see `Runner`). `run(request, on_event, cancel)` is a batch of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetheal import procs
from fleetheal.contracts import PLAYBOOK_VARS
from fleetheal.remediator import config as cfgmod
from fleetheal.remediator.scrub import (
    SECRET_NAME,
    environment_secrets,
    remove_stale_secret_files,
    scrub_tree,
    scrub_value,
    secret_site_vars,
    secret_strings,
    write_secret_file,
)
from fleetheal.remediator.store import incident_ref

#: Values a playbook variable may take: names, ids, indexes (never spaces, quotes, braces or `$`).
_SAFE_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}|")
#: Environment ansible-runner sets for itself; kept when the runner set or changed it.
_RUNNER_PREFIXES = ("ANSIBLE_", "AWX_", "RUNNER_", "ORIGINAL_STDOUT_CALLBACK")
#: The environment variable every process of a run inherits: `<owner pid>@<owner start ticks>:<run dir>`.
RUN_MARKER = "FLEETHEAL_PLAYBOOK_RUN"
#: Seconds a stopped run's processes get between SIGTERM and SIGKILL. Short: a lost lead's fence
#: (`leader_election.fence_timeout_s`, 2 s by default) waits for the runs to end, and the cancel flag is
#: seen up to 0.5 s late (RUNNER_SETTINGS). A command that takes SIGTERM goes at once.
STOP_GRACE_S = 1.0
#: Seconds after the SIGKILL before a process still there is given up on (and logged).
KILL_WAIT_S = 5.0

#: ansible-runner's settings, in the run's `env/settings` (its `settings=` argument is dropped when that file
#: does not exist): the cancel flag and the timeout are looked at every `pexpect_timeout` seconds (5 unset).
RUNNER_SETTINGS = {"pexpect_timeout": 0.5, "suppress_ansible_output": True}

log = logging.getLogger("fleetheal.remediator.runner")


class RunnerInputError(ValueError):
    """A step request that must not reach Ansible (unknown variable, unsafe value, playbook outside)."""


@dataclass(frozen=True, slots=True)
class StepRequest:
    incident_id: int
    step_id: int
    attempt: int
    action: str
    playbook: str  # file name under runner.playbook_dir (from the taxonomy)
    extravars: Mapping[str, str | bool | int]

    @property
    def ref(self) -> str:
        return incident_ref(self.incident_id)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    status: str  # successful | failed | timeout | canceled | error
    rc: int | None
    detail: str
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "successful"


@dataclass(frozen=True, slots=True)
class RunnerEvent:
    kind: str  # process, playbook_start, task_start, task_ok, task_changed, task_failed, unreachable, stats
    detail: str
    pid: int | None = None


#: A step attempt and where its timeline events go.
Run = tuple[StepRequest, Callable[[RunnerEvent], None]]
#: The inventory group of the hosts a batch runs on, one per incident (the playbooks' `hosts:` line).
INCIDENTS_GROUP = "fleetheal_incidents"


class Runner(Protocol):
    def run_batch(self, runs: Sequence[Run], cancel: Callable[[], bool]) -> list[StepOutcome | RunnerInputError]:
        """Run the same playbook for every request at once; one outcome per request, in order."""
        ...


def check_extravars(extravars: Mapping[str, Any]) -> dict[str, str | bool | int]:
    """The variables as they may be given to a playbook; RunnerInputError otherwise."""
    out: dict[str, str | bool | int] = {}
    for name, value in extravars.items():
        if name not in PLAYBOOK_VARS:
            raise RunnerInputError(f"{name!r} is not a playbook variable (contracts.PLAYBOOK_VARS)")
        plain_int = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1_000_000
        plain_str = isinstance(value, str) and _SAFE_VALUE.fullmatch(value) is not None
        if not (isinstance(value, bool) or plain_int or plain_str):
            raise RunnerInputError(f"{name}: value {str(value)[:40]!r} is not a plain name, boolean or count")
        out[name] = value
    return out


def run_dir_for(run_root: str, request: StepRequest) -> Path:
    """The private directory of a run whose first request is `request`."""
    return Path(run_root) / request.ref / f"step{request.step_id}-attempt{request.attempt}"


class AnsibleRunner:
    """Runs the playbook an action maps to, one private directory per step attempt."""

    def __init__(self, cfg: cfgmod.RunnerConfig, secrets: Iterable[str] = ()) -> None:
        self.cfg = cfg
        self.configured = frozenset((*cfg.env_passthrough, *cfg.envvars))
        self.secret_vars = secret_site_vars(cfg)
        self.plain_vars = {k: v for k, v in cfg.site_vars.items() if k not in self.secret_vars}
        site_secrets = [s for v in self.secret_vars.values() for s in secret_strings(v)]
        self.secrets = environment_secrets(os.environ, [*secrets, *site_secrets], self.configured)
        if self.secret_vars:
            remove_stale_secret_files()
        self.owner = f"{os.getpid()}@{procs.start_ticks(os.getpid())}"
        self.stop_orphans()

    def stop_orphans(self) -> list[int]:
        """At start-up: stop what still runs of the playbook runs of a remediator that is gone (a crash, a
        SIGKILL) under `runner.run_dir`; their steps are then resumed. Returns the pids that survived."""
        root = os.path.join(os.path.abspath(self.cfg.run_dir), "")
        owners: dict[str, bool] = {}

        def orphaned(value: str) -> bool:
            owner, _, run = value.partition(":")
            if not run.startswith(root):
                return False
            if owner not in owners:
                pid, _, ticks = owner.partition("@")
                owners[owner] = pid.isdigit() and str(procs.start_ticks(int(pid))) != ticks
            return owners[owner]

        found = procs.marked(RUN_MARKER, orphaned)
        if not found:
            return []
        runs = sorted({value.partition(":")[2] for value in found.values()})
        log.warning("stopping the processes of interrupted playbook runs", extra={"pids": sorted(found), "runs": runs})
        left = procs.terminate_marked(RUN_MARKER, orphaned, STOP_GRACE_S, KILL_WAIT_S)
        if left:
            log.error("processes of interrupted playbook runs survived SIGKILL", extra={"pids": left})
        return left

    def stop_run(self, run_dir: str | Path) -> list[int]:
        """Stop every process of this remediator's run in `run_dir` (SIGTERM, SIGKILL after STOP_GRACE_S) and
        return once none is left; returns the pids that survived SIGKILL (logged)."""
        marker = self.marker(run_dir)
        left = procs.terminate_marked(RUN_MARKER, marker.__eq__, STOP_GRACE_S, KILL_WAIT_S)
        if left:
            log.error("playbook processes survived SIGKILL", extra={"pids": left, "run_dir": str(run_dir)})
        return left

    def marker(self, run_dir: str | Path) -> str:
        """The value of RUN_MARKER in the processes of this remediator's run in `run_dir`."""
        return f"{self.owner}:{os.path.abspath(run_dir)}"

    def warm_up(self) -> None:
        """Import ansible_runner ahead of the first alert (it takes a few hundred milliseconds)."""
        import ansible_runner  # noqa: F401

    # --- inputs ----------------------------------------------------------------------------------------

    def playbook_path(self, playbook: str) -> Path:
        base = Path(self.cfg.playbook_dir).resolve()
        path = (base / playbook).resolve()
        if path.parent != base and base not in path.parents:
            raise RunnerInputError(f"playbook {playbook!r} is outside {base}")
        if not path.is_file():
            raise RunnerInputError(f"playbook {path} does not exist")
        return path

    def environment(self) -> dict[str, str]:
        """What the runner adds to the environment: allow-listed variables, the configured ones, PATH."""
        env = {k: os.environ[k] for k in self.cfg.env_passthrough if k in os.environ}
        env.update(self.cfg.envvars)
        # ansible-playbook lives next to this interpreter (the virtualenv), which may not be on PATH.
        bindir = os.path.dirname(sys.executable)
        path = env.get("PATH", os.defpath)
        if bindir not in path.split(os.pathsep):
            env["PATH"] = bindir + os.pathsep + path
        if self.cfg.ansible_cfg:
            env["ANSIBLE_CONFIG"] = self.cfg.ansible_cfg
        # Names configured on purpose pass; a value equal to a known secret (the token) never does.
        return {k: v for k, v in env.items() if not any(s in v for s in self.secrets)}

    def scrub_env(self, env: Mapping[str, str], added: Mapping[str, str]) -> dict[str, str]:
        """The final environment: ours (`added`) plus what ansible-runner set, nothing else."""
        out: dict[str, str] = {}
        for key, value in env.items():
            ours = key in added
            runners = key.startswith(_RUNNER_PREFIXES) and os.environ.get(key) != value
            if not (ours or runners):
                continue
            if (not ours and SECRET_NAME.search(key)) or any(s in value for s in self.secrets):
                continue
            out[key] = value
        return out

    def _prepare_dir(self, first: StepRequest, hosts: Mapping[str, Mapping[str, Any]]) -> Path:
        private = run_dir_for(self.cfg.run_dir, first)
        if private.exists():  # a leftover of a crash before this attempt was recorded: start clean
            shutil.rmtree(private)
        (private / "env").mkdir(parents=True, mode=0o700)
        (private / "inventory").mkdir(mode=0o700)
        os.chmod(private.parent, 0o700)
        for path, doc in (
            (private / "env" / "extravars", self.plain_vars),  # the secret ones never come here
            (private / "env" / "settings", RUNNER_SETTINGS),
            (private / "inventory" / "hosts.json", {INCIDENTS_GROUP: {"hosts": hosts}}),
        ):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, sort_keys=True)
        return private

    # --- the run ---------------------------------------------------------------------------------------

    def run(
        self, request: StepRequest, on_event: Callable[[RunnerEvent], None], cancel: Callable[[], bool]
    ) -> StepOutcome:
        """One request alone (a batch of one); RunnerInputError when it is refused."""
        (outcome,) = self.run_batch([(request, on_event)], cancel)
        if isinstance(outcome, RunnerInputError):
            raise outcome
        return outcome

    def run_batch(self, runs: Sequence[Run], cancel: Callable[[], bool]) -> list[StepOutcome | RunnerInputError]:
        outcomes: list[StepOutcome | RunnerInputError | None] = [None] * len(runs)
        hosts: dict[str, dict[str, Any]] = {}
        handlers: dict[str, Callable[[RunnerEvent], None]] = {}
        for i, (request, on_event) in enumerate(runs):
            try:
                incident_vars = check_extravars(request.extravars)
                if request.playbook != runs[0][0].playbook or request.ref in hosts:
                    raise RunnerInputError(f"{request.ref}: a batch runs one playbook, one attempt per incident")
                playbook = self.playbook_path(request.playbook)
            except RunnerInputError as exc:
                outcomes[i] = exc
                continue
            hosts[request.ref] = {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                **incident_vars,
            }
            handlers[request.ref] = on_event
        if not hosts:
            return [o for o in outcomes if o is not None]
        first = next(r for r, _ in runs if r.ref in hosts)
        private = self._prepare_dir(first, hosts)

        import ansible_runner  # only here: importing it costs ~0.3 s and the agent never needs it

        added = self.environment()
        seen_pid: list[int] = []
        stats: dict[str, Any] = {}
        secrets = self.secrets
        # The secret site settings: a 0600 file outside the run directory, in memory where possible,
        # removed once ansible-playbook has read its extra vars (they are read before its first play).
        secret_file = write_secret_file(self.secret_vars) if self.secret_vars else None

        def forget_secret_file() -> None:
            if secret_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(secret_file)

        def handler(event: dict[str, Any]) -> bool:
            if event.get("event") == "playbook_on_start":
                forget_secret_file()
            scrub_value(event, secrets)
            pid = event.get("pid")
            if isinstance(pid, int) and not seen_pid:
                seen_pid.append(pid)
                for cb in handlers.values():
                    cb(RunnerEvent("process", f"ansible-playbook pid {pid}", pid))
            if event.get("event") == "playbook_on_stats":
                stats.update(event.get("event_data") or {})
            converted = _convert_event(event)
            if converted is not None:
                host = (event.get("event_data") or {}).get("host")
                for cb in [handlers[host]] if host in handlers else handlers.values():
                    cb(converted)
            return True  # keep the (scrubbed) event in the artifacts

        # Stopping a canceled or timed-out run is ours (see the module's doc): ansible-runner is told to
        # cancel only once every process of the run is gone.
        stopped: list[str] = []
        deadline = time.monotonic() + self.cfg.timeout_s

        def stop_now() -> bool:
            if not stopped:
                if cancel():
                    stopped.append("canceled")
                elif time.monotonic() >= deadline:
                    stopped.append("timeout")
                else:
                    return False
                self.stop_run(private)
            return True

        inventory = str(private / "inventory")
        try:
            rc = ansible_runner.RunnerConfig(
                private_data_dir=str(private),
                playbook=str(playbook),
                # A site inventory (group variables, say) comes first; the incidents' hosts are always ours.
                inventory=[self.cfg.inventory, inventory] if self.cfg.inventory else inventory,
                roles_path=self.cfg.roles_path,
                envvars=added,
                # Only the file's name reaches the command line (and the `command` artifact).
                cmdline=None if secret_file is None else f"-e {shlex.quote('@' + secret_file)}",
                ident="run",
                forks=len(hosts),
                quiet=True,
                suppress_env_files=True,
            )
            rc.prepare()
            rc.env = self.scrub_env(rc.env, added)
            rc.env[RUN_MARKER] = self.marker(private)
            runner = ansible_runner.Runner(config=rc, event_handler=handler, cancel_callback=stop_now)
            runner.run()
        finally:
            self.stop_run(private)  # normally nothing is left (after an exception: all of the run)
            forget_secret_file()
            scrub_tree(private, secrets)
        status = stopped[0] if stopped else str(runner.status)
        together = f" (one run for {len(hosts)} incidents)" if len(hosts) > 1 else ""
        for i, (request, _) in enumerate(runs):
            if outcomes[i] is None:
                host_status, detail = _host_outcome(status, runner.rc, stats, request.ref, self.cfg.timeout_s)
                outcomes[i] = StepOutcome(host_status, runner.rc, detail + together, str(private))
        return [o for o in outcomes if o is not None]


def _host_outcome(status: str, rc: int | None, stats: Mapping[str, Any], host: str, timeout_s: int) -> tuple[str, str]:
    """One host's result in a run: its own failures count, the other hosts' do not."""
    if status in ("successful", "failed") and stats:
        if host in (stats.get("failures") or {}) or host in (stats.get("dark") or {}):
            return "failed", f"playbook failed (rc {rc})"
        if host not in (stats.get("processed") or {}):
            return "failed", "playbook never ran on this incident's host (no host matched)"
        return "successful", "playbook succeeded"
    return status, {
        "successful": "playbook succeeded",
        "failed": f"playbook failed (rc {rc})",
        "timeout": f"playbook killed after {timeout_s} s",
        "canceled": "playbook canceled",
    }.get(status, f"runner status {status}")


def _convert_event(event: Mapping[str, Any]) -> RunnerEvent | None:
    name = event.get("event")
    data = event.get("event_data") or {}
    task = str(data.get("task") or "")[:200]
    host = str(data.get("host") or "")[:100]
    if name == "playbook_on_start":
        return RunnerEvent("playbook_start", str(data.get("playbook") or "")[:200])
    if name == "playbook_on_task_start":
        return RunnerEvent("task_start", task)
    if name == "runner_on_ok":
        changed = bool((data.get("res") or {}).get("changed"))
        return RunnerEvent("task_changed" if changed else "task_ok", f"{task} ({host})")
    if name == "runner_on_failed":
        res = data.get("res") or {}
        msg = str(res.get("msg") or res.get("stderr") or "")[:300]
        ignored = " (ignored)" if data.get("ignore_errors") else ""
        return RunnerEvent("task_failed", f"{task} ({host}){ignored}: {msg}")
    if name == "runner_on_unreachable":
        return RunnerEvent("unreachable", f"{task} ({host})")
    if name == "playbook_on_stats":
        keys = ("ok", "changed", "failures", "dark", "skipped", "rescued")
        counts = {k: sum((data.get(k) or {}).values()) for k in keys if isinstance(data.get(k), dict)}
        return RunnerEvent("stats", " ".join(f"{k}={v}" for k, v in counts.items()))
    return None


# --- batching ----------------------------------------------------------------------------------------------

#: Once a playbook slot is free, how long the attempts of one playbook gather before they run together.
BATCH_WINDOW_S = 0.25
#: One outcome per attempt of a batch (or the RunnerInputError that refused it).
Outcomes = list[StepOutcome | RunnerInputError]


class Batcher:
    """In the engine's loop: attempts of the same playbook waiting for a playbook slot run together, as one
    run in the first attempt's directory, each with its own outcome. `execute` runs a batch in a playbook
    thread (the engine's fenced call of `Runner.run_batch`); `shared_dir(step_id, run_dir)` records where an
    attempt ran when that is another attempt's directory; `spawn` starts a task the engine cancels at stop."""

    def __init__(
        self,
        cfg: cfgmod.RunnerConfig,
        *,
        execute: Callable[[list[Run]], Outcomes],
        shared_dir: Callable[[int, str], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self.cfg = cfg
        self._execute = execute
        self._shared_dir = shared_dir
        self._spawn = spawn
        self._executor = ThreadPoolExecutor(max_workers=cfg.max_concurrent, thread_name_prefix="playbook")
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self._waiting: dict[str, list[tuple[Run, asyncio.Future[Any]]]] = {}  # playbook -> attempts

    async def run(self, run: Run) -> StepOutcome:
        """Wait for a slot with the other attempts of the same playbook; run with them; this one's outcome."""
        done: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
        playbook = run[0].playbook
        waiting = self._waiting.setdefault(playbook, [])
        waiting.append((run, done))
        if len(waiting) == 1:  # nobody is gathering this playbook's attempts yet
            self._spawn(self._gather(playbook), f"playbook-{playbook}")
        return await done

    def close(self) -> None:
        """At the engine's stop: wait for the running batches' threads; queued ones never start."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _gather(self, playbook: str) -> None:
        waiting = self._waiting[playbook]
        while waiting:
            await self._slots.acquire()
            await asyncio.sleep(BATCH_WINDOW_S)
            batch = waiting[: self.cfg.max_hosts_per_run]
            del waiting[: len(batch)]
            self._spawn(self._run_batch(batch), f"playbook-{playbook}-run")
        del self._waiting[playbook]  # no await since the loop's test: nothing joined in between

    async def _run_batch(self, batch: list[tuple[Run, asyncio.Future[Any]]]) -> None:
        try:
            outcomes: list[StepOutcome | Exception]
            try:  # whatever fails here (the database too) is every attempt's outcome: none waits forever
                run_dir = str(run_dir_for(self.cfg.run_dir, batch[0][0][0]))
                for (request, _), _ in batch[1:]:  # a batch runs in its first attempt's directory
                    self._shared_dir(request.step_id, run_dir)
                loop = asyncio.get_running_loop()
                runs = [run for run, _ in batch]
                outcomes = [*await loop.run_in_executor(self._executor, self._execute, runs)]
            except Exception as exc:
                outcomes = [exc] * len(batch)
            for (_, done), outcome in zip(batch, outcomes, strict=True):
                if done.done():
                    continue
                if isinstance(outcome, BaseException):
                    done.set_exception(outcome)
                else:
                    done.set_result(outcome)
        finally:
            self._slots.release()
