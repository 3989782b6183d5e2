"""Process and port helpers shared by everything that starts and stops daemons (the lab, its Slurm and
monitoring harnesses, the remediator's clean-up of interrupted playbooks, tests and benchmarks).

Processes are read through psutil (/proc directly where psutil is too slow or does not tell: the marked
processes, start ticks, namespaces); this module is the one place that looks at other processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable

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


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat): exact and fixed for the
    process's life, so a pid and this tell one process from a later one with the same pid, from any
    process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields from the 3rd on; the name may hold ")"
    except (OSError, ValueError, IndexError):
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


def _marked(name: str, accept: Callable[[str], bool]) -> dict[int, tuple[int, str]]:
    """pid -> (start ticks, value) of what `marked` finds. Read from /proc directly: psutil takes five times
    as long, and the run's end and every round of `terminate_marked` look."""
    me = os.getpid()
    needle = name.encode() + b"="
    ticks: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # from the state on (the name may hold ")")
            if fields[0] in (b"Z", b"X"):
                continue
            ticks[pid] = int(fields[19])
            children.setdefault(int(fields[1]), []).append(pid)
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except (OSError, ValueError, IndexError):  # gone, or another user's
            continue
        if needle in env:
            for item in env.split(b"\0"):
                if item.startswith(needle):
                    value = item[len(needle) :].decode(errors="replace")
                    if accept(value):
                        found[pid] = value
                    break
    below = list(found)
    while below:
        pid = below.pop()
        for kid in children.get(pid, ()):
            if kid not in found:
                found[kid] = found[pid]
                below.append(kid)
    return {pid: (ticks[pid], value) for pid, value in found.items()}


def marked(name: str, accept: Callable[[str], bool] = lambda value: True) -> dict[int, str]:
    """Every other live process whose environment sets `name` to a value `accept` takes, and every process
    below one of those, with that value (its marked ancestor's for one below).

    A variable set when a process is started is inherited by everything it starts, through fork, exec,
    setsid and double forks alike, unlike a process group or a parent: it marks a whole tree even once
    parts of it detached. Only a process started with a cleared environment (`env -i`, sudo) drops it;
    while its parent lives it is found below it. The environments of other users' processes are not
    readable (nor are they this process's to signal)."""
    return {pid: value for pid, (_, value) in _marked(name, accept).items()}


#: Seconds between two looks for the processes `terminate_marked` stops: each look reads every process's
#: environment, and a replica losing the lead stops all its runs at once, one look each; looked for every
#: 0.05 s, they kept a loaded machine's cores busy while the next leader took over (a suspect of a CI failure
#: of tests/remediator/test_ha.py, not proven).
RESCAN_S = 0.2


def terminate_marked(
    name: str, accept: Callable[[str], bool] = lambda value: True, grace: float = 3.0, timeout: float = 5.0
) -> list[int]:
    """Stop what `marked(name, accept)` finds: SIGTERM, and after `grace` seconds SIGKILL for what is still
    there; the processes are looked for again until none is left (one started meanwhile is signalled too)
    or `timeout` seconds after the SIGKILL. Returns the pids still there then ([] normally). A pid is
    signalled only while its start time is the one seen when it was found (never a reused pid)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, timeout)):
        deadline = time.monotonic() + wait
        signalled: set[tuple[int, int]] = set()
        while True:
            found = _marked(name, accept)
            if not found:
                return []
            for pid, (ticks, _) in found.items():
                if ((pid, ticks) not in signalled or sig == signal.SIGKILL) and start_ticks(pid) == ticks:
                    with contextlib.suppress(OSError):
                        os.kill(pid, sig)
                    signalled.add((pid, ticks))
            if time.monotonic() >= deadline:
                break
            time.sleep(RESCAN_S)
    return sorted(marked(name, accept))


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
