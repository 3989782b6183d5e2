"""A throwaway PostgreSQL on loopback, from Debian's packages: the tests' and benchmarks' shared store.

`Postgres(base).start()` runs initdb (once) and the server in the background, listening on TCP only
(127.0.0.1, and 127.0.0.2 so that a test can cut one client's route with a firewall rule), with a
password (SCRAM) like a production database. `stop()`, `restart()` and `kill()` stop it by PID. PostgreSQL
refuses to run as root: as root, it runs as the `postgres` user the Debian package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Self

from fleetheal.lab.monitoring import free_port
from fleetheal.lab.supervisor import Supervisor
from fleetheal.wait import WaitTimeout, wait_until

USER = "fleetheal"
PASSWORD = "fleetheal-test-password"  # noqa: S105 - a loopback test database
DATABASE = "fleetheal"


class PostgresError(RuntimeError):
    """PostgreSQL is missing or did not start; the message says which and how to fix it."""


def bindir() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise PostgresError("PostgreSQL is not installed: apt-get install postgresql (scripts/bootstrap.sh does)")
    return Path(found[-1]).parent


class Postgres(Supervisor):
    def __init__(self, base: str | Path, port: int | None = None) -> None:
        self.base = Path(base)
        self.data = self.base / "data"
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._bin = bindir()
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresError("running as root needs the `postgres` user (Debian's postgresql package)") from None
            self._as = ["runuser", "-u", "postgres", "--"]

    def url(self, host: str = "127.0.0.1", database: str = DATABASE) -> str:
        return f"postgresql://{USER}:{PASSWORD}@{host}:{self.port}/{database}"

    def _run(self, *cmd: str) -> None:
        result = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise PostgresError(f"{' '.join(cmd[:2])} failed: {(result.stderr or result.stdout).strip()[-2000:]}")

    def start(self, timeout: float = 60.0) -> Self:
        self.base.mkdir(parents=True, exist_ok=True)
        if self._as:
            shutil.chown(self.base, "postgres", "postgres")
        if not (self.data / "PG_VERSION").exists():
            pwfile = self.base / "pwfile"
            pwfile.write_text(PASSWORD + "\n")
            if self._as:
                shutil.chown(pwfile, "postgres", "postgres")
            pwfile.chmod(0o600)
            self._run(
                str(self._bin / "initdb"), "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}",
                "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-instructions",
            )  # fmt: skip
            pwfile.unlink()
        log = open(self.base / "postgres.log", "ab")  # noqa: SIM115 - the server's, closed by the child's exit
        self.proc = subprocess.Popen(
            [
                *self._as, str(self._bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1,127.0.0.2", "-c", "unix_socket_directories=",
                "-c", "max_connections=200", "-c", "log_min_messages=warning",
            ],
            stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise PostgresError("the server exited")
            with psycopg.connect(self.url(database="postgres"), connect_timeout=2, autocommit=True) as conn:
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                    conn.execute(f"CREATE DATABASE {DATABASE}")
            return True

        try:
            wait_until(ready, timeout, f"PostgreSQL on 127.0.0.1:{self.port}", ignore=(psycopg.Error,))
        except (WaitTimeout, PostgresError) as exc:
            tail = (self.base / "postgres.log").read_text(errors="replace")[-2000:]
            self.stop()
            raise PostgresError(f"PostgreSQL did not start on 127.0.0.1:{self.port}: {exc}\n{tail}") from exc

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> None:
        """Stop the server (SIGINT: PostgreSQL's fast shutdown; SIGKILL: a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def drop(self) -> None:
        """Stop and remove everything."""
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
