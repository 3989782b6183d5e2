"""Playbook run directories and the processes in them: pruning old run directories, and killing what still
runs of an interrupted attempt (a crash, a lost lead) so that a retry never runs beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Collection

from fleetheal import procs

#: What prune_run_dirs may remove: <run_dir>/inc-NNNNNN/step<S>-attempt<A>/ (nothing else is touched).
_INCIDENT_DIR = re.compile(r"inc-[0-9]{6,}")
_RUN_DIR = re.compile(r"step[0-9]+-attempt[0-9]+")
#: The count limit (runner.keep_runs) never removes a run directory younger than this.
PRUNE_MIN_AGE_S = 3600.0

log = logging.getLogger("fleetheal.remediator.runner")


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


def process_start_time(pid: int) -> int | None:
    """When `pid` started (milliseconds since the epoch), to tell a reused pid apart; None when it is gone."""
    started = procs.start_time(pid)
    return None if started is None else round(started * 1000)


def kill_leftovers(run_dir: str, timeout_s: float = 5.0) -> list[int]:
    """Kill what still runs of an interrupted step (after a crash), so a retry never runs beside it."""
    if not run_dir:
        return []
    marker = os.path.join(os.path.abspath(run_dir), "")
    pids = list(procs.pids_mentioning(marker))  # the private run dir of an interrupted step
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return procs.wait_gone(pids, timeout_s)
