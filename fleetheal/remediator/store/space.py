"""Room on the SQLite database's disk: no action starts whose outcome could not be recorded (issue 46).

SQLite on a full disk refuses the write (SQLITE_FULL) and changes nothing. An action used to start with a
few MB free; its playbook ran, the disk filled meanwhile (the write-ahead log grows by up to its checkpoint
size, about 4 MB, before it is reused; ansible-runner's run directories sit next to the database by
default), and the write of its outcome failed: the incident stayed `acting`, and at the next start its
attempt, with no end, was taken for one a stop had interrupted, so the playbook ran again ("interrupted
(remediator stopped during the run)").

Two guards, SQLite only (PostgreSQL's disk is the server's; its "disk full" is a DiskFull all the same):

- Before an action starts (stages.py asks `Database.ensure_room` where it checks the lead), the reserve must
  be in place and ACTION_MARGIN_BYTES free besides, for the action's own records (its step, its events);
  otherwise DiskFull: the incident waits (retried with backoff) and /healthz is degraded with the reason
  (`Room.problem`), until space is freed. The write-ahead log's growth (up to about 4 MB before it is reused)
  is not asked for: the reserve is what makes the outcome safe, and a small disk can still act.
- The reserve: a file of RESERVE_BYTES next to the database (`<database>.reserve`, random bytes, so that a
  compressing file system stores all of them). When the write of an action's outcome meets a full disk
  (`Database.write(..., reserve=True)`), the reserve is deleted and the write tried once more. From then
  until the reserve can be made again (`Room.problem` makes it as soon as the space allows), only outcomes
  are written: every other write (new alerts: 503, Alertmanager retries; the state machine: retried later)
  fails with DiskFull, so that it cannot take the room the outcomes of actions still running need.

While the disk is full, the events of an action in progress are logged instead of recorded (stages.py): the
action goes on and its outcome is written. A snapshot that keeps the reserve's blocks (ZFS, LVM, btrfs)
frees nothing when the reserve is deleted: there, only the check before an action helps.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

#: The reserve kept next to the database: room for the outcomes of the actions running when the disk fills
#: (an outcome is a transaction of a few pages, about 12 KiB of write-ahead log: some 80 fit).
RESERVE_BYTES = 1 << 20
#: Free space an action needs to start, besides the reserve: its step, run directory and first events.
ACTION_MARGIN_BYTES = 256 << 10


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Room:
    """The free space of one SQLite database's directory and its reserve. Thread-safe."""

    def __init__(
        self, path: str, *, reserve_bytes: int = RESERVE_BYTES, margin_bytes: int = ACTION_MARGIN_BYTES
    ) -> None:
        self.directory = os.path.dirname(os.path.abspath(path))
        self.reserve_path = f"{path}.reserve"
        self.reserve_bytes = reserve_bytes
        self.margin_bytes = margin_bytes
        #: When the reserve was given up to record an outcome; None while it is in place (or never made yet).
        self.released_at: float | None = None
        self._lock = threading.Lock()

    def free(self) -> int:
        """Bytes an unprivileged writer may still use on the database's file system."""
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def problem(self) -> str | None:
        """Why no action may start now (None: one may). Makes the reserve where it is missing and the space
        allows (at start-up, and once space was freed after it was used)."""
        with self._lock:
            need = self.margin_bytes
            try:
                free = self.free()
                reserved = self._reserved()
                if not reserved and free >= need + self.reserve_bytes:
                    reserved = self._make_reserve()
                    free = self.free()
            except OSError as exc:
                return f"disk: cannot check the free space of {self.directory}: {exc.strerror}"
            if reserved:
                self.released_at = None
                if free >= need:
                    return None
            used = ""
            if self.released_at is not None:
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.released_at))
                used = f"; the reserve kept to record outcomes was used at {when}"
            return (
                f"disk full: {mib(free)} free for the database in {self.directory}, an action needs "
                f"{mib(need + (0 if reserved else self.reserve_bytes))} ({mib(need)} for its records"
                + ("" if reserved else f", {mib(self.reserve_bytes)} for the reserve that keeps room for outcomes")
                + f"){used}: no action starts until space is freed"
            )

    def exhausted(self) -> bool:
        """True while the reserve was given up for an outcome and cannot be made again yet: only the outcomes
        of actions are written then."""
        if self.released_at is None:
            return False
        self.problem()  # makes it again where the space allows
        return self.released_at is not None

    def release(self) -> bool:
        """Delete the reserve to make room for an outcome; False when there was none to delete."""
        with self._lock:
            try:
                os.unlink(self.reserve_path)
            except FileNotFoundError:
                return False
            self.released_at = time.time()
            return True

    def _reserved(self) -> bool:
        try:
            return os.stat(self.reserve_path).st_size >= self.reserve_bytes
        except FileNotFoundError:
            return False

    def _make_reserve(self) -> bool:
        tmp = f"{self.reserve_path}.tmp"
        try:
            with open(tmp, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(os.urandom(self.reserve_bytes))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.reserve_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True
