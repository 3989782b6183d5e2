"""Process and port helpers shared by everything that starts and stops daemons (the lab, its Slurm and
monitoring harnesses, the remediator's clean-up of interrupted playbooks, tests and benchmarks).

Processes are read through psutil; this module is the one place that looks at other processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterable

import psutil

from fleetheal.wait import WaitTimeout, wait_until


def alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie counts as gone)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except (psutil.Error, ValueError):
        return False


def start_time(pid: int) -> float | None:
    """When `pid` started (seconds since the epoch), to tell a reused pid apart; None when it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" when it is gone or unreadable)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, ValueError):
        return ""


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (children, their children, ...), with its command line."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except (psutil.Error, ValueError):
        return {}
    return {kid.pid: cmdline(kid.pid) for kid in kids}


def pids_mentioning(text: str) -> dict[int, str]:
    """Every other process whose command line contains `text`, with its command line."""
    me = os.getpid()
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if proc.pid != me and text in line:
            found[proc.pid] = line
    return found


def namespace_processes(pid: int) -> dict[int, str]:
    """Every process in the PID namespace of `pid` (as this namespace numbers them), with its command line.

    psutil does not name namespaces: this reads the /proc/PID/ns/pid link of each process.
    """
    try:
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return {}
    out = {}
    for other in psutil.pids():
        try:
            if os.readlink(f"/proc/{other}/ns/pid") != ns:
                continue
        except OSError:
            continue
        out[other] = cmdline(other)
    return out


def wait_gone(pids: Iterable[int], timeout: float, *, reap: bool = False) -> list[int]:
    """Wait up to `timeout` seconds for `pids` to exit (a zombie counts as gone; with `reap`, those that are
    this process's children are reaped); return those still running then."""
    left = list(pids)

    def gone() -> bool:
        nonlocal left
        for pid in left if reap else ():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        left = [p for p in left if alive(p)]
        return not left

    with contextlib.suppress(WaitTimeout):
        wait_until(gone, timeout, f"processes {left} to exit", interval=0.05)
    return left


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group of `pid`, SIGKILL it after `timeout` seconds; return once it is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        if not wait_gone([pid], wait, reap=True):
            return


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
