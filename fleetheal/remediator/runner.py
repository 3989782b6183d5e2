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

Run directories are pruned (`prune_run_dirs`, called by the engine at start-up and hourly): older than
`runner.keep_runs_days` days or beyond the `runner.keep_runs` newest, never one of an unfinished incident.

Engine-facing API: `AnsibleRunner.run_batch([(request, on_event), ...], cancel)` returns one outcome (or
the RunnerInputError that refused it) per request; tests substitute any object with the same method (see
`Runner`). `run(request, on_event, cancel)` is a batch of one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetheal import procs
from fleetheal.contracts import PLAYBOOK_VARS
from fleetheal.remediator import config as cfgmod
from fleetheal.remediator.store import incident_ref

#: Values a playbook variable may take: names, ids, indexes (never spaces, quotes, braces or `$`).
_SAFE_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}|")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH", re.IGNORECASE)
#: Environment ansible-runner sets for itself; kept when the runner set or changed it.
_RUNNER_PREFIXES = ("ANSIBLE_", "AWX_", "RUNNER_", "ORIGINAL_STDOUT_CALLBACK")
MASK = "***"
#: Site settings named so are secrets (`runner.secret_vars` names more): never written to a run directory.
SECRET_SITE_VAR = re.compile(r"_(?:token|password|passphrase|secret|credentials?|api_key|private_key)$")
#: Shorter strings of a secret site setting are not masked in artifacts (they would mask random text),
#: as for secret environment variables (environment_secrets).
_MIN_MASKED = 8
#: The file of a run's secret site settings: <dir>/fleetheal-secret-vars-<pid>-<random>.json (0600).
_SECRET_FILE_PREFIX = "fleetheal-secret-vars-"  # noqa: S105 - a file name, not a password
#: What prune_run_dirs may remove: <run_dir>/inc-NNNNNN/step<S>-attempt<A>/ (nothing else is touched).
_INCIDENT_DIR = re.compile(r"inc-[0-9]{6,}")
_RUN_DIR = re.compile(r"step[0-9]+-attempt[0-9]+")
#: The count limit (runner.keep_runs) never removes a run directory younger than this.
PRUNE_MIN_AGE_S = 3600.0

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


def secret_site_vars(cfg: cfgmod.RunnerConfig) -> dict[str, Any]:
    """The site settings that are secrets: named like one (SECRET_SITE_VAR) or listed in runner.secret_vars."""
    listed = set(cfg.secret_vars)
    return {k: v for k, v in cfg.site_vars.items() if k in listed or SECRET_SITE_VAR.search(k)}


def _secret_strings(value: Any) -> Iterator[str]:
    """Every string of a secret setting worth masking, also as JSON writes it (escaped)."""
    if isinstance(value, str):
        if len(value) >= _MIN_MASKED:
            yield value
            yield json.dumps(value)[1:-1]
            yield json.dumps(value, ensure_ascii=False)[1:-1]
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _secret_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _secret_strings(v)


def secret_vars_dir() -> str:
    """Where the secret settings' file of a run lives: /dev/shm (memory) when usable, else the temp dir."""
    shm = "/dev/shm"  # noqa: S108 - a private 0600 file made by mkstemp
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


def remove_stale_secret_files(directory: str | None = None) -> int:
    """Remove the secret settings' files a dead remediator left (a crash mid-run); how many were removed."""
    directory = directory or secret_vars_dir()
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(_SECRET_FILE_PREFIX):
            continue
        pid_text = entry.name[len(_SECRET_FILE_PREFIX) :].split("-", 1)[0]
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if not pid_text.isdigit() or owner != os.getuid():
            continue
        pid = int(pid_text)
        if pid == os.getpid() or procs.alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed += 1
    return removed


def _write_secret_file(doc: Mapping[str, Any]) -> str:
    fd, path = tempfile.mkstemp(prefix=f"{_SECRET_FILE_PREFIX}{os.getpid()}-", suffix=".json", dir=secret_vars_dir())
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp: 0600, O_EXCL
            json.dump(dict(doc), f, sort_keys=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


# --- pruning ------------------------------------------------------------------------------------------------


def prune_run_dirs(
    run_root: str, keep_days: float, keep: int, busy: Collection[str] = (), now: float | None = None
) -> list[str]:
    """Remove the run directories `<run_root>/inc-NNNNNN/step<S>-attempt<A>/` last modified more than
    `keep_days` days ago, and those beyond the `keep` newest that are older than PRUNE_MIN_AGE_S (0: no
    such limit), then the incident directories this left empty. Never one named in `busy` (a run
    directory, or an incident's directory and so everything below it: the unfinished incidents'). Only
    names of that form are touched and no symlink is followed. Returns the removed run directories."""
    if keep_days <= 0 and keep <= 0:
        return []
    now = time.time() if now is None else now
    protected = {os.path.abspath(p) for p in busy if p}
    root = os.path.abspath(run_root)
    runs: list[tuple[float, str, str]] = []  # (mtime, run dir, incident dir)
    try:
        incidents = [e for e in os.scandir(root) if _INCIDENT_DIR.fullmatch(e.name)]
    except OSError:
        return []
    for inc in incidents:
        if not inc.is_dir(follow_symlinks=False):
            continue
        try:
            entries = [e for e in os.scandir(inc.path) if _RUN_DIR.fullmatch(e.name)]
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                runs.append((st.st_mtime, entry.path, inc.path))
    runs.sort(reverse=True)  # newest first
    removed: list[str] = []
    emptied: set[str] = set()
    for rank, (mtime, path, inc_path) in enumerate(runs):
        if path in protected or inc_path in protected:
            continue
        age = now - mtime
        too_old = keep_days > 0 and age > keep_days * 86400
        too_many = keep > 0 and rank >= keep and age > PRUNE_MIN_AGE_S
        if not (too_old or too_many):
            continue
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("cannot remove an old run directory", extra={"path": path, "error": str(exc)})
            continue
        removed.append(path)
        emptied.add(inc_path)
    for inc_path in emptied:
        with contextlib.suppress(OSError):  # not empty: another run directory is still kept
            os.rmdir(inc_path)
    return removed


# --- processes -------------------------------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """When `pid` started (milliseconds since the epoch), to tell a reused pid apart; None when it is gone."""
    started = procs.start_time(pid)
    return None if started is None else round(started * 1000)


def _processes_using(path: str) -> list[int]:
    """Pids whose command line mentions `path` (the private run dir of an interrupted step)."""
    return list(procs.pids_mentioning(path))


def kill_leftovers(run_dir: str, timeout_s: float = 5.0) -> list[int]:
    """Kill what still runs of an interrupted step (after a crash), so a retry never runs beside it."""
    if not run_dir:
        return []
    marker = os.path.join(os.path.abspath(run_dir), "")
    pids = _processes_using(marker)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return procs.wait_gone(pids, timeout_s)


# --- scrubbing ---------------------------------------------------------------------------------------------


def environment_secrets(
    env: Mapping[str, str], extra: Iterable[str] = (), allowed: Iterable[str] = ()
) -> tuple[str, ...]:
    """Values to keep out of artifacts: `extra` plus every secret-named variable of `env` (8+ chars)
    except the `allowed` names an operator handed to Ansible on purpose."""
    keep = set(allowed)
    values = {v for v in extra if v}
    values.update(v for k, v in env.items() if _SECRET_NAME.search(k) and k not in keep and len(v) >= 8)
    return tuple(sorted(values, key=len, reverse=True))


def _scrub_value(value: Any, secrets: Sequence[str]) -> Any:
    if isinstance(value, str):
        for s in secrets:
            if s in value:
                value = value.replace(s, MASK)
        return value
    if isinstance(value, dict):
        for k in list(value):
            value[k] = _scrub_value(value[k], secrets)
        return value
    if isinstance(value, list):
        return [_scrub_value(v, secrets) for v in value]
    return value


def scrub_tree(root: Path, secrets: Sequence[str]) -> int:
    """Replace secret values in every file under `root`; returns how many files changed."""
    if not secrets:
        return 0
    needles = [s.encode() for s in secrets]
    changed = 0
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        new = data
        for n in needles:
            new = new.replace(n, MASK.encode())
        if new != data:
            path.write_bytes(new)
            changed += 1
    return changed


class AnsibleRunner:
    """Runs the playbook an action maps to, one private directory per step attempt."""

    def __init__(self, cfg: cfgmod.RunnerConfig, secrets: Iterable[str] = ()) -> None:
        self.cfg = cfg
        self.configured = frozenset((*cfg.env_passthrough, *cfg.envvars))
        self.secret_vars = secret_site_vars(cfg)
        self.plain_vars = {k: v for k, v in cfg.site_vars.items() if k not in self.secret_vars}
        site_secrets = [s for v in self.secret_vars.values() for s in _secret_strings(v)]
        self.secrets = environment_secrets(os.environ, [*secrets, *site_secrets], self.configured)
        if self.secret_vars:
            remove_stale_secret_files()

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
            if (not ours and _SECRET_NAME.search(key)) or any(s in value for s in self.secrets):
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
        secret_file = _write_secret_file(self.secret_vars) if self.secret_vars else None

        def forget_secret_file() -> None:
            if secret_file is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(secret_file)

        def handler(event: dict[str, Any]) -> bool:
            if event.get("event") == "playbook_on_start":
                forget_secret_file()
            _scrub_value(event, secrets)
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
                timeout=self.cfg.timeout_s,
                quiet=True,
                suppress_env_files=True,
                settings={"pexpect_timeout": 0.5, "suppress_ansible_output": True},
            )
            rc.prepare()
            rc.env = self.scrub_env(rc.env, added)
            runner = ansible_runner.Runner(config=rc, event_handler=handler, cancel_callback=cancel)
            runner.run()
        finally:
            forget_secret_file()
            scrub_tree(private, secrets)
        status = str(runner.status)
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
