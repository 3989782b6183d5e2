"""The one way fleetheal runs a Slurm command (`scontrol`, `squeue`, `sinfo`, `scancel`, `sacctmgr`, `sbatch`...).

A `Runner` holds which binaries (a bin dir, or each command's own path), their environment, the timeout and
the retries; each caller configures its own (the remediator's steps retry as the playbooks do, the agent's
fast path has a short timeout and no retry) and picks how a failure reaches it:

- `checked`: the output, or the runner's `error` naming the command, its exit status and what it said;
- `read`: what a read printed and why not all of it (a `-M all` read that reached some clusters is usable);
- `completed`: the finished process as it is, for a caller that reads the exit status itself.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Run = Callable[..., "subprocess.CompletedProcess[str]"]


class SlurmError(RuntimeError):
    """A Slurm command failed (the default `Runner.error`)."""


@dataclass(frozen=True)
class Read:
    """What one Slurm client printed; `error` says why it printed nothing usable for some cluster."""

    out: str
    error: str = ""


@dataclass(frozen=True)
class Runner:
    """Slurm's commands, run with one configuration."""

    #: Where the commands are ("" for $PATH, or a command given as a path).
    bin_dir: str = ""
    #: Their environment (None: this process's).
    env: Mapping[str, str] | None = None
    #: Seconds a command may run (None: no limit; `sbatch` of a user's submission).
    timeout_s: float | None = 30.0
    #: Tries after the first of `checked`, `retry_delay_s` apart.
    retries: int = 0
    retry_delay_s: float = 2.0
    #: What `checked` raises.
    error: type[Exception] = SlurmError
    #: How much of what a failed command said goes into the error (None: all of it).
    said_chars: int | None = None
    #: `subprocess.run` or a stand-in (None: `subprocess.run`, looked up at each call).
    run: Run | None = None
    sleep: Callable[[float], None] = time.sleep

    def argv(self, command: str, *args: str) -> list[str]:
        prefix = (self.bin_dir.rstrip("/") + "/") if self.bin_dir else ""
        return [prefix + command, *args]

    def completed(self, command: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run it once; OSError and subprocess.TimeoutExpired are the caller's."""
        run = self.run or subprocess.run
        kwargs: dict[str, Any] = {"input": stdin} if stdin is not None else {}
        return run(
            self.argv(command, *args),
            env=None if self.env is None else dict(self.env),
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=False,
            **kwargs,
        )

    def checked(self, command: str, *args: str, stdin: str | None = None, retries: int | None = None) -> str:
        """Its output; after the retries, `error` naming the command and what it said. A command fed `stdin`
        (scontrol reading commands) also fails when it says anything on stderr: it exits 0 regardless."""
        name = os.path.basename(command)
        tries = 1 + (self.retries if retries is None else retries)
        last = ""
        for attempt in range(tries):
            try:
                proc = self.completed(command, *args, stdin=stdin)
            except (OSError, subprocess.TimeoutExpired) as exc:
                last = f"{name}: {exc}"
            else:
                if proc.returncode == 0 and not (stdin and proc.stderr.strip()):
                    return proc.stdout
                said = (proc.stderr.strip() or proc.stdout.strip())[: self.said_chars]
                last = f"{name} {' '.join(args)} exited {proc.returncode}: {said}"
            if attempt + 1 < tries:
                self.sleep(self.retry_delay_s)
        raise self.error(last)

    def read(self, command: str, *args: str) -> Read:
        """Run a read; a non-zero exit keeps what it printed (the clusters it reached) and its first error line."""
        name = self.argv(command)[0]
        try:
            proc = self.completed(command, *args)
        except FileNotFoundError:
            return Read("", f"{name} not found")
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return Read(out, f"{name} did not finish in {self.timeout_s or 0:g}s")
        first = next((ln.strip() for ln in proc.stderr.splitlines() if ln.strip()), "")
        return Read(proc.stdout, first if proc.returncode else "")
