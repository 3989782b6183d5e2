"""A full disk never makes the remediator act twice, or act without recording it (issue 46).

Under about 4 MB free, an incident used to stay `acting`: its playbook ran, the write of its outcome failed
(SQLITE_FULL), and after a restart the attempt was taken for an interrupted one ("remediator stopped") and
the playbook ran again. The database here lives on a real small file system (a tmpfs of 8 MiB, mounted for
the test: root or CAP_SYS_ADMIN, else the tests skip) that a test double of the runner fills the way a
playbook's artifacts or logs would; requests go to the real service over HTTP (aiohttp's test server).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetheal.remediator.store import DiskFull, Store
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, body, make_config, with_client

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB at tmp_path/disk."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("no mount command: cannot make a small file system")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()[:200]}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> None:
    """Fill the file system of `path` up to `leave` free bytes (0: until it refuses a byte)."""
    with open(path / "filler", "ab") as f:
        try:
            while (room := free(path) - leave) > 0 or not leave:
                f.write(b"\xff" * min(1 << 16, room if leave else 1 << 16))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            pass


class FillingRunner(RecordingRunner):
    """The recording runner whose first run fills the database's disk before its playbook starts, as a
    playbook's own artifacts would (every event of the run then meets a full disk too)."""

    def __init__(self, disk: Path) -> None:
        super().__init__()
        self.disk = disk

    def run(self, request, on_event, cancel, deadline=None):
        if not self.requests:
            fill(self.disk)
        return super().run(request, on_event, cancel, deadline)


async def health(client) -> tuple[int, list[str]]:
    resp = await client.get("/healthz")
    return resp.status, (await resp.json())["degraded"]


async def until_healthy(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (found := await health(client))[0] != 200:
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.1)


def test_a_disk_that_fills_during_an_action_still_records_its_outcome_and_it_never_runs_again(tmp_path, small_disk):
    cfg = make_config(tmp_path, store={"path": str(small_disk / "remediator.sqlite")})
    runner = FillingRunner(small_disk)

    async def filled(client, service):
        assert (await health(client))[0] == 200
        assert (small_disk / "remediator.sqlite.reserve").is_file()
        resp = await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        assert resp.status == 202
        await service.engine.wait_idle(timeout=30)
        inc = service.store.get(1)
        # The disk filled while the playbook ran: its outcome is recorded all the same (the reserve).
        assert (inc.state, inc.outcome) == ("done", "ran isolate_and_relocate.yml for ISOLATE_AND_RELOCATE on gpu-001: successful")  # fmt: skip
        assert [(s.name, s.result) for s in service.store.steps(1)][-1] == ("playbook", "successful")
        assert not (small_disk / "remediator.sqlite.reserve").exists()
        status, degraded = await health(client)
        assert status == 503 and len(degraded) == 1, degraded
        assert degraded[0].startswith("disk full: ") and "no action starts until space is freed" in degraded[0]
        assert "the reserve kept to record outcomes was used" in degraded[0]
        # Until space is freed, only outcomes are written: a new alert is refused (Alertmanager retries).
        resp = await client.post("/webhook", data=body(alert(node="gpu-005")), headers=AUTH)
        assert resp.status == 503

    with_client(cfg, filled, runner)
    assert len(runner.requests) == 1

    again = RecordingRunner()

    async def restarted_on_the_full_disk(client, service):
        await service.engine.wait_idle(timeout=30)
        assert service.store.get(1).state == "done"
        assert (await health(client))[0] == 503
        (small_disk / "filler").unlink()  # an operator frees space
        await until_healthy(client)
        assert (small_disk / "remediator.sqlite.reserve").is_file()
        # (a fault that isolates nothing: gpu-001's isolation holds the budget while its alert fires)
        resp = await client.post("/webhook", data=body(alert(node="gpu-005", fault_id="nccl-timeout", job_id="7")),
                                 headers=AUTH)  # fmt: skip
        assert resp.status == 202 and (await resp.json())["created"] == ["inc-000002"]
        await service.engine.wait_idle(timeout=30)
        assert service.store.get(2).state == "done"

    with_client(cfg, restarted_on_the_full_disk, again)
    # The playbook of inc-000001 never ran again; inc-000002 ran once, after space was freed.
    assert [r.incident_id for r in again.requests] == [2]


def test_no_action_starts_while_the_disk_is_too_full_to_record_it(tmp_path, small_disk):
    """The reserve is in place but less than ACTION_MARGIN_BYTES is free besides: the alert is persisted, its
    incident waits at `gated` and /healthz says why; once space is freed, it acts, once."""
    cfg = make_config(tmp_path, store={"path": str(small_disk / "remediator.sqlite")})
    runner = RecordingRunner()

    async def scenario(client, service):
        assert (await health(client))[0] == 200
        room = service.store.room
        assert room is not None
        fill(small_disk, leave=room.margin_bytes - (32 << 10))  # less than an action needs besides the reserve
        resp = await client.post("/webhook", data=body(alert(node="gpu-001")), headers=AUTH)
        assert resp.status == 202  # the alert is on disk: it waits, it is not lost
        deadline = time.monotonic() + 30
        while (inc := service.store.get(1)).state not in ("gated", "acting", "done", "failed"):
            assert time.monotonic() < deadline, inc
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the engine tries again (backoff): still no action
        assert runner.requests == [] and service.store.get(1).state == "gated"
        status, degraded = await health(client)
        assert status == 503, degraded
        assert degraded[0].startswith("disk full: ") and "an action needs" in degraded[0], degraded
        assert any("DiskFull" in d for d in degraded[1:]), degraded  # the incident waits to retry
        (small_disk / "filler").unlink()
        await service.engine.wait_idle(timeout=60)
        assert service.store.get(1).state == "done"
        assert (await health(client))[0] == 200

    with_client(cfg, scenario, runner)
    assert [r.incident_id for r in runner.requests] == [1]


def test_an_outcome_write_that_meets_a_full_disk_gives_up_the_reserve_once(small_disk, cfg):
    """The store alone: a full disk is DiskFull; an outcome (reserve=True) is written by giving up the
    reserve; every other write is refused until the reserve can be made again."""
    store = Store(str(small_disk / "remediator.sqlite"))
    try:
        assert store.room_problem() is None  # makes the reserve
        from fleetheal.remediator.alerts import validate_alert
        from fleetheal.taxonomy import load

        (iid,) = store.ingest([validate_alert(alert(), cfg, load())]).created
        step = store.start_step(iid, "playbook")
        fill(small_disk)
        with pytest.raises(DiskFull):
            for i in range(10_000):  # the write-ahead log still has room for a few
                store.add_event(iid, "note", "x" * 4000 + str(i), step)
        store.end_step(step, "successful", "done", (iid, "done", {"outcome": "ok"}), reserve=True)
        assert store.get(iid).state == "done" and store.step(step).result == "successful"
        with pytest.raises(DiskFull, match="only outcomes are written"):
            store.add_event(iid, "note", "refused")
        assert store.room_problem() is not None
        (small_disk / "filler").unlink()
        assert store.room_problem() is None  # the reserve is made again, writes go on
        store.add_event(iid, "note", "written")
    finally:
        store.close()
