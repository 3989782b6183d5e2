"""The webhook fuzzed with hypothesis (10,000 examples): never a 5xx, never an action from invalid input.

Requests go to the real aiohttp application in-process (aiohttp's TestServer on 127.0.0.1). Valid alerts
are acted on by the recording runner; an oracle written independently of the validator then checks that
every stored incident and every playbook request came from an alert that deserved it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import string

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetheal import taxonomy
from fleetheal.contracts import ALERT_LABELS
from fleetheal.remediator.app import Service
from tests.remediator.conftest import TOKEN, RecordingRunner, alert, make_config, nodes, payload

TAX = taxonomy.load()
EXAMPLES = int(os.environ.get("FLEETHEAL_FUZZ_EXAMPLES", "10000"))
NODES = nodes(8)
FAULTS = ["xid-79", "xid-13", "nccl-timeout", "unknown", "xid-48", "xid-31"]

# Label values an attacker or a broken rule could send, next to the valid ones.
NASTY = [
    "",
    " ",
    "gpu-000 ",
    "gpu-000\n",
    "GPU-000",
    "gpu-000;reboot",
    "gpu-000 -e @/etc/shadow",
    "{{ lookup('pipe','id') }}",
    "$(id)",
    "`id`",
    "../../etc/passwd",
    "gpu-999",
    "-1",
    "1e3",
    "٣",
    "\u0000",
    "x" * 300,
    "ISOLATE_AND_RELOCATE",
    "OBSERVE",
    "hardware",
    "critical",
    "lab",
    "node",
]
label_value = st.one_of(
    st.sampled_from(NASTY),
    st.sampled_from(list(NODES) + FAULTS + ["0", "7", "123", "4242", "12_3"]),
    st.text(max_size=20),
    st.text(alphabet=string.ascii_lowercase + string.digits + "-._", max_size=12),
)
json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


LABEL_NAMES = [*ALERT_LABELS, "job_id", "alertname"]
FIELDS = ["status", "fingerprint", "startsAt", "endsAt", "labels"]
# Strategies are built once: building them inside every draw costs more than the HTTP request.
base_alert = st.builds(
    lambda node, gpu, fault_id, status, starts_at: _base(node, gpu, fault_id, status, starts_at),
    st.sampled_from(list(NODES)),
    st.sampled_from(["0", "3", "node"]),
    st.sampled_from(FAULTS),
    st.sampled_from(["firing", "resolved"]),
    st.sampled_from(["2026-11-29T17:37:02.139Z", "2026-11-29T18:00:00Z"]),
)
label_edits = st.lists(st.tuples(st.sampled_from(LABEL_NAMES), st.none() | label_value), max_size=3)
field_edits = st.lists(st.tuples(st.sampled_from(FIELDS), st.one_of(json_value, label_value)), max_size=2)


@functools.cache
def _template(node, gpu, fault_id, status, starts_at):
    return json.dumps(alert(node=node, gpu=gpu, fault_id=fault_id, status=status, starts_at=starts_at))


def _base(*key):
    return json.loads(_template(*key))  # a fresh copy to mutate


@st.composite
def mutated_alert(draw):
    a = draw(base_alert)
    for name, value in draw(label_edits):
        if value is None:
            a["labels"].pop(name, None)
        else:
            a["labels"][name] = value
    for field, value in draw(field_edits):
        a[field] = value
    return a


alert_lists = st.lists(mutated_alert(), min_size=1, max_size=3)
raw_bytes = st.binary(max_size=200)
body_kind = st.sampled_from(["alerts", "alerts", "alerts", "envelope", "json", "bytes"])
envelope_edits = st.lists(st.tuples(st.sampled_from(sorted(payload(alert()))), st.none() | json_value), max_size=2)


@st.composite
def webhook_body(draw):
    kind = draw(body_kind)
    if kind == "bytes":
        return draw(raw_bytes)
    if kind == "json":
        return json.dumps(draw(json_value)).encode()
    doc = payload(*draw(alert_lists))
    if kind == "envelope":
        for key, value in draw(envelope_edits):
            if value is None:
                doc.pop(key, None)
            else:
                doc[key] = value
    return json.dumps(doc).encode()


headers = st.one_of(
    st.just({"Authorization": f"Bearer {TOKEN}"}),
    st.just({"Authorization": f"Bearer {TOKEN}"}),
    st.just({"Authorization": f"Bearer {TOKEN}"}),
    st.just({}),
    st.builds(lambda t: {"Authorization": f"Bearer {t}"}, st.text(alphabet=string.printable.strip(), max_size=30)),
)


def deserves_action(inc) -> bool:
    """The oracle: what a valid fleetheal alert looks like, written without the validator."""
    fault = TAX.faults.get(inc.fault_id)
    gpu_ok = inc.gpu == "node" or (inc.gpu.isascii() and inc.gpu.isdigit() and len(inc.gpu) <= 3)
    job_ok = inc.job_id == "" or all(p.isascii() and p.isdigit() for p in inc.job_id.split("_", 1))
    return (
        inc.cluster == "lab"
        and inc.node in NODES
        and gpu_ok
        and job_ok
        and fault is not None
        and (inc.fault_class, inc.action, inc.severity) == (fault.fault_class, fault.action, fault.severity)
    )


def test_fuzzed_webhook_never_5xx_and_never_acts_on_invalid_input(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="fleetheal.remediator")  # thousands of rejections are expected
    cfg = make_config(
        tmp_path,
        gate={
            "recheck_interval_s": 0.5,
            "budget": {
                "max_isolated": 100,
                "max_isolated_fraction": 1.0,
                "max_isolated_per_domain": 100,
                "max_isolated_fraction_per_domain": 1.0,
            },
            "breaker": {"storm_nodes": 1000},
            "lemon": {"threshold": 1000},
        },
        webhook={"max_body_bytes": 4096},
    )
    runner = RecordingRunner()
    loop = asyncio.new_event_loop()
    service = Service(cfg, runner=runner)
    client = TestClient(TestServer(service.app()), loop=loop)
    loop.run_until_complete(client.start_server())
    seen = {"n": 0, "statuses": {}}

    def count():
        return sum(n for _, _, n in service.store.counts())

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(body=webhook_body(), hdrs=headers)
    def post(body, hdrs):
        seen["n"] += 1
        before = count()

        async def go():
            async with client.post("/webhook", data=body, headers=hdrs) as resp:
                return resp.status, await resp.read()

        status, text = loop.run_until_complete(go())
        seen["statuses"][status] = seen["statuses"].get(status, 0) + 1
        assert status < 500, text
        assert status in (202, 400, 401, 413), (status, text)
        if hdrs.get("Authorization") != f"Bearer {TOKEN}":
            assert status == 401
            assert count() == before
        if status != 202:
            assert count() == before

    try:
        post()
        loop.run_until_complete(service.engine.wait_idle(timeout=120))
        incidents = service.store.incidents(limit=100_000)
        requests = list(runner.requests)
    finally:
        loop.run_until_complete(client.close())
        loop.close()

    assert seen["n"] >= EXAMPLES
    assert seen["statuses"].get(202, 0) > EXAMPLES // 100 and seen["statuses"].get(400, 0) > EXAMPLES // 10
    assert seen["statuses"].get(401, 0) > EXAMPLES // 100
    bad = [i for i in incidents if not deserves_action(i)]
    assert not bad, bad[:3]
    by_ref = {i.ref: i for i in incidents}
    for r in requests:
        inc = by_ref[r.extravars["fleetheal_incident_id"]]
        assert r.extravars["fleetheal_node"] == inc.node and r.extravars["fleetheal_action"] == inc.action
        assert TAX.allowed(r.extravars["fleetheal_fault_id"], r.extravars["fleetheal_action"])
    # Each incident acted on at most once.
    acted = [r.extravars["fleetheal_incident_id"] for r in requests]
    assert len(acted) == len(set(acted))
