"""Process and port helpers shared by everything that starts and stops daemons (the lab, its Slurm and
monitoring harnesses, the remediator's clean-up of interrupted playbooks, tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time


def alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # the state is the field after the ")" that closes the command name
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group of `pid`, SIGKILL it after `timeout` seconds; return once it is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not alive(pid):
                return
            time.sleep(0.05)


def free_ports(count: int = 1) -> list[int]:
    """`count` distinct TCP ports free right now on all interfaces (held together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
