"""`fleetheal agent check`: one cycle of the agent's loop, for Slurm's HealthCheckProgram, prolog and epilog.

The check builds the same `Agent` as `fleetheal agent run` and runs one polling cycle and the GPU events
pending now through it, so it judges exactly as the service does. What differs: a condition counts on its
first poll (health.debounce_polls = 1), no thread, endpoint or health file (those are the running
agent's), and the node is drained here, synchronously, for the first fault that blocks it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TextIO

from fleetheal.agent.backends import GpuBackend
from fleetheal.agent.config import AgentConfig
from fleetheal.agent.fastpath import FastPathError, SlurmDrainer
from fleetheal.agent.service import Agent, make_drainer, now_iso
from fleetheal.contracts import NODE_WIDE_GPU, drain_reason
from fleetheal.taxonomy import Taxonomy

OK, UNHEALTHY_EXIT, CANNOT_CHECK = 0, 1, 2


def run_check(
    cfg: AgentConfig,
    backend: GpuBackend | None = None,
    drainer: SlurmDrainer | None = None,
    out: TextIO | None = None,
    taxonomy: Taxonomy | None = None,
) -> int:
    """Check the GPUs once: 0 healthy, 1 unhealthy (reason printed, node drained when configured),
    2 cannot check (no NVML). Sees current state only: polled conditions and pending events, not
    counter growth over time and not the kernel log."""
    out = out or sys.stdout
    once = dataclasses.replace(
        cfg,
        health_file="",
        health=dataclasses.replace(cfg.health, debounce_polls=1),
        # the check drains (below) and leaves the taint to the running agent
        fastpath=dataclasses.replace(
            cfg.fastpath, kubernetes=dataclasses.replace(cfg.fastpath.kubernetes, enabled=False)
        ),
    )
    drainer = drainer if drainer is not None else make_drainer(cfg)
    agent = Agent(once, backend, drainer=drainer, taxonomy=taxonomy)
    problem = agent.open_backend()
    if problem is not None:
        print(f"cannot check {cfg.node}: {problem}", file=out)
        return CANNOT_CHECK
    try:
        agent.poll_once()
        agent.wait_events(0)
    finally:
        agent.shutdown()
    active = agent.tracker.active()
    # An Xid names the root cause better than its consequence (Xid 79 before gpu-lost).
    blocking = sorted(
        (a for a in active if a.fault.action in cfg.fastpath.drain_actions), key=lambda a: (a.fault.xid is None, a.gpu)
    )
    for a in active:
        mark = "FAIL" if a in blocking else "warn"
        print(
            f"{mark} {a.fault.id} gpu={a.gpu} class={a.fault.fault_class} action={a.fault.action}: {a.detail}", file=out
        )
    if not blocking:
        state = "degraded" if agent.tracker.health() else "healthy"
        print(f"{state}: {cfg.node}, {agent.visible_gpus} GPUs, {len(active)} warning(s)", file=out)
        return OK
    first = blocking[0]
    if drainer is not None:
        gpu = None if first.gpu == NODE_WIDE_GPU else first.gpu
        now = time.time()
        try:
            _, why = drainer.drain(drain_reason(first.fault.id, f"check-{cfg.node}-{int(now)}", gpu, now_iso(now)))
        except (FastPathError, OSError) as exc:
            why = f"drain failed: {exc}"
        print(why, file=out)
    print(f"unhealthy: {cfg.node}: {first.fault.id} on gpu {first.gpu} ({first.fault.name})", file=out)
    return UNHEALTHY_EXIT
