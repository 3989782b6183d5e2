"""The agent's non-GPU sources: the kernel log and the training-report socket.

Each runs in its own thread until `stop` is set and hands what it reads to callbacks; it never raises
for bad input. A garbled kernel record or a malformed report goes to `on_error` (the service counts it
in `fleetheal_agent_read_errors_total{source=...}`) and reading goes on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: Longest kernel log line handled whole; longer ones are garbled (the kernel caps records at 1 KiB).
MAX_LINE = 64 * 1024
#: Largest training report accepted.
MAX_REPORT = 4096
#: Seconds a log's reader may go without taking a record or finishing a wait for one before the source counts as
#: down (`KernelLogFollower.up`): it waits at most its poll_s (0.1 s), and a line is judged in microseconds, so
#: this long means stuck, in a rule's regular expression or a hung read.
STALLED_S = 30.0


def decode_kmsg_record(record: bytes) -> str | None:
    """The message of one /dev/kmsg record (`pri,seq,usec,flags[,...];message\\n KEY=value...`), or None
    when the record is not in that format."""
    header, sep, rest = record.partition(b";")
    fields = header.split(b",")
    if not sep or len(fields) < 3 or not all(f.strip().isdigit() for f in fields[:3]):
        return None
    message = rest.split(b"\n", 1)[0]
    return message.decode("utf-8", errors="replace")


BOOT_ID = "/proc/sys/kernel/random/boot_id"


class LogPosition:
    """Where the kernel-log follower stopped, kept in a small JSON file so that a restarted agent reads what
    was written while it was down: for /dev/kmsg the boot and the last record's sequence number, for a
    file its inode and byte offset. Saved at most every `every_s` and when the follower stops (atomic
    replace); a lost or unreadable file only means starting at the end, as without one."""

    def __init__(self, path: str, log_path: str, every_s: float = 1.0) -> None:
        self.path = Path(path)
        self.log_path = log_path
        self.every_s = every_s
        self._saved_at = 0.0
        self._pending: dict[str, object] | None = None

    def load(self) -> dict[str, object]:
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) and doc.get("log") == self.log_path else {}

    def update(self, **where: object) -> None:
        self._pending = {"log": self.log_path, **where}
        if time.monotonic() - self._saved_at >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self._pending is None:
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._pending))
        os.replace(tmp, self.path)
        self._pending = None
        self._saved_at = time.monotonic()


def boot_id() -> str:
    try:
        return Path(BOOT_ID).read_text().strip()
    except OSError:
        return ""


class KernelLogFollower:
    """Follow /dev/kmsg (one record per read) or a text file (like `tail -F`: survives rotation and
    truncation), calling `on_line(text)` for every line and `on_error(reason)` for garbled input.

    With a `position` file, a restart resumes where the last run stopped (lines are read at least once: a
    few may be read again after a crash), but never more than `max_backlog` bytes of a file behind its end
    (the skipped part is reported), so a huge backlog cannot stall the start. /dev/kmsg's ring buffer is
    its own bound; records it overwrote while the agent was down are reported lost."""

    def __init__(
        self,
        path: str,
        on_line: Callable[[str], None],
        on_error: Callable[[str], None],
        from_start: bool = False,
        *,
        poll_s: float = 0.1,
        position: str = "",
        max_backlog: int = 8 << 20,
    ) -> None:
        self.path = path
        self.on_line = on_line
        self.on_error = on_error
        self.from_start = from_start
        self.poll_s = poll_s
        self.position = LogPosition(position, path) if position else None
        self.max_backlog = max_backlog
        self.ready = threading.Event()
        #: The log is open (False until it is, and after a read of it failed).
        self.reading = False
        #: When the reader last took a record or finished waiting for one (time.monotonic()).
        self.alive_at = time.monotonic()

    def up(self, now: float | None = None) -> bool:
        """True while the log is read: open, and the reader neither failed nor stuck (in a rule's regular
        expression, say) for STALLED_S. Exported as fleetheal_agent_log_source_up."""
        now = time.monotonic() if now is None else now
        return self.reading and now - self.alive_at < STALLED_S

    def is_kmsg(self) -> bool:
        try:
            return stat.S_ISCHR(os.stat(self.path).st_mode)
        except FileNotFoundError:
            return False

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    if self.is_kmsg():
                        self._follow_kmsg(stop)
                    else:
                        self._follow_file(stop)
                except OSError as exc:
                    self.reading = False
                    self.on_error(f"cannot read {self.path}: {exc}")
                    self.ready.set()
                    stop.wait(5.0)  # the log may appear later (a file created by syslog); keep trying
        finally:
            self._save_now()

    def _save(self, **where: object) -> None:
        if self.position is None:
            return
        try:
            self.position.update(**where)
        except OSError as exc:
            self.on_error(f"cannot save the kernel log position to {self.position.path}: {exc}")

    def _save_now(self) -> None:
        if self.position is None:
            return
        try:
            self.position.flush()
        except OSError as exc:
            self.on_error(f"cannot save the kernel log position to {self.position.path}: {exc}")

    def _follow_kmsg(self, stop: threading.Event) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        boot = boot_id()
        saved = self.position.load() if self.position is not None else {}
        after = -1  # skip records up to this sequence number (read before the restart)
        try:
            seq = saved.get("seq")
            if saved.get("kind") == "kmsg" and saved.get("boot") == boot and isinstance(seq, int):
                after = seq  # the same boot: resume after the last record read
            elif saved.get("kind") == "kmsg" and boot:
                after = -1  # a new boot: every record in the ring is of this boot and unread
            elif not self.from_start:
                os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: skip to the next record written
            self.reading = True
            self.ready.set()
            first = True
            while not stop.is_set():
                self.alive_at = time.monotonic()
                try:
                    record = os.read(fd, 8192)
                except BlockingIOError:
                    self._save_now()
                    select.select([fd], [], [], self.poll_s)
                    continue
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # records were overwritten before we read them
                        self.on_error("kmsg records lost (EPIPE): the ring buffer wrapped")
                        continue
                    raise
                if not record:
                    stop.wait(self.poll_s)
                    continue
                seq = _kmsg_seq(record)
                if seq is not None:
                    if first and 0 <= after < seq - 1:
                        self.on_error(f"kmsg records {after + 1}..{seq - 1} were overwritten while the agent was down")
                    first = False
                    if seq <= after:
                        continue
                    self._save(kind="kmsg", boot=boot, seq=seq)
                text = decode_kmsg_record(record)
                if text is None:
                    self.on_error(f"garbled kmsg record: {record[:80]!r}")
                    continue
                self._line(text.encode(), text)
        finally:
            os.close(fd)

    def _line(self, raw: bytes, text: str | None = None) -> None:
        if text is None:
            if len(raw) > MAX_LINE:
                self.on_error(f"kernel log line of {len(raw)} bytes truncated to {MAX_LINE}")
                raw = raw[:MAX_LINE]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                self.on_error(f"kernel log line is not UTF-8: {raw[:80]!r}")
                text = raw.decode("utf-8", errors="replace")
        if "\x00" in text:
            self.on_error(f"kernel log line contains NUL bytes: {text[:80]!r}")
            text = text.replace("\x00", "")
        self.on_line(text)

    def _start_offset(self, fh: BinaryIO, ino: int) -> None:
        """Where reading this file begins: the saved offset (same inode), else its start after a rotation,
        else its end; never more than max_backlog bytes behind the end (from the next whole line)."""
        size = os.fstat(fh.fileno()).st_size
        saved = self.position.load() if self.position is not None else {}
        offset, at = size, saved.get("offset")
        if saved.get("kind") == "file" and saved.get("ino") == ino and isinstance(at, int):
            offset = at if 0 <= at <= size else 0  # truncated since: from the start
        elif saved.get("kind") == "file" or self.from_start:
            offset = 0  # rotated while the agent was down, or asked to read it all
        if size - offset > self.max_backlog:
            skipped = size - self.max_backlog - offset
            self.on_error(f"{self.path}: {skipped} bytes of backlog skipped (more than {self.max_backlog} behind)")
            fh.seek(size - self.max_backlog)
            fh.readline()  # to the start of the next whole line
            return
        fh.seek(offset)

    def _follow_file(self, stop: threading.Event) -> None:
        while not os.path.exists(self.path):
            self.ready.set()
            if stop.wait(self.poll_s):
                return
        with open(self.path, "rb") as fh:
            ino = os.fstat(fh.fileno()).st_ino
            self._start_offset(fh, ino)
            self.from_start = True  # after a rotation, read the new file from its start
            self.reading = True
            self.ready.set()
            pending = b""
            while not stop.is_set():
                self.alive_at = time.monotonic()
                chunk = fh.readline(MAX_LINE + 1)
                if chunk:
                    pending += chunk
                    if pending.endswith(b"\n") or len(pending) > MAX_LINE:
                        self._line(pending.rstrip(b"\r\n"))
                        pending = b""
                        self._save(kind="file", ino=ino, offset=fh.tell())
                    continue
                self._save_now()
                try:
                    st = os.stat(self.path)
                    if st.st_ino != ino or st.st_size < fh.tell():
                        return  # rotated or truncated: reopen
                except FileNotFoundError:
                    return
                stop.wait(self.poll_s)


def _kmsg_seq(record: bytes) -> int | None:
    fields = record.split(b";", 1)[0].split(b",")
    return int(fields[1]) if len(fields) >= 2 and fields[1].strip().isdigit() else None


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class TrainingReportServer:
    """A Unix datagram socket; each datagram is one report, handed to `on_report(bytes, uid)` with the uid
    of the process that sent it, as the kernel attests it (SO_PASSCRED / SCM_CREDENTIALS: a sender cannot
    claim another uid without the privilege to do so).

    The socket is world-writable on purpose: training jobs run as their users; what a report may cause is
    decided by its sender's uid (`fleetheal.agent.fastpath.JobOwners`). A datagram socket never blocks a
    sender, and a sender sees an error (never a hang) when the agent is not running.
    """

    def __init__(
        self, path: str, on_report: Callable[[bytes, int | None], None], on_error: Callable[[str], None]
    ) -> None:
        self.path = path
        self.on_report = on_report
        self.on_error = on_error
        self.sock: socket.socket | None = None

    def bind(self) -> None:
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if p.is_socket():
                p.unlink()
        if p.exists() or p.is_symlink():
            raise OSError(errno.EEXIST, "not a socket; refusing to replace it", self.path)
        # The socket is made world-writable by path (chmod follows links): in a directory another user can
        # write (and not sticky), that user could swap it for a link to any file between bind and chmod.
        where = p.parent.stat()
        others_write = where.st_mode & 0o002 or (where.st_mode & 0o020 and where.st_gid not in (0, os.getegid()))
        if where.st_uid not in (0, os.geteuid()) or (others_write and not where.st_mode & stat.S_ISVTX):
            raise OSError(
                errno.EPERM,
                "other users can write its directory; use one only root can write, as /run/fleetheal",
                str(p.parent),
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        # Bound under a private name and made writable before it takes its real name: a job that finds the
        # socket can always send to it (bound in place, it would exist for a moment with the umask's mode).
        staging = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}")
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        try:
            sock.bind(str(staging))
            os.chmod(staging, 0o666)  # noqa: S103 - every user's training job reports here
            os.replace(staging, p)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
            raise
        sock.settimeout(0.5)
        self.sock = sock

    def run(self, stop: threading.Event) -> None:
        if self.sock is None:
            self.bind()
        assert self.sock is not None
        try:
            while not stop.is_set():
                try:
                    data, ancdata, _, _ = self.sock.recvmsg(MAX_REPORT + 1, socket.CMSG_SPACE(_UCRED.size))
                except TimeoutError:
                    continue
                except OSError as exc:
                    self.on_error(f"training socket: {exc}")
                    stop.wait(0.1)
                    continue
                if len(data) > MAX_REPORT:
                    self.on_error(f"training report larger than {MAX_REPORT} bytes")
                    continue
                uid = None
                for level, kind, cdata in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(cdata) >= _UCRED.size:
                        uid = _UCRED.unpack_from(cdata)[1]
                self.on_report(data, uid)
        finally:
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
