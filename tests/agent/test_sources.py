"""Kernel log follower (file and /dev/kmsg record format) and the training-report socket."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from fleetheal.agent.sources import MAX_REPORT, KernelLogFollower, TrainingReportServer, decode_kmsg_record


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_decode_kmsg_records():
    rec = b"3,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n"
    assert decode_kmsg_record(rec) == "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    assert decode_kmsg_record(b"6,1,2,-,caller=T1;hello\n") == "hello"
    assert decode_kmsg_record(b"no header here\n") is None
    assert decode_kmsg_record(b"x,y,z;msg\n") is None


@pytest.fixture
def follow(tmp_path):
    path = tmp_path / "kern.log"
    path.write_text("old line before start\n")
    lines, errors = [], []
    stop = threading.Event()
    f = KernelLogFollower(str(path), lines.append, errors.append, poll_s=0.01)
    t = threading.Thread(target=f.run, args=(stop,), daemon=True)
    t.start()
    assert f.ready.wait(2)
    yield path, lines, errors
    stop.set()
    t.join(2)


def test_follows_new_lines_and_counts_garbage(follow):
    path, lines, errors = follow
    with open(path, "ab") as fh:
        fh.write(b"first\n\xff\xfe garbled\nwith\x00nul\n")
        fh.write(b"partial ")
        fh.flush()
        time.sleep(0.05)
        fh.write(b"line\n")
    _wait(lambda: len(lines) == 4)
    assert lines == ["first", "\ufffd\ufffd garbled", "withnul", "partial line"]
    assert len(errors) == 2
    assert "not UTF-8" in errors[0]
    assert "NUL" in errors[1]


def test_survives_rotation_and_truncation(follow):
    path, lines, _ = follow
    with open(path, "a") as fh:
        fh.write("before rotation\n")
    _wait(lambda: lines == ["before rotation"])
    os.rename(path, str(path) + ".1")
    path.write_text("after rotation\n")
    _wait(lambda: lines[-1:] == ["after rotation"])
    path.write_text("")  # truncate
    time.sleep(0.05)
    with open(path, "a") as fh:
        fh.write("after truncation\n")
    _wait(lambda: lines[-1:] == ["after truncation"])


def test_training_server_hands_over_datagrams(tmp_path):
    path = str(tmp_path / "run" / "t.sock")
    got, errors = [], []
    server = TrainingReportServer(path, got.append, errors.append)
    server.bind()
    assert oct(os.stat(path).st_mode & 0o777) == "0o666"
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,), daemon=True)
    t.start()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    c.sendto(b'{"job":"1","rank":0,"step":1}', path)
    c.sendto(b"x" * (MAX_REPORT + 10), path)
    _wait(lambda: got and errors)
    assert got == [b'{"job":"1","rank":0,"step":1}']
    assert "larger than" in errors[0]
    stop.set()
    t.join(2)
    assert not os.path.exists(path)


def test_reads_the_real_dev_kmsg():
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("SKIPPED: /dev/kmsg is not readable here (needs CAP_SYSLOG with dmesg_restrict=1)")
    lines, errors = [], []
    stop = threading.Event()
    f = KernelLogFollower("/dev/kmsg", lines.append, errors.append, from_start=True, poll_s=0.01)
    assert f.is_kmsg()
    t = threading.Thread(target=f.run, args=(stop,), daemon=True)
    t.start()
    _wait(lambda: len(lines) > 0)
    stop.set()
    t.join(2)
    assert all("\n" not in line for line in lines)
