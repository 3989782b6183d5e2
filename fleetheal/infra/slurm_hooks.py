"""Slurm hook scripts wired to the node agent: HealthCheckProgram, prolog and epilog parts; and the controller's
extraConf, rendered from `fleetheal.slurm.conf` (the one source of the settings the lab runs too).

They talk to the agent through the host directory in `contracts.AGENT_STATE_DIR` (mounted into
slurmd pods), not over the network, so a hung API or DNS never blocks a job start.
`FLEETHEAL_STATE_DIR` overrides that directory (tests, bare-metal installs).
"""

from __future__ import annotations

from fleetheal import contracts
from fleetheal.slurm import conf

#: Where the Slinky NodeSet pods mount these scripts, and the health check's file name there.
HOOKS_MOUNT = "/etc/fleetheal/slurm"
HEALTHCHECK = "healthcheck.sh"
HEALTH_CHECK_PROGRAM = f"{HOOKS_MOUNT}/{HEALTHCHECK}"


def healthcheck_script() -> str:
    # The health check runs on every node each HealthCheckInterval with SLURMD_NODENAME set; a
    # non-zero exit only logs, so it drains its own node with scontrol (measured on Slurm 22.05).
    # A missing health file means the agent is not up yet: log, do not drain (a slow agent rollout
    # must not drain a whole cluster).
    return f"""#!/usr/bin/env bash
# fleetheal HealthCheckProgram: drain this node when the fleetheal agent reports a fault.
set -euo pipefail
state_dir="${{FLEETHEAL_STATE_DIR:-{contracts.AGENT_STATE_DIR}}}"
health_file="$state_dir/health"
node="${{SLURMD_NODENAME:-$(hostname -s)}}"
log() {{ logger -t fleetheal-healthcheck "$*" 2>/dev/null || echo "fleetheal-healthcheck: $*" >&2; }}
if [[ ! -r "$health_file" ]]; then
  log "no agent health file at $health_file; not draining $node"
  exit 0
fi
state="$(head -c 200 "$health_file" | tr -cd 'A-Za-z0-9_.:=-')"
if [[ "$state" == "ok" ]]; then
  exit 0
fi
# Already drained (by fleetheal or by a person): keep that reason, never overwrite it.
if scontrol show node -o "$node" 2>/dev/null | grep -Eq 'State=[A-Z_+]*DRAIN'; then
  exit 1
fi
reason="{contracts.DRAIN_REASON_PREFIX}${{state:-unknown}} incident=healthcheck-${{node}}"
scontrol update nodename="$node" state=drain reason="$reason"
log "drained $node: $reason"
exit 1
"""


def prolog_script() -> str:
    return f"""#!/usr/bin/env bash
# fleetheal prolog part: tell the agent which job runs here (and on which GPUs), refuse unhealthy nodes.
set -euo pipefail
state_dir="${{FLEETHEAL_STATE_DIR:-{contracts.AGENT_STATE_DIR}}}"
jobs_dir="$state_dir/jobs"
health_file="$state_dir/health"
if [[ -r "$health_file" && "$(head -c 200 "$health_file")" != ok* ]]; then
  echo "fleetheal: node unhealthy ($(head -c 200 "$health_file")); job ${{SLURM_JOB_ID}} goes elsewhere" >&2
  exit 1
fi
mkdir -p "$jobs_dir"
printf 'job_id=%s\\nrestart_count=%s\\ngpus=%s\\nuser=%s\\nuid=%s\\n' \\
  "${{SLURM_JOB_ID}}" "${{SLURM_JOB_RESTART_COUNT:-0}}" "${{SLURM_JOB_GPUS:-}}" "${{SLURM_JOB_USER:-}}" \\
  "${{SLURM_JOB_UID:-}}" \\
  > "$jobs_dir/${{SLURM_JOB_ID}}.tmp"
mv "$jobs_dir/${{SLURM_JOB_ID}}.tmp" "$jobs_dir/${{SLURM_JOB_ID}}"
"""


def epilog_script() -> str:
    return f"""#!/usr/bin/env bash
# fleetheal epilog part: the job left this node.
set -euo pipefail
state_dir="${{FLEETHEAL_STATE_DIR:-{contracts.AGENT_STATE_DIR}}}"
rm -f "$state_dir/jobs/${{SLURM_JOB_ID}}"
"""


def slurm_conf_lines(grace_seconds: int, large_min_nodes: int, nodesets: list[str]) -> str:
    """The controller's extraConf: the stack's settings (`fleetheal.slurm.conf.stack_settings`, each with its
    reason there), then the large/small partitions over the NodeSets."""
    nodes = ",".join(nodesets)
    lines = [
        *(s.line() for s in conf.stack_settings(grace_seconds, HEALTH_CHECK_PROGRAM)),
        f"PartitionName=large Nodes={nodes} MinNodes={large_min_nodes} MaxTime=UNLIMITED PriorityTier=2 State=UP",
        f"PartitionName=small Nodes={nodes} MaxNodes={large_min_nodes - 1} MaxTime=UNLIMITED Default=YES State=UP",
    ]
    return "\n".join(lines) + "\n"
