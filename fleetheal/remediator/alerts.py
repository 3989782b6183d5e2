"""Strict validation of Alertmanager webhook payloads (version 4, Alertmanager 0.25 and newer).

Nothing from a payload is used before it passes here. A payload that is not the webhook's shape is
rejected whole (`PayloadError`, HTTP 400 with the reason). Inside a well-formed payload each alert is
judged on its own: an alert is accepted only when

- it carries every label of `contracts.ALERT_LABELS`;
- `cluster` is the configured cluster and `node` is an RFC 1123 name of one of its configured nodes;
- `gpu` is a GPU index or `node` (a node-wide fault);
- `fault_id` is in the taxonomy, and `class`, `action` and `severity` are exactly what the taxonomy
  says for that fault (an alert cannot ask for a different action);
- the optional `job_id` label is a Slurm job id;
- `fingerprint` is hexadecimal and `startsAt`/`endsAt` are RFC 3339 times.

Only the validated values leave this module (`Alert`); annotations, URLs and other labels never do.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetheal.contracts import ALERT_LABELS, NODE_WIDE_GPU, is_node_name
from fleetheal.remediator.config import Config
from fleetheal.taxonomy import Taxonomy

STATUSES = ("firing", "resolved")
_FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")
_GPU = re.compile(r"[0-9]{1,3}")
_JOB_ID = re.compile(r"[0-9]{1,10}(?:_[0-9]{1,10})?")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ALERTNAME = re.compile(r"[A-Za-z0-9_:.-]{1,128}")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)
MAX_LABELS = 64
MAX_LABEL_VALUE = 1024
#: Go's zero time, which Alertmanager sends as endsAt of a firing alert.
ZERO_TIME = "0001-01-01T00:00:00Z"


class PayloadError(ValueError):
    """The body is not an Alertmanager webhook payload; str() is the reason given to the sender."""


#: The field of AlertFacts that holds each label whose name is not the field's.
_LABEL_FIELDS = {"class": "fault_class"}


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertFacts:
    """What a validated alert says about its fault: the part of an `Alert` that its incident keeps
    (store.Incident). Every field is safe to store, log and pass to a playbook. Keyword arguments only:
    the subclasses add fields of their own, and a positional list would silently mean other fields."""

    fingerprint: str
    starts_at: str  # RFC 3339, UTC, microseconds: the dedupe key with the fingerprint
    starts_at_ts: float
    ends_at_ts: float | None  # None for Go's zero time (still firing)
    cluster: str
    node: str
    gpu: str
    fault_id: str
    fault_class: str
    action: str
    severity: str
    job_id: str  # "" when the alert names no job
    alertname: str  # "" when absent or not a plain name

    def labels(self) -> dict[str, str]:
        """The alert's labels under their own names (contracts.ALERT_LABELS, then job_id)."""
        return {name: getattr(self, _LABEL_FIELDS.get(name, name)) for name in (*ALERT_LABELS, "job_id")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert(AlertFacts):
    """One validated alert: firing or resolved."""

    status: str


@dataclass(frozen=True, slots=True)
class Rejection:
    index: int
    reason: str
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Payload:
    status: str
    group_key: str
    truncated_alerts: int
    alerts: tuple[Alert, ...]
    rejected: tuple[Rejection, ...]


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 time as an aware UTC datetime; None for Go's zero time. ValueError when invalid."""
    if not isinstance(value, str):
        raise ValueError("not a string")
    m = _RFC3339.fullmatch(value)
    if m is None:
        raise ValueError("not an RFC 3339 time")
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    if year == 1 and month == 1 and day == 1 and hour == 0 and minute == 0 and second == 0:
        return None
    if year < 1970:
        raise ValueError("before 1970")
    micro = int((m.group(7) or "0")[:6].ljust(6, "0"))
    if m.group(8):
        tz = dt.UTC
    else:
        offset = dt.timedelta(hours=int(m.group(10)), minutes=int(m.group(11)))
        if offset >= dt.timedelta(hours=24):
            raise ValueError("offset out of range")
        tz = dt.timezone(offset if m.group(9) == "+" else -offset)
    try:
        return dt.datetime(year, month, day, hour, minute, second, micro, tzinfo=tz).astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise ValueError("not a valid date") from None


def format_time(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Two parsers may pick different values of a duplicated key; refuse the ambiguity.
            raise ValueError(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def decode(body: bytes) -> Any:
    """The JSON document in `body`; PayloadError when it is not strict UTF-8 JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise PayloadError("body is not UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except RecursionError:
        raise PayloadError("body is nested too deeply") from None
    except ValueError as exc:
        raise PayloadError(f"body is not valid JSON: {str(exc)[:120]}") from None


def _string_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object")
    if len(value) > MAX_LABELS:
        raise ValueError(f"{what} has more than {MAX_LABELS} entries")
    for key, val in value.items():
        if not _LABEL_NAME.fullmatch(key):
            raise ValueError(f"{what}: {key[:40]!r} is not a label name")
        if not isinstance(val, str):
            raise ValueError(f"{what}.{key} must be a string")
        if len(val) > MAX_LABEL_VALUE:
            raise ValueError(f"{what}.{key} is longer than {MAX_LABEL_VALUE} characters")
    return value


def _short(value: str) -> str:
    return repr(value[:64]) + ("..." if len(value) > 64 else "")


def validate_alert(raw: Any, cfg: Config, taxonomy: Taxonomy) -> Alert:
    """One alert of a payload as a validated Alert; ValueError with the reason otherwise."""
    if not isinstance(raw, dict):
        raise ValueError("alert must be an object")
    status = raw.get("status")
    if status not in STATUSES:
        raise ValueError("status must be 'firing' or 'resolved'")
    fingerprint = raw.get("fingerprint")
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError("fingerprint must be lowercase hexadecimal")
    labels = _string_map(raw.get("labels"), "labels")
    if "annotations" in raw:
        _string_map(raw["annotations"], "annotations")
    if "generatorURL" in raw and not isinstance(raw["generatorURL"], str):
        raise ValueError("generatorURL must be a string")
    try:
        starts = parse_time(raw.get("startsAt"))
    except ValueError as exc:
        raise ValueError(f"startsAt: {exc}") from None
    if starts is None:
        raise ValueError("startsAt: the zero time is not a start")
    try:
        ends = parse_time(raw.get("endsAt", ZERO_TIME))
    except ValueError as exc:
        raise ValueError(f"endsAt: {exc}") from None

    missing = [name for name in ALERT_LABELS if name not in labels]
    if missing:
        raise ValueError(f"missing label(s): {', '.join(missing)}")
    cluster, node, gpu = labels["cluster"], labels["node"], labels["gpu"]
    if cluster != cfg.cluster.name:
        raise ValueError(f"cluster {_short(cluster)} is not this remediator's cluster")
    if not is_node_name(node):
        raise ValueError(f"node {_short(node)} is not an RFC 1123 name")
    if node not in cfg.cluster.nodes:
        raise ValueError(f"node {_short(node)} is not a node of cluster {cfg.cluster.name}")
    if gpu != NODE_WIDE_GPU and not _GPU.fullmatch(gpu):
        raise ValueError(f"gpu {_short(gpu)} is not a GPU index or {NODE_WIDE_GPU!r}")
    fault = taxonomy.faults.get(labels["fault_id"])
    if fault is None:
        raise ValueError(f"fault_id {_short(labels['fault_id'])} is not in the taxonomy")
    if labels["class"] != fault.fault_class:
        raise ValueError(f"class {_short(labels['class'])} is not the taxonomy's class of {fault.id}")
    if not taxonomy.allowed(fault.id, labels["action"]):
        raise ValueError(f"action {_short(labels['action'])} is not what the taxonomy maps {fault.id} to")
    if labels["severity"] != fault.severity:
        raise ValueError(f"severity {_short(labels['severity'])} is not the taxonomy's severity of {fault.id}")
    job_id = labels.get("job_id", "")
    if job_id and not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job_id {_short(job_id)} is not a Slurm job id")
    alertname = labels.get("alertname", "")
    return Alert(
        status=status,
        fingerprint=fingerprint,
        starts_at=format_time(starts),
        starts_at_ts=starts.timestamp(),
        ends_at_ts=None if ends is None else ends.timestamp(),
        cluster=cluster,
        node=node,
        gpu=gpu,
        fault_id=fault.id,
        fault_class=fault.fault_class,
        action=fault.action,
        severity=fault.severity,
        job_id=job_id,
        alertname=alertname if _ALERTNAME.fullmatch(alertname) else "",
    )


def _check_envelope(doc: Any, cfg: Config) -> list[Any]:
    if not isinstance(doc, dict):
        raise PayloadError("payload must be a JSON object")
    if doc.get("version") != "4":
        raise PayloadError('version must be "4" (Alertmanager webhook payload)')
    if doc.get("status") not in STATUSES:
        raise PayloadError("status must be 'firing' or 'resolved'")
    for key in ("receiver", "groupKey"):
        if not isinstance(doc.get(key), str):
            raise PayloadError(f"{key} must be a string")
    for key in ("externalURL", "notification_reason"):
        if key in doc and not isinstance(doc[key], str):
            raise PayloadError(f"{key} must be a string")
    truncated = doc.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or isinstance(truncated, bool) or truncated < 0:
        raise PayloadError("truncatedAlerts must be a non-negative integer")
    for key in ("groupLabels", "commonLabels", "commonAnnotations"):
        if key in doc:
            try:
                _string_map(doc[key], key)
            except ValueError as exc:
                raise PayloadError(str(exc)) from None
    alerts = doc.get("alerts")
    if not isinstance(alerts, list) or not alerts:
        raise PayloadError("alerts must be a non-empty list")
    if len(alerts) > cfg.webhook.max_alerts:
        raise PayloadError(f"more than {cfg.webhook.max_alerts} alerts in one payload")
    return alerts


def parse_payload(body: bytes, cfg: Config, taxonomy: Taxonomy) -> Payload:
    """Validate a webhook body. PayloadError when malformed; per-alert problems become Rejections."""
    doc = decode(body)
    raw_alerts = _check_envelope(doc, cfg)
    accepted: list[Alert] = []
    rejected: list[Rejection] = []
    for i, raw in enumerate(raw_alerts):
        try:
            accepted.append(validate_alert(raw, cfg, taxonomy))
        except ValueError as exc:
            fp = raw.get("fingerprint") if isinstance(raw, Mapping) else None
            rejected.append(Rejection(i, str(exc), fp if isinstance(fp, str) and _FINGERPRINT.fullmatch(fp) else None))
    return Payload(
        status=doc["status"],
        group_key=doc["groupKey"],
        truncated_alerts=doc.get("truncatedAlerts", 0),
        alerts=tuple(accepted),
        rejected=tuple(rejected),
    )
