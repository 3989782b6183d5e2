"""The agent's non-GPU sources: the kernel log and the training-report socket.

Each runs in its own thread until `stop` is set and hands what it reads to callbacks; it never raises
for bad input. A garbled kernel record or a malformed report goes to `on_error` (the service counts it
in `fleetheal_agent_read_errors_total{source=...}`) and reading goes on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

#: Longest kernel log line handled whole; longer ones are garbled (the kernel caps records at 1 KiB).
MAX_LINE = 64 * 1024
#: Largest training report accepted.
MAX_REPORT = 4096


def decode_kmsg_record(record: bytes) -> str | None:
    """The message of one /dev/kmsg record (`pri,seq,usec,flags[,...];message\\n KEY=value...`), or None
    when the record is not in that format."""
    header, sep, rest = record.partition(b";")
    fields = header.split(b",")
    if not sep or len(fields) < 3 or not all(f.strip().isdigit() for f in fields[:3]):
        return None
    message = rest.split(b"\n", 1)[0]
    return message.decode("utf-8", errors="replace")


class KernelLogFollower:
    """Follow /dev/kmsg (one record per read) or a text file (like `tail -F`: survives rotation and
    truncation), calling `on_line(text)` for every line and `on_error(reason)` for garbled input."""

    def __init__(
        self,
        path: str,
        on_line: Callable[[str], None],
        on_error: Callable[[str], None],
        from_start: bool = False,
        poll_s: float = 0.1,
    ) -> None:
        self.path = path
        self.on_line = on_line
        self.on_error = on_error
        self.from_start = from_start
        self.poll_s = poll_s
        self.ready = threading.Event()

    def is_kmsg(self) -> bool:
        try:
            return stat.S_ISCHR(os.stat(self.path).st_mode)
        except FileNotFoundError:
            return False

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                if self.is_kmsg():
                    self._follow_kmsg(stop)
                else:
                    self._follow_file(stop)
            except OSError as exc:
                self.on_error(f"cannot read {self.path}: {exc}")
                self.ready.set()
                stop.wait(5.0)  # the log may appear later (a file created by syslog); keep trying

    def _follow_kmsg(self, stop: threading.Event) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not self.from_start:
                os.lseek(fd, 0, os.SEEK_END)  # /dev/kmsg: skip to the next record written
            self.ready.set()
            while not stop.is_set():
                try:
                    record = os.read(fd, 8192)
                except BlockingIOError:
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

    def _follow_file(self, stop: threading.Event) -> None:
        while not os.path.exists(self.path):
            self.ready.set()
            if stop.wait(self.poll_s):
                return
        with open(self.path, "rb") as fh:
            ino = os.fstat(fh.fileno()).st_ino
            if not self.from_start:
                fh.seek(0, os.SEEK_END)
            self.from_start = True  # after a rotation, read the new file from its start
            self.ready.set()
            pending = b""
            while not stop.is_set():
                chunk = fh.readline(MAX_LINE + 1)
                if chunk:
                    pending += chunk
                    if pending.endswith(b"\n") or len(pending) > MAX_LINE:
                        self._line(pending.rstrip(b"\r\n"))
                        pending = b""
                    continue
                try:
                    st = os.stat(self.path)
                    if st.st_ino != ino or st.st_size < fh.tell():
                        return  # rotated or truncated: reopen
                except FileNotFoundError:
                    return
                stop.wait(self.poll_s)


class TrainingReportServer:
    """A Unix datagram socket; each datagram is one report, handed to `on_report(bytes)`.

    The socket is world-writable on purpose: training jobs run as their users. A datagram socket never
    blocks a sender, and a sender sees an error (never a hang) when the agent is not running.
    """

    def __init__(self, path: str, on_report: Callable[[bytes], None], on_error: Callable[[str], None]) -> None:
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o666)  # noqa: S103 - every user's training job reports here
        sock.settimeout(0.5)
        self.sock = sock

    def run(self, stop: threading.Event) -> None:
        if self.sock is None:
            self.bind()
        assert self.sock is not None
        try:
            while not stop.is_set():
                try:
                    data = self.sock.recv(MAX_REPORT + 1)
                except TimeoutError:
                    continue
                except OSError as exc:
                    self.on_error(f"training socket: {exc}")
                    stop.wait(0.1)
                    continue
                if len(data) > MAX_REPORT:
                    self.on_error(f"training report larger than {MAX_REPORT} bytes")
                    continue
                self.on_report(data)
        finally:
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
