"""Slinky's real slurm-operator in the lab: the operator on the lab's Kubernetes control plane, driving a lab
Slurm through that Slurm's own slurmrestd, as Slinky runs it.

`make tools` builds the operator (tools/slurm-operator, v1.1.0) and copies the CRDs it serves
(`operator_crds()`). `SlurmOperator` runs it outside the cluster, on a kubeconfig, with `DEBUG=1`: the
operator's own switch for that case, which makes it call slurmrestd at http://localhost:6820 instead of at
the RestApi's Service. `Slurmrestd` serves a `SlurmCluster` there, with JWT authentication: the operator
signs its tokens (user `slurm`) with the key of the Controller's `jwtHs256KeyRef` Secret, so the cluster
needs `AuthAltTypes=auth/jwt` with that key (`jwt_conf`) and `slurm_user="slurm"` (only SlurmUser and
root may drain a node).

Only one lab operator can run per machine: port 6820 is the operator's, fixed. A second one (a second test
session) waits for the first to stop, on a lock of the port (`_port_lock`).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Self

from fleetheal.lab.slurm import SlurmCluster, find_tool
from fleetheal.lab.supervisor import Supervisor, log_tail, spawn, wait_ready
from fleetheal.procs import alive, free_ports, stop_pid
from fleetheal.tools import tools_dir, tools_share
from fleetheal.wait import wait_until

#: The operator's slurmrestd URL with DEBUG=1 (internal/controller/slurmclient: http://localhost:<SlurmrestdPort>).
RESTAPI_PORT = 6820
OPERATOR = "slurm-operator"


class SlinkyLabError(RuntimeError):
    """The operator or slurmrestd is missing, did not start, or port 6820 is taken."""


def operator_crds() -> list[Path]:
    """The CRDs of the slurm-operator `make tools` built, as its module ships them."""
    files = sorted((tools_share() / OPERATOR / "crds").glob("*.yaml"))
    if not files:
        raise SlinkyLabError(f"no CRDs in {tools_share() / OPERATOR / 'crds'}: run `make tools`")
    return files


def operator_built() -> bool:
    """True when `make tools` has built the slurm-operator and copied its CRDs."""
    try:
        operator_crds()
    except SlinkyLabError:
        return False
    return os.access(tools_dir() / OPERATOR, os.X_OK)


def jwt_conf(key_file: Path) -> list[str]:
    """slurm.conf lines that accept tokens signed with `key_file` beside munge."""
    return ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={key_file}"]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to listen on
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


#: The machine-wide lock of port 6820, and how many of this process's Slurmrestd hold it (a flock is not
#: re-entrant across open files: a second one in this process would wait for itself).
PORT_LOCK = Path(tempfile.gettempdir()) / f"fleetheal-slurmrestd-{RESTAPI_PORT}.lock"
_held_here = 0


def _port_lock(wait_s: float, path: Path = PORT_LOCK) -> IO[str]:
    """Hold the machine-wide lock of port 6820 (flock on `path`): a lab operator of another process on this
    machine (a second test session) is waited for, up to `wait_s`, instead of failing on the port."""
    # Never through a symlink (the temporary directory is everyone's) and never truncating what is there.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    lock = os.fdopen(fd, "r+")
    try:
        wait_until(lambda: _try_flock(lock), wait_s, f"the lock of port {RESTAPI_PORT} (another lab's operator)",
                   interval=0.5)  # fmt: skip
    except BaseException:
        lock.close()
        raise
    return lock


def _try_flock(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class Slurmrestd(Supervisor):
    """slurmrestd for `cluster` on 127.0.0.1:6820, JWT only, as uid/gid 65534 (it refuses root)."""

    def __init__(self, cluster: SlurmCluster, log: Path) -> None:
        self.cluster = cluster
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    def start(self, timeout: float = 30.0, wait_s: float = 1800.0) -> Self:
        global _held_here  # noqa: PLW0603 - one count per process, like the flock it stands for
        if _held_here == 0:  # else this process's own slurmrestd has the port: refused below, at once
            self._lock = _port_lock(wait_s)  # another process's lab operator goes first
            _held_here += 1
        try:
            return self._start(timeout)
        except BaseException:
            self._unlock()
            raise

    def _start(self, timeout: float) -> Self:
        if not _port_free(RESTAPI_PORT):
            raise SlinkyLabError(f"127.0.0.1:{RESTAPI_PORT} is taken: another lab operator or slurmrestd runs here")
        # SLURM_JWT=daemon: slurmrestd hands each request's token on to slurmctld (Slurm's jwt.html).
        env = {**self.cluster.env, "SLURM_JWT": "daemon"}
        argv = [find_tool("slurmrestd"), "-a", "rest_auth/jwt", "-u", "65534", "-g", "65534"]
        self.proc = spawn([*argv, f"127.0.0.1:{RESTAPI_PORT}"], self.log, env=env)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise SlinkyLabError(f"slurmrestd exited ({self.proc.returncode}):\n{log_tail(self.log)}")
            return _listening(RESTAPI_PORT)

        try:
            wait_until(answers, timeout, "slurmrestd to listen", interval=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, timeout=10)
            self.proc.wait()
            self.proc = None
        self._unlock()

    def _unlock(self) -> None:
        global _held_here  # noqa: PLW0603
        if self._lock is not None:
            self._lock.close()  # closing the file releases its flock
            self._lock = None
            _held_here -= 1


class SlurmOperator(Supervisor):
    """The slurm-operator process, on `kubeconfig`, with the command-line `args` a Deployment gives it.

    The probe and metrics addresses are moved to loopback (a later flag wins), and the operator calls
    slurmrestd at http://localhost:6820 (DEBUG=1).
    """

    def __init__(self, kubeconfig: Path, args: Sequence[str], log: Path, *, bin_dir: Path | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.args = list(args)
        self.log = log
        self.bin = (bin_dir or tools_dir()) / OPERATOR
        self.pid: int | None = None
        self.health_port = 0

    def start(self, timeout: float = 60.0) -> Self:
        if not os.access(self.bin, os.X_OK):
            raise SlinkyLabError(f"{self.bin} not found: run `make tools`")
        self.health_port = free_ports(1)[0]
        argv = [str(self.bin), *self.args, f"--health-addr=127.0.0.1:{self.health_port}", "--metrics-addr=0"]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "DEBUG": "1"}
        proc = spawn(argv, self.log, env=env)
        self.pid = proc.pid
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        try:
            wait_ready(OPERATOR, url, lambda: proc.poll() is None, self.log, timeout=timeout, error=SlinkyLabError)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def running(self) -> bool:
        return self.pid is not None and alive(self.pid)

    def stop(self) -> None:
        if self.pid is not None:
            stop_pid(self.pid, timeout=15)
            self.pid = None
