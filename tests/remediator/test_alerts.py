"""Validation of Alertmanager webhook payloads: real payloads, and every way an alert can be wrong."""

from __future__ import annotations

import json

import pytest

from fleetheal import taxonomy
from fleetheal.remediator.alerts import PayloadError, parse_payload, parse_time
from tests.remediator.conftest import alert, body, payload

TAX = taxonomy.load()


def parse(cfg, *alerts):
    return parse_payload(body(*alerts), cfg, TAX)


def test_a_fleetheal_alert_is_accepted_with_only_validated_fields(cfg):
    p = parse(cfg, alert(node="gpu-003", gpu="5", job_id="4242"))
    assert not p.rejected
    (a,) = p.alerts
    assert (a.node, a.gpu, a.fault_id, a.fault_class, a.action, a.severity) == (
        "gpu-003",
        "5",
        "xid-79",
        "hardware",
        "ISOLATE_AND_RELOCATE",
        "critical",
    )
    assert a.job_id == "4242"
    assert a.starts_at == "2026-11-29T17:37:02.139000Z"
    assert a.ends_at_ts is None
    assert a.alertname == "FleethealXid79"


@pytest.mark.parametrize("name", ["alertmanager-webhook-firing.json", "alertmanager-webhook-resolved.json"])
def test_real_alertmanager_payloads_parse_and_foreign_alerts_are_rejected_with_a_reason(cfg, shared, name):
    # Real Alertmanager 0.25 bodies: the envelope is valid, but the alert is not a fleetheal alert.
    raw = (shared / "fixtures" / name).read_bytes()
    p = parse_payload(raw, cfg, TAX)
    assert p.status in ("firing", "resolved")
    assert not p.alerts
    (r,) = p.rejected
    assert r.reason == "missing label(s): cluster, fault_id, class, action"
    assert r.fingerprint == "9c143f1e250ea28e"


def test_the_real_envelope_with_a_fleetheal_alert_inside_is_accepted(cfg, shared):
    doc = json.loads((shared / "fixtures" / "alertmanager-webhook-firing.json").read_text())
    doc["alerts"] = [alert()]
    p = parse_payload(json.dumps(doc).encode(), cfg, TAX)
    assert len(p.alerts) == 1 and not p.rejected


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"node": "gpu-999"}, "node 'gpu-999' is not a node of cluster lab"),
        ({"node": "GPU-000"}, "node 'GPU-000' is not an RFC 1123 name"),
        ({"node": "gpu-000; rm -rf /"}, "is not an RFC 1123 name"),
        ({"node": "gpu-000\n"}, "is not an RFC 1123 name"),
        ({"node": "{{ lookup('pipe', 'id') }}"}, "is not an RFC 1123 name"),
        ({"cluster": "other"}, "cluster 'other' is not this remediator's cluster"),
        ({"gpu": "a0"}, "gpu 'a0' is not a GPU index or 'node'"),
        ({"gpu": "1\n"}, "is not a GPU index"),
        ({"fault_id": "xid-99999"}, "fault_id 'xid-99999' is not in the taxonomy"),
        ({"action": "OBSERVE"}, "action 'OBSERVE' is not what the taxonomy maps xid-79 to"),
        ({"action": "rm -rf"}, "is not what the taxonomy maps"),
        ({"class": "user"}, "class 'user' is not the taxonomy's class of xid-79"),
        ({"severity": "info"}, "severity 'info' is not the taxonomy's severity of xid-79"),
        ({"job_id": "12; scancel -u root"}, "is not a Slurm job id"),
    ],
)
def test_an_alert_with_a_wrong_label_is_rejected_with_the_reason(cfg, change, reason):
    a = alert()
    a["labels"].update(change)
    p = parse(cfg, a)
    assert not p.alerts
    assert reason in p.rejected[0].reason


@pytest.mark.parametrize("label", ["cluster", "node", "gpu", "fault_id", "class", "action", "severity"])
def test_every_contract_label_is_required(cfg, label):
    a = alert()
    del a["labels"][label]
    assert parse(cfg, a).rejected[0].reason == f"missing label(s): {label}"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("fingerprint", "XYZ", "fingerprint must be lowercase hexadecimal"),
        ("fingerprint", 12, "fingerprint must be lowercase hexadecimal"),
        ("status", "pending", "status must be 'firing' or 'resolved'"),
        ("startsAt", "yesterday", "startsAt: not an RFC 3339 time"),
        ("startsAt", "0001-01-01T00:00:00Z", "startsAt: the zero time is not a start"),
        ("startsAt", "2026-02-30T00:00:00Z", "startsAt: not a valid date"),
        ("endsAt", 5, "endsAt: not a string"),
        ("labels", [], "labels must be an object"),
        ("labels", {"node": 1}, "labels.node must be a string"),
        ("annotations", {"a b": "x"}, "annotations: 'a b' is not a label name"),
        ("generatorURL", None, "generatorURL must be a string"),
    ],
)
def test_an_alert_with_a_wrong_field_is_rejected(cfg, field, value, reason):
    a = alert()
    a[field] = value
    assert parse(cfg, a).rejected[0].reason == reason


def test_a_mixed_payload_keeps_the_valid_alerts(cfg):
    bad = alert(node="gpu-999")
    p = parse(cfg, alert(node="gpu-001"), bad, alert(node="gpu-002"))
    assert [a.node for a in p.alerts] == ["gpu-001", "gpu-002"]
    assert [r.index for r in p.rejected] == [1]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "body is not valid JSON"),
        (b"\xff\xfe", "body is not UTF-8"),
        (b"[]", "payload must be a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "body is nested too deeply"),
        (b'{"version": "4", "version": "4"}', "duplicate key"),
        (b'{"x": NaN}', "NaN is not JSON"),
        (json.dumps({**payload(alert()), "version": "3"}).encode(), 'version must be "4"'),
        (json.dumps({**payload(alert()), "alerts": []}).encode(), "alerts must be a non-empty list"),
        (json.dumps({**payload(alert()), "alerts": {}}).encode(), "alerts must be a non-empty list"),
        (json.dumps({**payload(alert()), "status": "ok"}).encode(), "status must be 'firing' or 'resolved'"),
        (json.dumps({**payload(alert()), "groupKey": 1}).encode(), "groupKey must be a string"),
        (json.dumps({**payload(alert()), "truncatedAlerts": -1}).encode(), "truncatedAlerts must be a non-negative"),
        (json.dumps({**payload(alert()), "truncatedAlerts": True}).encode(), "truncatedAlerts must be a non-negative"),
        (json.dumps({**payload(alert()), "commonLabels": {"a": 1}}).encode(), "commonLabels.a must be a string"),
    ],
)
def test_a_malformed_payload_is_rejected_whole(cfg, raw, reason):
    with pytest.raises(PayloadError) as err:
        parse_payload(raw, cfg, TAX)
    assert reason in str(err.value)


def test_too_many_alerts_is_rejected(tmp_path):
    from tests.remediator.conftest import make_config

    cfg = make_config(tmp_path, webhook={"max_alerts": 2})
    with pytest.raises(PayloadError, match="more than 2 alerts"):
        parse(cfg, alert(), alert(gpu="1"), alert(gpu="2"))


def test_unknown_fields_of_newer_alertmanagers_are_tolerated(cfg):
    doc = payload(alert())
    doc["notification_reason"] = "new"
    doc["alerts"][0]["somethingNew"] = {"x": 1}
    assert len(parse_payload(json.dumps(doc).encode(), cfg, TAX).alerts) == 1


@pytest.mark.parametrize(
    ("text", "iso"),
    [
        ("2026-11-29T17:37:02Z", "2026-11-29T17:37:02+00:00"),
        ("2026-11-29T17:37:02.123456789Z", "2026-11-29T17:37:02.123456+00:00"),
        ("2026-11-29T18:37:02.5+01:00", "2026-11-29T17:37:02.500000+00:00"),
        ("2026-11-29t17:37:02z", "2026-11-29T17:37:02+00:00"),
    ],
)
def test_rfc3339_times_go_style(text, iso):
    when = parse_time(text)
    assert when is not None and when.isoformat() == iso


@pytest.mark.parametrize(
    "text", ["2026-11-29 17:37:02Z", "2026-11-29T17:37:02", "\uff12\uff10\uff12\uff16-11-29T17:37:02Z", ""]
)
def test_not_rfc3339(text):
    with pytest.raises(ValueError):
        parse_time(text)


def test_go_zero_time_means_still_firing():
    assert parse_time("0001-01-01T00:00:00Z") is None
