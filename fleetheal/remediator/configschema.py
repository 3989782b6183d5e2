"""What a JSON Schema can say about the remediator's configuration: ranges, name patterns, required entries.

config.py builds the typed Config (fleetheal.settings checks each value's type and the known keys), turns
it into plain JSON (`check` takes that document) and checks it against SCHEMA here; the rules that relate
several settings (leader election's timing margin, TLS's pair of files, the fleet file of failover) stay
code in config.py. Each schema node carries a `message` (not a JSON Schema keyword: jsonschema ignores it)
that the error is reported with; `{path}` is the key at fault and `{value}` its value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from fleetheal.contracts import NODE_NAME_PATTERN, PLAYBOOK_VARS
from fleetheal.settings import ConfigError

DOMAIN_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
ENV_NAME = r"[A-Z_][A-Z0-9_]*"
SITE_VAR = r"fleetheal_[a-z0-9_]+"


def whole(regex: str) -> str:
    """`regex` matching a whole string, as a JSON Schema pattern (which searches): `$(?!\\n)` because
    Python's `$` also matches before a final newline."""
    return rf"^(?:{regex})$(?!\n)"


def _num(message: str, **limits: float) -> dict[str, Any]:
    """A number within `limits` (JSON Schema's minimum, exclusiveMinimum, maximum); NaN never is."""
    return {"type": "number", **limits, "message": message}


def _section(message: str, **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "message": message}


_POSITIVE = "{path}: {value} must be > 0"
_RUNNER = (
    "runner: timeout_s >= 1, retries >= 0, backoff_s >= 0, max_concurrent >= 1 and max_hosts_per_run >= 1 are required"
)
_ENV = {"pattern": whole(ENV_NAME), "message": "runner: {value!r} is not an environment variable name"}
_BREAKER = "gate.breaker: storm_nodes >= 1, window_s > 0 and quiet_s >= 0 are required"
_LEMON = "gate.lemon: threshold >= 1 and window_s > 0 are required"
_GATE = "gate: max_requeues_per_job >= 0 and recheck_interval_s > 0 are required"
_CAPS = "gate.budget: the absolute caps must be >= 0"
_FRACTION = "{path}: must be between 0 and 1"
_LIFECYCLE = "lifecycle: standby_target >= 0 and reconcile_interval_s > 0 are required"
_MEMBERSHIP = "membership: resync_s > 0 and release_grace_s >= 0 are required"
_LENDING = "lending: interval_s > 0 is required"
_LENDING_POOL = "{path}: max_nodes >= 0, min_lent_s >= 0 and reclaim_grace_s >= 0 are required"
_WEBHOOK = "webhook: max_body_bytes must be >= 1024 and max_alerts >= 1"
_KEEP = "runner: keep_runs_days >= 0 and keep_runs >= 0 are required (0: no limit)"
_FAILOVER = "failover: wait_s >= 0 and timeout_s > 0 are required"

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "cluster": _section(
            "{path}: invalid",
            name={
                "type": "string",
                "pattern": whole(DOMAIN_NAME),
                "message": "{path}: {value!r} is not a simple name (letters, digits, '.', '_', '-')",
            },
            nodes={
                "type": "object",
                "minProperties": 1,
                "message": "cluster.nodes: list the cluster's nodes (node name -> failure domain)",
                "propertyNames": {
                    "maxLength": 253,
                    "pattern": whole(NODE_NAME_PATTERN),
                    "message": "cluster.nodes: {value!r} is not an RFC 1123 node name",
                },
                "additionalProperties": {
                    "type": "string",
                    "pattern": whole(DOMAIN_NAME),
                    "message": "{path}: failure domain {value!r} is not a simple name",
                },
            },
        ),
        "listen": _section(
            "{path}: invalid",
            port=_num("{path}: {value} is not a TCP port", minimum=0, maximum=65535),
            max_connections=_num("{path}: {value} must be >= 1", minimum=1),
            header_timeout_s=_num(_POSITIVE, exclusiveMinimum=0),
        ),
        "webhook": _section(
            _WEBHOOK,
            max_body_bytes=_num(_WEBHOOK, minimum=1024),
            max_alerts=_num(_WEBHOOK, minimum=1),
            body_timeout_s=_num(_POSITIVE, exclusiveMinimum=0),
        ),
        "membership": _section(
            _MEMBERSHIP,
            resync_s=_num(_MEMBERSHIP, exclusiveMinimum=0),
            release_grace_s=_num(_MEMBERSHIP, minimum=0),
        ),
        "lending": _section(
            _LENDING,
            interval_s=_num(_LENDING, exclusiveMinimum=0),
            namespaces={
                "type": "array",
                "items": {
                    "maxLength": 63,
                    "pattern": whole(NODE_NAME_PATTERN),
                    "message": "lending.namespaces: {value!r} is not a namespace name (an RFC 1123 label)",
                },
            },
            pools={
                "type": "object",
                "message": "{path}: invalid",
                "propertyNames": {
                    "maxLength": 63,
                    "pattern": whole(NODE_NAME_PATTERN),
                    "message": "lending.pools: {value!r} is not a GPU pool name (an RFC 1123 label)",
                },
                "additionalProperties": _section(
                    _LENDING_POOL,
                    max_nodes=_num(_LENDING_POOL, minimum=0),
                    min_lent_s=_num(_LENDING_POOL, minimum=0),
                    reclaim_grace_s=_num(_LENDING_POOL, minimum=0),
                ),
            },
        ),
        "runner": _section(
            "{path}: invalid",
            timeout_s=_num(_RUNNER, minimum=1),
            retries=_num(_RUNNER, minimum=0),
            backoff_s=_num(_RUNNER, minimum=0),
            max_concurrent=_num(_RUNNER, minimum=1),
            max_hosts_per_run=_num(_RUNNER, minimum=1),
            env_passthrough={"type": "array", "items": _ENV},
            envvars={"type": "object", "propertyNames": _ENV},
            keep_runs_days=_num(_KEEP, minimum=0),
            keep_runs=_num(_KEEP, minimum=0),
            secret_vars={
                "type": "array",
                "items": {
                    "pattern": whole(SITE_VAR),
                    "message": "runner.secret_vars: {value!r} is not a site setting (a fleetheal_* name)",
                },
            },
            site_vars={
                "type": "object",
                "propertyNames": {
                    "pattern": whole(SITE_VAR),
                    "not": {"enum": sorted(PLAYBOOK_VARS)},
                    "message": "runner.site_vars: {value!r} is not a site setting (a fleetheal_* name that is not"
                    " one of the per-incident variables in fleetheal.contracts.PLAYBOOK_VARS)",
                },
            },
        ),
        "gate": _section(
            _GATE,
            budget=_section(
                _CAPS,
                max_isolated=_num(_CAPS, minimum=0),
                max_isolated_per_domain=_num(_CAPS, minimum=0),
                max_isolated_fraction=_num(_FRACTION, minimum=0, maximum=1),
                max_isolated_fraction_per_domain=_num(_FRACTION, minimum=0, maximum=1),
            ),
            breaker=_section(
                _BREAKER,
                storm_nodes=_num(_BREAKER, minimum=1),
                window_s=_num(_BREAKER, exclusiveMinimum=0),
                quiet_s=_num(_BREAKER, minimum=0),
            ),
            lemon=_section(_LEMON, threshold=_num(_LEMON, minimum=1), window_s=_num(_LEMON, exclusiveMinimum=0)),
            max_requeues_per_job=_num(_GATE, minimum=0),
            recheck_interval_s=_num(_GATE, exclusiveMinimum=0),
        ),
        "lifecycle": _section(
            _LIFECYCLE,
            standby_target=_num(_LIFECYCLE, minimum=0),
            reconcile_interval_s=_num(_LIFECYCLE, exclusiveMinimum=0),
            repair_webhook_url={
                "pattern": "^(?:https?://|$)",
                "message": "{path}: {value!r} is not an http(s) URL",
            },
        ),
        "failover": _section(
            _FAILOVER, wait_s=_num(_FAILOVER, minimum=0), timeout_s=_num(_FAILOVER, exclusiveMinimum=0)
        ),
    },
}


@functools.cache
def _validator() -> Any:
    """SCHEMA's validator, built at the first check: `fleetheal --help` and the agent never import jsonschema."""
    import jsonschema

    return jsonschema.Draft202012Validator(SCHEMA)


def as_json(value: Any) -> Any:
    """`value` (a section of the settings as config.py holds it: dataclasses, mappings, tuples) as plain
    JSON for the validator. NaN becomes the string "nan": JSON Schema's ranges do not see it (every
    comparison with NaN is false), the `number` type then does. Anything else (a site setting that is
    not JSON) is left as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def check(doc: Mapping[str, Any]) -> None:
    """ConfigError with the message of the first setting (in SCHEMA's order) that breaks SCHEMA."""
    error = next(iter(_validator().iter_errors(doc)), None)
    if error is None:
        return
    path = ".".join(str(p) for p in error.absolute_path)
    message = error.schema.get("message") if isinstance(error.schema, Mapping) else None
    if message is None:  # a keyword without its own message: never in SCHEMA, kept readable all the same
        raise ConfigError(f"{path}: {error.message}")
    raise ConfigError(str(message).format(path=path, value=error.instance))
