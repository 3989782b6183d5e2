"""The commands `fleetheal fleet status` (a table, or JSON with `--json`) and `fleetheal fleet exporter`
(Prometheus metrics read on every scrape); fleetheal.cli mounts the other `fleetheal fleet` subcommands on the
subparsers `register` returns. The view is fleetheal.fleet.view's, its table and metrics fleetheal.fleet.render's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from fleetheal.errors import UsageError
from fleetheal.fleet.render import registry, table
from fleetheal.fleet.view import DEFAULT_TIMEOUT_S, collect

if TYPE_CHECKING:
    from fleetheal.fleet.config import FleetConfig


# --- the command ---------------------------------------------------------------------------------------------


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"HOST:PORT, e.g. 127.0.0.1:9106, got {text!r}")
    return host.strip("[]"), int(port)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _config(args: argparse.Namespace) -> FleetConfig:
    from fleetheal.fleet.config import load
    from fleetheal.settings import ConfigError

    try:
        return load(args.fleet)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def cmd_status(args: argparse.Namespace) -> int:
    status = collect(_config(args), timeout=args.timeout)
    if args.json:
        json.dump(status.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(table(status))
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from fleetheal import logs

    logs.setup_logging("info")
    cfg = _config(args)
    host, port = args.listen
    try:
        server, thread = start_http_server(port, host, registry=registry(lambda: collect(cfg, timeout=args.timeout)))
    except OSError as exc:
        raise UsageError(f"--listen {host}:{port}: {exc.strerror or exc}") from exc
    log = logging.getLogger("fleetheal.fleet")
    log.info(
        "fleet exporter listening",
        extra={"url": f"http://{host}:{server.server_port}/metrics", "clusters": len(cfg.clusters)},
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    log.info("fleet exporter stopping")
    server.shutdown()
    server.server_close()
    thread.join(5.0)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse._SubParsersAction[Any]:
    """Add `fleetheal fleet` with `status` and `exporter`; return the fleet subparsers (fleetheal.cli mounts
    the other `fleet` subcommands there)."""
    p = sub.add_parser(
        "fleet",
        help="the clusters of a Slurm federation as one fleet",
        description="The fleet of clusters in the fleet file (docs/fleet.md).",
    )
    fsub = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--fleet", metavar="FILE", help="the fleet file (default: $FLEETHEAL_FLEET_CONFIG)")
    common.add_argument(
        "--timeout",
        type=_positive,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds one Slurm read may take (default {DEFAULT_TIMEOUT_S:g})",
    )
    s = fsub.add_parser(
        "status",
        parents=[common],
        help="clusters, GPUs, nodes, queues, standby pools and open incidents",
        description=(
            "Every cluster of the fleet file: reachable or not, free/total GPUs by type, nodes by state, "
            "pending and running jobs (by QOS), pending GPUs, the remediator's standby pool and open incidents."
        ),
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s.set_defaults(func=cmd_status)
    e = fsub.add_parser(
        "exporter",
        parents=[common],
        help="serve the fleet status as Prometheus metrics",
        description="Serve /metrics; every scrape reads the fleet (docs/metrics.md, section Fleet).",
    )
    e.add_argument(
        "--listen", type=_listen, default=("127.0.0.1", 9106), metavar="HOST:PORT", help="default 127.0.0.1:9106"
    )
    e.set_defaults(func=cmd_exporter)
    return fsub
