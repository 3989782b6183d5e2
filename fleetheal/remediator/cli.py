"""`fleetheal remediator ...` and `fleetheal incidents ...`.

    fleetheal remediator serve --config FILE      run the webhook service
    fleetheal remediator pause|resume             flip the pause switch (gate.pause_file)
    fleetheal remediator release NODE             a human takes a node back from isolation/quarantine
    fleetheal incidents list [--state S]          recent incidents
    fleetheal incidents show ID                   one incident's timeline with the duration of each phase
    fleetheal nodes list                          every node's lifecycle state
    fleetheal nodes show NODE                     one node's lifecycle timeline (--json for the data)
    fleetheal nodes repaired NODE                 its repair is done: revalidate it (operators' node API)

Every command takes `--config FILE` (default: $FLEETHEAL_REMEDIATOR_CONFIG, else
/etc/fleetheal/remediator.yaml). Heavy imports (aiohttp) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from typing import Any

from fleetheal.errors import UsageError

PHASES = (
    ("detect", "alert start (startsAt) -> received"),
    ("classify", "received -> classified"),
    ("gate", "classified -> gate decision (includes time held)"),
    ("act", "playbook start -> end (all attempts)"),
    ("total", "alert start -> done/failed"),
)


def _config_arg(p: argparse.ArgumentParser) -> None:
    from fleetheal.remediator.config import CONFIG_ENV, DEFAULT_CONFIG_PATH

    p.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get(CONFIG_ENV, DEFAULT_CONFIG_PATH),
        help=f"remediator configuration (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )


def register(sub: Any) -> None:
    rem = sub.add_parser("remediator", help="the remediation service (Alertmanager webhook -> playbooks)")
    rsub = rem.add_subparsers(dest="remediator_command", metavar="COMMAND", required=True)
    p = rsub.add_parser("serve", help="run the webhook service until SIGTERM")
    _config_arg(p)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=serve)
    for name, text in (("pause", "hold every new action at the gate"), ("resume", "let held actions go again")):
        p = rsub.add_parser(name, help=text)
        _config_arg(p)
        p.set_defaults(func=pause if name == "pause" else resume)
    p = rsub.add_parser("release", help="take a node back from isolation or quarantine (a human decision)")
    _config_arg(p)
    p.add_argument("node")
    p.add_argument("--reason", default="released by an operator")
    p.set_defaults(func=release)

    inc = sub.add_parser("incidents", help="list incidents and show their timelines")
    isub = inc.add_subparsers(dest="incidents_command", metavar="COMMAND", required=True)
    p = isub.add_parser("list", help="recent incidents, newest first")
    _config_arg(p)
    p.add_argument("--state", choices=("received", "classified", "gated", "acting", "done", "failed"))
    p.add_argument("--node")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=list_incidents)
    p = isub.add_parser("show", help="one incident: its steps, events, gate decisions and phase durations")
    _config_arg(p)
    p.add_argument("id", help="incident id, e.g. inc-000042 or 42")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show_incident)

    nodes = sub.add_parser("nodes", help="node lifecycles: list, show, report a repair")
    nsub = nodes.add_subparsers(dest="nodes_command", metavar="COMMAND", required=True)
    p = nsub.add_parser("list", help="every node of the cluster and its lifecycle state")
    _config_arg(p)
    p.add_argument("--state", help="only nodes in this state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=list_nodes)
    p = nsub.add_parser("show", help="one node's lifecycle timeline: each transition and its cause")
    _config_arg(p)
    p.add_argument("node")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show_node)
    p = nsub.add_parser("repaired", help="report a node's repair done: the remediator revalidates it")
    _config_arg(p)
    p.add_argument("node")
    p.add_argument("--by", default=os.environ.get("USER", "operator"), help="who repaired it (recorded)")
    p.add_argument("--token-file", help="the operators' token (default: auth.operator_token_file of the configuration)")
    p.add_argument("--url", help="the remediator's base URL (default: from listen.host and listen.port)")
    p.set_defaults(func=repaired)


# --- helpers ----------------------------------------------------------------------------------------------


def _load(args: argparse.Namespace) -> Any:
    from fleetheal.remediator.config import ConfigError, load

    try:
        return load(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _store(args: argparse.Namespace) -> Any:
    from fleetheal.remediator.config import ConfigError
    from fleetheal.remediator.store import SchemaError, Store, StoreError

    cfg = _load(args)
    try:
        url = cfg.store.url()
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    try:
        if url is not None:  # the replicas' shared PostgreSQL: an operator's command writes there too
            return Store.postgres(url)
        if not os.path.exists(cfg.store.path):
            raise UsageError(f"no remediator database at {cfg.store.path} (store.path in {args.config})")
        return Store(cfg.store.path, cfg.store.synchronous)
    except SchemaError as exc:
        raise UsageError(str(exc)) from None
    except StoreError as exc:
        if url is not None:
            raise UsageError(
                f"cannot reach the remediator's PostgreSQL (store.url_file in {args.config}): {exc}"
            ) from None
        raise UsageError(f"cannot open the remediator's database {cfg.store.path}: {exc}") from None


def _iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m"


# --- remediator -------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    import asyncio

    from fleetheal.remediator.config import ConfigError, require_token
    from fleetheal.remediator.serve import StartupError, run_service, setup_logging

    setup_logging(args.log_level)
    cfg = _load(args)
    try:
        require_token(cfg)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    try:
        asyncio.run(run_service(cfg))
    except StartupError as exc:
        print(f"fleetheal remediator: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _pause_file(args: argparse.Namespace) -> str:
    cfg = _load(args)
    if not cfg.gate.pause_file:
        raise UsageError(f"set gate.pause_file in {args.config} to use the pause switch")
    return str(cfg.gate.pause_file)


def pause(args: argparse.Namespace) -> int:
    path = _pause_file(args)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"paused at {_iso(dt.datetime.now(dt.UTC).timestamp())}\n")
    print(f"paused: new actions are held at the gate until `fleetheal remediator resume` ({path})")
    return 0


def resume(args: argparse.Namespace) -> int:
    path = _pause_file(args)
    try:
        os.remove(path)
    except FileNotFoundError:
        print("not paused")
        return 0
    print("resumed: held actions are examined again")
    return 0


def release(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        released = store.release(args.node, args.reason)
        # A quarantined node goes back to awaiting repair: after the RMA, `fleetheal nodes repaired` sends it
        # through revalidation like any repaired node.
        back = store.transition(args.node, "awaiting_repair", f"released by an operator: {args.reason}",
                                store.node_state(args.node).incident_id, expect=("quarantined",))  # fmt: skip
        if released or back:
            print(f"released {args.node}: it no longer counts against the isolation budget"
                  + ("; it awaits repair (then `fleetheal nodes repaired`)" if back else ""))  # fmt: skip
            return 0
        print(f"{args.node} is not isolated", file=sys.stderr)
        return 1
    finally:
        store.close()


# --- incidents --------------------------------------------------------------------------------------------


def list_incidents(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        rows = store.incidents(state=args.state, limit=args.limit, node=args.node)
    finally:
        store.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    header = ("ID", "STATE", "NODE", "GPU", "FAULT", "ACTION", "DECISION", "RECEIVED", "OUTCOME")
    table = [header] + [
        (
            r.ref,
            r.state + (" (held)" if r.hold_reason else ""),
            r.node,
            r.gpu,
            r.fault_id,
            r.action,
            r.decision or "-",
            _iso(r.received_at),
            (r.outcome or r.hold_reason or "")[:70],
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + str(row[-1]))
    return 0


def phases(inc: Any, steps: list[Any]) -> dict[str, float | None]:
    """Seconds spent in each phase of PHASES (None when the phase has not happened)."""
    by_name: dict[str, list[Any]] = {}
    for s in steps:
        by_name.setdefault(s.name, []).append(s)
    classify = by_name.get("classify", [None])[-1]
    gate = by_name.get("gate", [None])[-1]
    runs = by_name.get("playbook", [])
    out: dict[str, float | None] = {
        "detect": inc.received_at - inc.starts_at_ts,
        "classify": None if classify is None or classify.ended_at is None else classify.ended_at - inc.received_at,
        "gate": None
        if gate is None or gate.ended_at is None or classify is None or classify.ended_at is None
        else gate.ended_at - classify.ended_at,
        "act": None,
        "total": None,
    }
    if runs:
        end = runs[-1].ended_at
        out["act"] = None if end is None else end - runs[0].started_at
    if inc.state in ("done", "failed"):
        out["total"] = inc.updated_at - inc.starts_at_ts
    return out


def timeline(store: Any, inc: Any) -> list[dict[str, Any]]:
    """Steps, events and gate decisions of an incident, in time order."""
    entries: list[dict[str, Any]] = []
    for s in store.steps(inc.id):
        entries.append(
            {
                "ts": s.started_at,
                "kind": "step",
                "what": s.name + (f" (attempt {s.attempt})" if s.name == "playbook" else ""),
                "result": s.result or "running",
                "duration_s": None if s.ended_at is None else round(s.ended_at - s.started_at, 3),
                "detail": s.detail,
            }
        )
    for e in store.events(inc.id):
        entries.append({"ts": e.ts, "kind": "event", "what": e.kind, "detail": e.detail})
    for a in store.audit_log(inc.id):
        entries.append({"ts": a["ts"], "kind": "gate", "what": a["decision"], "detail": a["reason"]})
    entries.sort(key=lambda x: x["ts"])
    return entries


def show_incident(args: argparse.Namespace) -> int:
    from fleetheal.remediator.store import parse_ref

    try:
        iid = parse_ref(args.id)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    store = _store(args)
    try:
        inc = store.get(iid)
        if inc is None:
            print(f"no incident {args.id}", file=sys.stderr)
            return 1
        steps = store.steps(iid)
        entries = timeline(store, inc)
    finally:
        store.close()
    durations = phases(inc, steps)
    if args.json:
        doc = {**inc.as_dict(), "phases": durations, "timeline": entries}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{inc.ref}  {inc.state}  {inc.fault_id} ({inc.fault_class}) on {inc.node} gpu {inc.gpu} -> {inc.action}")
    print(
        f"  alert started {inc.starts_at}, fingerprint {inc.fingerprint}"
        + (f", job {inc.job_id}" if inc.job_id else "")
    )
    print(f"  decision: {inc.decision or '-'}" + (f"  held: {inc.hold_reason}" if inc.hold_reason else ""))
    print(f"  outcome:  {inc.outcome or '-'}")
    if inc.resolved_at:
        print(f"  resolved: {_iso(inc.resolved_at)}")
    print("phases:")
    for name, text in PHASES:
        print(f"  {name:<9} {_dur(durations[name]):>8}   {text}")
    print("timeline:")
    for e in entries:
        offset = e["ts"] - inc.starts_at_ts
        dur = f" [{_dur(e['duration_s'])}]" if e.get("duration_s") is not None else ""
        result = f" {e['result']}" if "result" in e else ""
        detail = f" - {e['detail']}" if e["detail"] else ""
        print(f"  +{_dur(offset):>8}  {e['kind']:<5} {e['what']}{result}{dur}{detail}")
    return 0


# --- nodes ------------------------------------------------------------------------------------------------


def list_nodes(args: argparse.Namespace) -> int:
    from fleetheal.remediator.store import NodeState

    cfg = _load(args)
    store = _store(args)
    try:
        known = {n.node: n for n in store.node_states()}
    finally:
        store.close()
    rows = [known.get(node) or NodeState(node, "active", 0.0, None, "") for node in sorted(cfg.cluster.nodes)]
    rows = [r for r in rows if not args.state or r.state == args.state]
    if args.json:
        print(json.dumps([{"node": r.node, "state": r.state, "since": r.since or None, "cause": r.cause} for r in rows],
                         indent=2))  # fmt: skip
        return 0
    now = dt.datetime.now(dt.UTC).timestamp()
    print(f"{'NODE':<20} {'STATE':<16} {'FOR':>8}  CAUSE")
    for r in rows:
        print(f"{r.node:<20} {r.state:<16} {_dur(now - r.since) if r.since else '-':>8}  {r.cause[:90]}")
    return 0


def show_node(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.node not in cfg.cluster.nodes:
        raise UsageError(f"{args.node} is not a node of cluster {cfg.cluster.name} (cluster.nodes in {args.config})")
    store = _store(args)
    try:
        state = store.node_state(args.node)
        history = store.node_history(args.node)
        incidents = [i.as_dict() for i in store.incidents(node=args.node, limit=20)]
    finally:
        store.close()
    if args.json:
        doc = {"node": args.node, "state": state.state, "since": state.since or None, "cause": state.cause,
               "history": history, "incidents": incidents}  # fmt: skip
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{args.node}  {state.state}" + (f" since {_iso(state.since)}" if state.since else ""))
    print("timeline:")
    t0 = history[0]["ts"] if history else 0.0
    for h in history:
        print(f"  +{_dur(h['ts'] - t0):>8}  {h['from']} -> {h['to']}  ({h['incident'] or '-'}) {h['cause']}")
    if not history:
        print("  (never left active)")
    return 0


def repaired(args: argparse.Namespace) -> int:
    import urllib.error

    cfg = _load(args)
    path = args.token_file or cfg.auth.operator_token_file
    if not path:
        raise UsageError("give --token-file or set auth.operator_token_file: the node API needs the operators' token")
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the operators' token {path}: {exc.strerror}") from exc
    scheme = "https" if cfg.listen.tls_cert_file else "http"
    base = args.url or f"{scheme}://{cfg.listen.host}:{cfg.listen.port}"
    from urllib.parse import quote

    from fleetheal.httpjson import request_json

    url = f"{base.rstrip('/')}/api/v1/nodes/{quote(args.node, safe='')}/repaired"
    try:
        doc = request_json("POST", url, {"by": args.by}, token=token, timeout=30)
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            why = exc.reason
        print(f"fleetheal nodes repaired: {why} (HTTP {exc.code})", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fleetheal nodes repaired: cannot reach the remediator at {base}: {exc}", file=sys.stderr)
        return 1
    print(f"{doc['result']}; {args.node} is now {doc['state']}")
    return 0
