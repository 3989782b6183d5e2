"""The queues of one cluster, acted on: `fleetheal queue replay` (replay a job trace under each policy) and
`fleetheal queue lend` (set the small QOS's GrpTRES gres/gpu to what the policy lends, live). The policy, the
trace parsers and the simulator are fleetheal.fleet.queue_policy's; docs/queues.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping

from fleetheal.fleet.config import FleetConfig
from fleetheal.fleet.queue_policy import (
    HEAD_FIELDS,
    MAX_DURATION_S,
    MAX_JOB_GPUS,
    MAX_POOL_GPUS,
    MAX_SUBMIT_S,
    Load,
    TraceError,
    decide,
    load_of,
    parse_clusters,
    parse_csv,
    parse_sacct,
    replay,
)
from fleetheal.fleet.view import read_cluster
from fleetheal.slurm.fields import SEP
from fleetheal.slurm.runner import Runner


class LendError(RuntimeError):
    """Slurm refused a read or the QOS change; the message says which command and why."""


def _slurm(env: Mapping[str, str] | None) -> Runner:
    return Runner(env=env, timeout_s=30, error=LendError)


def qos_limit(qos: str, env: Mapping[str, str] | None = None) -> int | None:
    """The QOS's GrpTRES gres/gpu now (None: no limit); LendError when the QOS does not exist."""
    out = _slurm(env).checked("sacctmgr", "-n", "-P", "show", "qos", qos, "format=Name,GrpTRES")
    for line in out.splitlines():
        name, _, tres = line.partition("|")
        if name == qos:
            for item in tres.split(","):
                key, _, val = item.partition("=")
                if key == "gres/gpu" and val.lstrip("-").isdigit():
                    return int(val) if int(val) >= 0 else None
            return None
    raise LendError(f"QOS {qos!r} does not exist in slurmdbd (sacctmgr show qos): create it, or set queues.small_qos")


def lend_once(
    fleet: FleetConfig, cluster: str, env: Mapping[str, str] | None = None, *, dry_run: bool = False
) -> tuple[Load, int | None, int, bool]:
    """Read `cluster`, decide the small QOS's limit, apply it when it changed (idempotent).
    Returns (load, limit before, limit now, changed)."""
    cfg = fleet.queues
    seen = read_cluster(fleet, cluster, env=env)
    if not seen.up:
        raise LendError(f"cluster {cluster}: {seen.error}")
    heads = ""
    if cfg.reclaim:
        fields = ",".join(f"{f}:{SEP}" for f in HEAD_FIELDS)
        argv = ["squeue", "-M", cluster, "-h", "-t", "PENDING", "-q", cfg.large_qos, "-O", fields]
        heads = _slurm(env).checked(*argv)
    load = load_of(seen, cfg, heads, time.time())
    before = qos_limit(cfg.small_qos, env)
    want = decide(load, cfg)
    changed = before != want
    if changed and not dry_run:
        argv = ["sacctmgr", "-i", "modify", "qos", cfg.small_qos, "set", f"GrpTRES=gres/gpu={want}"]
        _slurm(env).checked(*argv)
    return load, before, want, changed


# -- CLI ---------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `fleetheal queue replay`."""
    p = subparsers.add_parser("queue", help="large/small queues that lend and age (docs/queues.md)")
    sub = p.add_subparsers(dest="queue_cmd", required=True)
    r = sub.add_parser(
        "replay",
        help="replay a job trace under fifo, EASY backfill and lending+aging",
        description="Compare fifo, EASY backfill and lending+aging on one trace and pool (docs/queues.md).",
    )
    r.add_argument(
        "trace",
        metavar="TRACE",
        help=f"the job trace; submit times above {MAX_SUBMIT_S:.0f} s, run times above {MAX_DURATION_S:.0f} s "
        f"(10 years) or more than {MAX_JOB_GPUS} GPUs for one job are errors",
    )
    r.add_argument(
        "--clusters",
        required=True,
        metavar="N:GPUS[,...]",
        help=f"nodes:GPUs per node, e.g. 4:8,8:8 (at most {MAX_POOL_GPUS} GPUs a pool)",
    )
    r.add_argument("--format", choices=("csv", "sacct"), default="csv")
    r.add_argument("--fleet", metavar="FILE", help="fleet file for the Queues thresholds (default: built-in)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.set_defaults(func=_replay_cmd)
    lend = sub.add_parser(
        "lend",
        help="lend the large queue's idle GPUs to the small queue (the small QOS's GrpTRES), live",
        description="Every queues.interval_s, read the cluster's jobs by QOS and set the small QOS's GrpTRES "
        "gres/gpu to what the policy lends (docs/queues.md). Never stops a running job.",
    )
    lend.add_argument("--fleet", metavar="FILE", help="the fleet file (default: $FLEETHEAL_FLEET_CONFIG)")
    lend.add_argument("--cluster", required=True, metavar="NAME", help="the cluster (its Slurm ClusterName)")
    lend.add_argument("--once", action="store_true", help="decide and apply once, then exit")
    lend.add_argument("--dry-run", action="store_true", help="say what it would set; change nothing")
    lend.set_defaults(func=_lend_cmd)


def _replay_cmd(args: argparse.Namespace) -> int:
    from fleetheal.errors import UsageError
    from fleetheal.fleet import config
    from fleetheal.settings import ConfigError

    try:
        sizes = parse_clusters(args.clusters)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        fleet = config.load(args.fleet) if args.fleet else config.FleetConfig()
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    cfg, small_max = fleet.queues, fleet.placement.small_job_max_gpus
    try:
        with open(args.trace, encoding="utf-8") as fh:
            jobs = (parse_sacct if args.format == "sacct" else parse_csv)(fh)
    except OSError as exc:
        raise UsageError(f"{args.trace}: {exc.strerror}") from None
    except TraceError as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    out = []
    try:
        for nodes, gpn in sizes:
            for r in replay(jobs, nodes * gpn, cfg, small_max):
                out.append({"cluster": f"{nodes}:{gpn}", **r})
    except ValueError as exc:  # the fleet file's queue weights, which `simulate` checks
        raise UsageError(f"{fleet.source or 'built-in defaults'}: {exc}") from None
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("cluster policy   util  small_p50 small_p99 large_p50 large_p99 large_max  skipped")
        for r in out:
            print(
                f"{r['cluster']:<7} {r['policy']:<8} {r['utilisation']:.3f} {r['small_wait_p50_s']:>9.0f} "
                f"{r['small_wait_p99_s']:>9.0f} {r['large_wait_p50_s']:>9.0f} {r['large_wait_p99_s']:>9.0f} "
                f"{r['large_wait_max_s']:>9.0f} {r['skipped_too_large']:>8}"
            )
    return 0


def _lend_cmd(args: argparse.Namespace) -> int:
    from fleetheal.errors import UsageError
    from fleetheal.fleet import config
    from fleetheal.settings import ConfigError

    try:
        fleet = config.load(args.fleet)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.cluster not in fleet.clusters:
        raise UsageError(f"--cluster {args.cluster}: not a cluster of the fleet file ({', '.join(fleet.clusters)})")
    cfg = fleet.queues
    while True:
        try:
            load, before, want, changed = lend_once(fleet, args.cluster, dry_run=args.dry_run)
        except LendError as exc:
            if args.once:
                raise UsageError(str(exc)) from None
            print(f"fleetheal queue lend: {args.cluster}: {exc}; next try in {cfg.interval_s:g} s", file=sys.stderr)
        else:
            if changed or args.once:
                word = ("would set" if args.dry_run else "set") if changed else "keeps"
                waiting = (
                    f"a {load.head_gpus}-GPU large job waiting {load.head_waited_s:.0f} s"
                    if load.head_gpus
                    else "no large job waiting"
                )
                print(
                    f"{args.cluster}: QOS {cfg.small_qos} {word} GrpTRES=gres/gpu={want} (was "
                    f"{'none' if before is None else before}): {load.total_gpus} GPUs, large running "
                    f"{load.large_running}, small running {load.small_running}, {waiting}",
                    flush=True,
                )
        if args.once:
            return 0
        time.sleep(cfg.interval_s)
