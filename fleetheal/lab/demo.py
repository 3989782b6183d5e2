"""`fleetheal lab demo`: the self-healing loop, live, on the local lab (and the scenarios the lab's
integration tests run).

Six scenarios around one training job (2 nodes and a hot spare in its allocation, run by `fleetheal
launch --nodes 2`), a seventh on the pool it leaves, and an eighth on a Slurm federation, all on the Slurm
configuration the stack deploys (its timers included; `fleetheal.lab.slurmconf` lists what the lab's differs in):

1. Xid 79 (a GPU falls off the bus; hardware): the agent drains its node and taints its Node, the alert
   reaches the remediator, the isolate-and-relocate playbook gives the job its grace signal, shrinks the
   node out of the job's allocation (the spare takes over: no requeue, no credential hold), cordons and
   drains the Kubernetes node and promotes a warm-standby node into the pool; the training starts again on
   healthy nodes and resumes from its checkpoint.
2. The loop closes for that node: it awaits repair (a repair request is written), the lab "repairs" it
   (clears the injected fault) and reports it with `fleetheal nodes repaired`; the remediator revalidates
   it (DCGM diagnostics, NCCL all-reduce and burn-in, by the simulated GPUs' tools) and it is back in the
   standby pool; its lifecycle timeline is printed.
3. Xid 31 (an MMU fault: the job's own bug): no drain, no requeue; the cause goes to the job's comment
   and log.
4. NCCL timeout printed by the job (its rank 0 prints PyTorch's watchdog line and hangs; nothing is
   injected on a node): restarted in place, on the same nodes, from its checkpoint.
5. A lemon: three GPU faults on one idle node within the window quarantine it, with an RMA report.
6. CUDA out of memory printed by the job, at the same step in two runs: restarted in place once, then
   refused as the job's own (`cuda-oom-repeated`), the cause in its log; the job ends, its nodes untouched.
7. One pool for training and inference (with the real control plane: kube-scheduler and Kueue): a training
   job ends and an inference Deployment that Kueue admits scales into its nodes, which the remediator's lending
   controller lends; a new training job takes them back (the pods evicted within their grace); once lent
   again, a GPU falls off the bus on a lent node, which is isolated like any node while its inference moves
   to another lent node.
8. A leaf switch lost: cluster a of a two-cluster federation (its own slurmdbd, MariaDB and controllers)
   loses both nodes at once; its remediator, with no standby node and a budget of one node, isolates one,
   and moves the job to cluster b, which reads its checkpoint store; once Slurm says the nodes
   do not respond the remediator sets them DOWN (not waiting SlurmdTimeout) and lifts the requeue's
   begin-time hold on b; the job resumes there, in the same log.

Each scenario is watched from the outside (Slurm, the Kubernetes API, the job's own events, the
remediator's incidents): every milestone is printed when it is first seen, with its time since the
fault was injected.

The scenarios themselves are in `fleetheal.lab.scenarios`, the watching in `fleetheal.lab.watcher`;
this module runs them in order and narrates: the incidents' timelines, the lab's status, the summary.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from fleetheal.lab import LabError
from fleetheal.lab.lab import Lab
from fleetheal.lab.scenarios import (
    CHECKPOINT_EVERY,
    STEP_TIME,
    scenario_leaf_switch,
    scenario_lemon,
    scenario_nccl,
    scenario_oom,
    scenario_repair,
    scenario_sharing,
    scenario_xid31,
    scenario_xid79,
)
from fleetheal.lab.train import ettr, read_events
from fleetheal.lab.watcher import Outcome, Watcher, continuity, last_progress_step


def print_incident(inc: dict[str, Any], out: Callable[[str], None]) -> None:
    """The remediator's timeline of one incident: its steps and the playbook tasks that changed something."""
    out(f"  remediator timeline of {inc.get('id')} ({inc.get('fault_id')} on {inc.get('node')} -> {inc.get('action')}, "
        f"{inc.get('state')}):")  # fmt: skip
    t0: float | None = None
    for ev in inc.get("timeline") or []:
        ts = float(ev.get("ts") or 0)
        if t0 is None:
            t0 = ts
        kind, what = ev.get("kind"), ev.get("what")
        if kind == "event" and what == "first_step":  # the remediator's first responder, in-process
            out(f"    +{ts - t0:6.1f}s  {ev.get('detail', '')}")
        elif kind == "step" or (kind == "event" and what in ("task_changed", "task_failed", "playbook_start")):
            label = (
                what if kind == "step" else str(ev.get("detail", "")).split("|")[-1].replace("(localhost)", "").strip()
            )
            result = ev.get("result") or ("changed" if what == "task_changed" else "")
            detail = ev.get("detail", "") if kind == "step" else ""
            out(f"    +{ts - t0:6.1f}s  {label} {result} {('- ' + detail) if detail else ''}".rstrip())
    out(f"    outcome: {inc.get('outcome') or '-'}")


def print_status(lab: Lab, out: Callable[[str], None] = print) -> None:
    out(f"lab {lab.dir}")
    out(f"  {'NODE':5} {'POOL':10} {'SLURM':18} {'K8S':26} {'AGENT':12} REASON")
    for n in lab.status():
        k8s = ("cordoned" if n.k8s_unschedulable else "schedulable") + (
            f" +{len(n.k8s_taints)} taint" if n.k8s_taints else ""
        )
        out(f"  {n.name:5} {n.pool:10} {n.slurm_state:18} {k8s:26} {n.health:12} {n.reason or ''}")
    jobs = lab.slurm().squeue("-h", "-o", "%i %j %T %N %r").strip()
    out("  jobs: " + (jobs.replace("\n", "\n        ") if jobs else "none"))
    try:
        incs = [i for i in lab.incidents() if i.get("state") not in ("done", "failed")]
    except LabError as exc:
        out(f"  incidents: unavailable ({exc})")
        return
    out(f"  open incidents: {len(incs)}")
    for i in incs:
        out(f"    {i.get('id')} {i.get('state')} {i.get('node')} {i.get('fault_id')} -> {i.get('action')}")


def run_scenarios(lab: Lab, out: Callable[[str], None] = print) -> tuple[list[Outcome], Watcher]:
    """Submit the training job and run the three scenarios on it; returns what each did."""
    job, run_dir = lab.submit_training(step_time=STEP_TIME, checkpoint_every=CHECKPOINT_EVERY, spares=1)
    w = Watcher(lab, job, run_dir, out)
    out(f"\n== training job {job}: 2 nodes and a hot spare in its allocation (fleetheal launch --nodes 2), "
        f"checkpoint every {CHECKPOINT_EVERY:g}s, log {run_dir / 'train.log'}")  # fmt: skip
    w.wait_running()
    out(f"  running on {w.job_info()['NodeList']}")
    w.wait_steps(60)
    outcomes: list[Outcome] = []

    def repair(lab: Lab, w: Watcher, out: Callable[[str], None]) -> Outcome:
        if not outcomes or not outcomes[0].ok:
            raise LabError("the Xid 79 scenario failed: no isolated node to repair")
        return scenario_repair(lab, w, out, outcomes[0])

    for title, fn in (
        ("1. Xid 79 on a GPU of the job: hardware -> isolate, relocate, replace", scenario_xid79),
        ("2. The loop closes for that node: repair reported -> revalidation -> standby pool", repair),
        ("3. Xid 31: the job's own bug -> no relocation, the user is told why", scenario_xid31),
        ("4. NCCL timeout printed by the job: transient -> restart in place", scenario_nccl),
        ("5. A lemon: three faults in the window -> quarantine and an RMA report", scenario_lemon),
        ("6. CUDA out of memory printed by the job, twice at one step -> restart, then refuse and tell", scenario_oom),
    ):
        out(f"\n== {title}")
        w.wait_running()
        w.wait_steps(last_progress_step(run_dir) + 20)
        try:
            o = fn(lab, w, out)
        except LabError as exc:
            o = Outcome(title, "?", "?", None, "?", error=str(exc))
            out(f"  FAILED: {exc}")
        outcomes.append(o)
        for inc in o.incidents:
            print_incident(inc, out)
        if o.fault == "xid-79" and o.milestones:
            value = ettr(read_events(run_dir), time.time())
            o.details["ettr"] = value
            out(f"  effective training time ratio of the run so far: {value:.2f}" if value is not None else "")
    title = "7. One pool for training and inference: lend idle nodes to Kueue, take them back, heal a lent node"
    out(f"\n== {title}")
    try:
        o = scenario_sharing(lab, out)
    except LabError as exc:
        o = Outcome(title, "sharing", "?", None, "?", error=str(exc))
        out(f"  FAILED: {exc}")
    outcomes.append(o)
    for inc in o.incidents:
        print_incident(inc, out)
    out("\n== 8. A leaf switch lost in cluster a of a federation -> the job moves to cluster b (3rd stage)")
    outcomes.append(scenario_leaf_switch(lab, out))
    return outcomes, w


def summary(outcomes: list[Outcome], w: Watcher, out: Callable[[str], None]) -> None:
    out("\n== summary")
    out(f"  {'FAULT':17} {'NODE':5} {'ACTION':21} {'INCIDENT':11} {'RUNNING AGAIN':14} {'RESULT':7} NOTE")
    for o in outcomes:
        again = o.milestones.get("running", o.milestones.get("moved"))
        note = ""
        if o.fault == "xid-79":
            moved = ",".join(o.details.get("new_nodes", []))
            note = f"moved to {moved}, standby {o.details.get('promoted', '-')} promoted"
        elif o.fault == "xid-31":
            note = "not drained, not requeued, cause in the job log"
        elif o.fault == "cuda-oom-repeated":
            note = "both raised from the lines the job printed; restarted once, then refused, cause in the job log"
        elif o.fault == "nccl-timeout":
            note = ("same nodes" if o.details.get("same_nodes") else "moved") + ", raised from the line the job printed"
        elif o.fault == "repair":
            loop = o.details.get("loop_s")
            note = (
                f"{o.details.get('state')} {loop:.1f}s after the fault (revalidation "
                f"{o.details.get('revalidation_s', 0):.1f}s)"
                if loop
                else ""
            )
        elif o.fault == "lemon":
            note = f"{o.details.get('state')}, RMA report written" if o.details.get("rma") else ""
        elif o.fault == "sharing":
            note = (
                o.error
                or o.details.get("skipped")
                or (
                    f"{', '.join(o.details.get('lent_first', []))} lent, taken back for training, lent again; "
                    f"the fault on a lent node healed, its inference moved"
                )
            )
        elif o.fault == "leaf-switch":
            at = o.milestones.get("moved")
            note = f"moved to cluster b {at:.1f}s after the fault, resumed from its checkpoint" if at else ""
        again_text = f"{again:.1f}s" if again is not None else "-"
        result = "skipped" if o.details.get("skipped") else "ok" if o.ok else "FAILED"
        out(f"  {o.fault:17} {o.node:5} {o.action:21} {o.details.get('incident', '-'):11} "
            f"{again_text:14} {result:7} {note or o.error}")  # fmt: skip
    for c in continuity(w.run_dir):
        out(f"  restart {c['restart']}: last step {c['last_step']}, resumed from {c['resumed_from']} "
            f"({c['lost']} steps lost), incident {c['incident']}")  # fmt: skip
    oom = [o for o in outcomes if o.fault == "cuda-oom-repeated"]
    value = oom[0].details.get("ettr_before") if oom else ettr(read_events(w.run_dir), time.time())
    if value is not None:
        until = " until the job's own out-of-memory ended it" if oom else ""
        out(f"  ETTR of the run{until}: {value:.2f}")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C. A subclass on purpose: CPython remembers a KeyboardInterrupt
    of exactly that type that went through `exec` or `eval` of a string (dataclasses and namedtuples build
    their methods that way, at import), and kills the process with SIGINT as it exits, even when the
    exception was handled: CI saw a demo take its lab down, print "demo finished", then die of SIGINT."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def run_demo(lab_dir: str | None = None, keep: bool = False) -> int:
    out = print
    t0 = time.monotonic()
    lab = Lab(lab_dir)
    # A demo stopped by `kill` or a closed terminal takes its lab down like one stopped by Ctrl-C: an
    # orphaned lab would hold the next `make demo` back.
    before = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGHUP)}
    out(f"fleetheal lab demo: bringing the lab up in {lab.dir}")
    try:
        lab.up()  # a failed `up` stops what it started itself
        out(f"  ready in {time.monotonic() - t0:.1f}s")
        print_status(lab, out)
        outcomes, w = run_scenarios(lab, out)
        summary(outcomes, w, out)
        out(f"\n== the job's log (one file across restarts): {w.run_dir / 'train.log'}")
        for line in (w.run_dir / "train.log").read_text(errors="replace").splitlines():
            # The training's own lines, and what fleetheal did to the job: one line per action, in its log.
            if "===" in line or "SIGUSR1" in line or line.startswith(("fleetheal:", "fleetheal launch:")):
                out("  " + line)
        with contextlib.suppress(Exception):
            lab.slurm().run("scancel", w.job, check=False)
        code = 0 if outcomes and all(o.ok for o in outcomes) else 1
    except (LabError, KeyboardInterrupt) as exc:
        out(f"fleetheal lab demo: {exc or 'interrupted'}; logs in {lab.dir / 'logs'}")
        code = 1
    finally:
        # Only a lab this demo brought up is taken down (never another demo's running lab), also when a
        # signal arrives between the end of `up` and its return.
        if lab.started and not keep:
            out("\n== taking the lab down")
            lab.down()
        for signum, handler in before.items():
            signal.signal(signum, handler)
    out(f"demo finished in {time.monotonic() - t0:.0f}s")
    sys.stdout.flush()
    return code
