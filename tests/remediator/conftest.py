"""Fixtures of the remediator tests: configs, Alertmanager payloads, and a recording runner (test double)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetheal.remediator import config as cfgmod
from fleetheal.remediator.runner import RunnerEvent, RunnerInputError, StepOutcome, StepRequest, check_extravars

HERE = Path(__file__).resolve().parent
TEST_PLAYBOOKS = HERE / "playbooks"
TOKEN = "test-token-0123456789abcdef"
CLUSTER = "lab"


def nodes(count: int = 8, per_domain: int = 4) -> dict[str, str]:
    """gpu-000 ... -> rack-0, rack-1, ... (`per_domain` nodes each)."""
    return {f"gpu-{i:03d}": f"rack-{i // per_domain}" for i in range(count)}


def make_config(tmp_path: Path, env: dict[str, str] | None = None, **sections: Any) -> cfgmod.Config:
    """A valid config in `tmp_path`; keyword arguments replace or extend whole sections."""
    doc: dict[str, Any] = {
        "cluster": {"name": CLUSTER, "nodes": nodes()},
        "listen": {"host": "127.0.0.1", "port": 0},
        "store": {"path": str(tmp_path / "remediator.sqlite"), "synchronous": "NORMAL"},
        "runner": {
            "playbook_dir": str(TEST_PLAYBOOKS),
            "run_dir": str(tmp_path / "runs"),
            "backoff_s": 0.0,
            "envvars": {"FLEETHEAL_TEST_RECORD": str(tmp_path / "record.jsonl")},
        },
        "gate": {"recheck_interval_s": 0.05},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(name), dict):
            merged = copy.deepcopy(doc[name])
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            doc[name] = merged
        else:
            doc[name] = value
    return cfgmod.from_mapping(doc, env={"FLEETHEAL_REMEDIATOR_TOKEN": TOKEN, **(env or {})}, source="test")


def alert(
    *,
    node: str = "gpu-000",
    gpu: str = "0",
    fault_id: str = "xid-79",
    status: str = "firing",
    fingerprint: str | None = None,
    starts_at: str = "2026-11-29T17:37:02.139Z",
    job_id: str | None = None,
    **labels: str,
) -> dict[str, Any]:
    """One alert as Alertmanager sends it for a fleetheal rule (labels from the taxonomy)."""
    from fleetheal import taxonomy

    fault = taxonomy.load().fault(fault_id)
    all_labels = {
        "alertname": f"Fleetheal{fault_id.replace('-', '').title()}",
        "cluster": CLUSTER,
        "node": node,
        "gpu": gpu,
        "fault_id": fault_id,
        "class": fault.fault_class,
        "action": fault.action,
        "severity": fault.severity,
        "instance": "127.0.0.1:9400",
        "job": "fleetheal-agent",
    }
    if job_id is not None:
        all_labels["job_id"] = job_id
    all_labels.update(labels)
    if fingerprint is None:
        fingerprint = hashlib.sha256(f"{node}|{gpu}|{fault_id}".encode()).hexdigest()[:16]
    return {
        "status": status,
        "labels": all_labels,
        "annotations": {"summary": f"{node} GPU {gpu}: {fault.name}"},
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-29T17:40:00Z",
        "generatorURL": "http://127.0.0.1:9090/graph",
        "fingerprint": fingerprint,
    }


def payload(*alerts: dict[str, Any], status: str | None = None) -> dict[str, Any]:
    """A webhook body (version 4) around `alerts`."""
    status = status or ("resolved" if all(a.get("status") == "resolved" for a in alerts) else "firing")
    return {
        "receiver": "fleetheal-remediator",
        "status": status,
        "alerts": list(alerts),
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:9093",
        "version": "4",
        "groupKey": '{}:{alertname="x"}',
        "truncatedAlerts": 0,
    }


def body(*alerts: dict[str, Any]) -> bytes:
    return json.dumps(payload(*alerts)).encode()


class RecordingRunner:
    """Test double of runner.AnsibleRunner: records each request, answers at once (or as told).

    `outcomes` maps an attempt number to a status (default successful); `delay_s` simulates a run; `hold`
    keeps the first run waiting until it is set.
    It checks the extra variables exactly like the real runner does.
    """

    def __init__(
        self, delay_s: float = 0.0, outcomes: dict[int, str] | None = None, hold: threading.Event | None = None
    ) -> None:
        self.delay_s = delay_s
        #: When given, the first run waits for it to be set (it holds its slot until the test releases it).
        self.hold = hold
        self.outcomes = outcomes or {}
        self.requests: list[StepRequest] = []
        self.batches: list[list[int]] = []  # the incident ids of each run
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def run_batch(self, runs, cancel):
        """One "run" for the batch: it counts once in `running` and takes `delay_s` once, like a real run."""
        with self._lock:
            self.batches.append([request.incident_id for request, _ in runs])
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            first = len(self.batches) == 1
        if first and self.hold is not None:
            assert self.hold.wait(120), "the test never released the first run"
        deadline = time.monotonic() + self.delay_s
        try:
            outcomes = []
            for request, on_event in runs:
                try:
                    outcomes.append(self.run(request, on_event, cancel, deadline))
                except RunnerInputError as exc:
                    outcomes.append(exc)
            return outcomes
        finally:
            with self._lock:
                self.running -= 1

    def run(
        self,
        request: StepRequest,
        on_event: Callable[[RunnerEvent], None],
        cancel: Callable[[], bool],
        deadline: float | None = None,
    ) -> StepOutcome:
        check_extravars(request.extravars)
        with self._lock:
            self.requests.append(request)
        on_event(RunnerEvent("playbook_start", request.playbook))
        deadline = time.monotonic() + self.delay_s if deadline is None else deadline
        while time.monotonic() < deadline:
            if cancel():
                return StepOutcome("canceled", 254, "canceled")
            time.sleep(0.01)
        status = self.outcomes.get(request.attempt, "successful")
        on_event(RunnerEvent("stats", f"status={status}"))
        return StepOutcome(status, 0 if status == "successful" else 2, f"recorded ({status})")


@pytest.fixture
def cfg(tmp_path: Path) -> cfgmod.Config:
    return make_config(tmp_path)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def with_client(cfg: cfgmod.Config, scenario: Callable[..., Any], runner: Any = None) -> None:
    """Run `scenario(client, service)` against the real app (in process, on a loop of its own)."""
    from aiohttp.test_utils import TestClient, TestServer

    from fleetheal.remediator.app import Service

    async def main() -> None:
        service = Service(cfg, runner=runner or RecordingRunner())
        async with TestClient(TestServer(service.app())) as client:
            await scenario(client, service)

    asyncio.run(main())
