"""The fast path: isolate this node before any alert has travelled.

`SlurmDrainer` reads the nodes with `sinfo` (`fleetheal.slurm.nodes`) and drains this node with the real
`scontrol` (run by `fleetheal.slurm.runner`) and an owned reason
(`fleetheal.contracts.drain_reason`). It never touches a node drained for a reason fleetheal does not
own (an operator's drain keeps its reason), and it never undrains: returning a node to service is the
remediator's REJOIN, after revalidation.

`KubeNodeTainter` taints (`fleetheal.io/unhealthy=<fault>:NoSchedule`) and labels
(`fleetheal.io/fault=<fault>`) this node's own Node object through the API server, with a node-scoped
credential: a service-account token bound to this node (or to the agent's pod on it), which the
ValidatingAdmissionPolicy `fleetheal-agent-own-node` (`fleetheal.contracts.own_node_policy`) lets
it add its taint and label to this one Node and change nothing else. Standard library only.

The drain obeys a fleet-wide budget: when the fleet already has as many fleetheal-owned fault drains
as the budget allows (`fastpath.fleet_budget`, the remediator gate's default), the agent does not drain
its node, so a false-positive storm (a driver bug, a bad parser rule) cannot empty the cluster; the
remediator's gate decides, and holds what is over its budget.

Both answer with a result word counted in `fleetheal_agent_fastpath_actions_total{action,result}`:
done, already (ours already), kept_foreign (someone else's drain/taint left alone), would (observe
mode: "would drain", never "drained"), over_budget (the fleet budget is spent), failed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fleetheal.contracts import (
    FLEET_BUDGET_NODES,
    FLEET_BUDGET_SHARE,
    LABEL_FAULT,
    POOL_REASONS,
    STANDBY_REASON,
    TAINT_UNHEALTHY,
    budget_limit,
    owns_reason,
)
from fleetheal.rate import TokenBucket
from fleetheal.slurm.nodes import Node, read, sinfo_argv
from fleetheal.slurm.runner import Run, Runner

if TYPE_CHECKING:
    import ssl
    import urllib.error

DONE, ALREADY, KEPT_FOREIGN, WOULD, FAILED = "done", "already", "kept_foreign", "would", "failed"
OVER_BUDGET = "over_budget"
#: After its drain, an agent waits this long before it checks the budget again: slurmctld's clock has then
#: left the second its drain is stamped with, so every drain stamped no later is visible.
TIE_WAIT_S = 1.2


class FastPathError(RuntimeError):
    pass


class SlurmDrainer:
    """Drain one Slurm node through `scontrol`; read the nodes with `sinfo` (default: the one beside `scontrol`)."""

    def __init__(
        self,
        node: str,
        scontrol: str = "scontrol",
        *,
        slurm_conf: str | None = None,
        timeout_s: float = 10.0,
        dry_run: bool = False,
        run: Run = subprocess.run,
        env: Mapping[str, str] | None = None,
        budget_nodes: int = FLEET_BUDGET_NODES,
        budget_share: float = FLEET_BUDGET_SHARE,
        sleep: Callable[[float], None] = time.sleep,
        sinfo: str | None = None,
    ) -> None:
        self.node = node
        self._sleep = sleep
        self.budget_nodes = budget_nodes
        self.budget_share = budget_share
        self.scontrol = scontrol
        self.sinfo = sinfo or (os.path.join(os.path.dirname(scontrol), "sinfo") if os.sep in scontrol else "sinfo")
        self.timeout_s = timeout_s
        self.dry_run = dry_run
        self.env = dict(os.environ if env is None else env)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self._runner = Runner(env=self.env, timeout_s=timeout_s, error=FastPathError, run=run)

    def _scontrol(self, *args: str) -> str:
        return self._command(self.scontrol, *args)

    def _command(self, tool: str, *args: str) -> str:
        return self._runner.checked(tool, *args)

    def node_info(self) -> Node:
        info = read(self._command(*sinfo_argv(self.sinfo, self.node))).get(self.node)
        if info is None:
            raise FastPathError(f"sinfo -n {self.node}: no such node")
        return info

    def fleet(self) -> list[Node]:
        """Every node of the cluster (one `sinfo`)."""
        return list(read(self._command(*sinfo_argv(self.sinfo))).values())

    def budget(self, nodes: list[Node], before: Callable[[Node], bool] | None = None) -> tuple[int, int]:
        """(fault drains fleetheal owns on other nodes, the most the budget allows). Pool drains (standby,
        quarantine, lent) are not faults; the pool is every node outside the standby pool. With `before`, only
        the drains it accepts count."""

        def pool_reason(n: Node) -> bool:
            return bool(n.reason) and str(n.reason).startswith(POOL_REASONS)

        pool = [n for n in nodes if not (n.drained and str(n.reason or "").startswith(STANDBY_REASON))]
        faults = [n for n in nodes if n.drained and owns_reason(n.reason) and not pool_reason(n)]
        others = [n for n in faults if n.name != self.node and (before is None or before(n))]
        return len(others), budget_limit(self.budget_nodes, self.budget_share, len(pool))

    def _me(self, reason: str) -> tuple[Node | None, list[Node]]:
        """This node (None unless it is still drained with `reason`) and the whole fleet, read once."""
        nodes = self.fleet()
        me = next((n for n in nodes if n.name == self.node), None)
        return (me if me is not None and me.drained and me.reason == reason else None), nodes

    def drain(self, reason: str) -> tuple[str, str]:
        """Drain with `reason` (must be owned), within the fleet budget. Returns (result, explanation)."""
        if not owns_reason(reason):
            raise ValueError(f"refusing a drain reason fleetheal does not own: {reason!r}")
        nodes = self.fleet()
        info = next((n for n in nodes if n.name == self.node), None)
        if info is None:
            raise FastPathError(f"sinfo: no node {self.node}")
        if info.drained:
            if owns_reason(info.reason):
                return ALREADY, f"{self.node} already drained by fleetheal: {info.reason}"
            return KEPT_FOREIGN, f"{self.node} already drained by someone else ({info.reason!r}); their reason is kept"
        drained, limit = self.budget(nodes)
        if drained >= limit:
            return OVER_BUDGET, (
                f"not draining {self.node}: the fleet already has {drained} fleetheal fault drains and the budget "
                f"allows {limit}; the remediator's gate decides"
            )
        if self.dry_run:
            return WOULD, f"would drain {self.node}: {reason}"
        self._scontrol("update", f"nodename={self.node}", "state=drain", f"reason={reason}")
        return self._within_budget_after(reason)

    def _within_budget_after(self, reason: str) -> tuple[str, str]:
        """Agents of a burst all check the budget at the same moment and all see it free, so each one looks
        again after its drain and keeps it only if fewer drains than the budget allows come before its own
        in slurmctld's order: drain time (to the second), then node name.

        A drain made in the same second may not be visible at once, so the look waits until that second has
        passed on slurmctld (TIE_WAIT_S; the drain itself is already in place). Every drain that comes
        before this one is then visible, so each drain that stays saw every other one that stays before it:
        no more than the budget stay, and the first of a burst always does."""
        self._sleep(TIE_WAIT_S)
        me, nodes = self._me(reason)
        if me is None:
            return DONE, f"drained {self.node}: {reason}"  # someone changed it since: theirs now
        mine = (me.reason_time, self.node)
        ahead, limit = self.budget(nodes, lambda n: (n.reason_time, n.name) < mine)
        if ahead < limit:
            return DONE, f"drained {self.node}: {reason}"
        self._scontrol("update", f"nodename={self.node}", "state=resume")
        return OVER_BUDGET, (
            f"drained {self.node} and lifted the drain again: {ahead} fleetheal fault drains came before it "
            f"and the budget allows {limit}; the remediator's gate decides"
        )


class JobOwners:
    """Who may speak for a job in a training report: root, a configured trusted uid, or the uid that owns
    the Slurm job of that id while it runs on this node (`squeue -j JOB -w NODE`, the sender's uid taken
    by the kernel from the socket, SCM_CREDENTIALS). Anything else is refused: a local user must not raise
    a fault, let alone a requeue, for someone else's job or for a job that does not exist.

    The owner comes first from the file the Slurm prolog writes for each job it starts on this node
    (`jobs_dir/<job id>`, `uid=` line; fleetheal/infra/slurm_hooks.py), believed only when root owns it and its
    directory and no one else may write either: that needs no Slurm client, so the agent's pod (which has
    none) believes a job's owner too. Without that file, Slurm is asked.

    Answers are cached (an owner for `ttl_s`, a refusal for `negative_ttl_s`) and Slurm is asked at most
    `lookups_per_s` times a second, so a flood of reports for invented jobs costs slurmctld nothing more.
    Without Slurm (`squeue=None`) and without a job file, only root and the trusted uids are believed."""

    def __init__(
        self,
        node: str,
        squeue: str | None = "squeue",
        *,
        trusted_uids: tuple[int, ...] = (),
        jobs_dir: str | None = None,
        slurm_conf: str | None = None,
        timeout_s: float = 10.0,
        ttl_s: float = 300.0,
        negative_ttl_s: float = 10.0,
        lookups_per_s: float = 5.0,
        max_entries: int = 4096,
        run: Run = subprocess.run,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.squeue = squeue
        self.trusted = frozenset((0, *trusted_uids))
        self.jobs_dir = jobs_dir
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.lookups_per_s = lookups_per_s
        self.max_entries = max_entries
        self._clock = clock
        env = dict(os.environ)
        if slurm_conf:
            env["SLURM_CONF"] = slurm_conf
        self._runner = Runner(env=env, timeout_s=timeout_s, run=run)
        self._cache: dict[str, tuple[float, int | None, str]] = {}  # job -> (expires, owner uid, why not)
        self._lookups = TokenBucket(lookups_per_s, clock())

    def refuse(self, uid: int | None, job: str) -> str | None:
        """None when `uid` may report for `job` (a Slurm job id, or "" for none), else why not."""
        if uid is None:
            return "the sender's credentials are unknown"
        if uid in self.trusted:
            return None
        if not job:
            return f"uid {uid} may report only for a Slurm job it owns on {self.node} (the report names none)"
        owner, why = self._owner(job)
        if owner is None:
            return why
        if owner != uid:
            return f"uid {uid} does not own job {job} (uid {owner} does)"
        return None

    def _owner(self, job: str) -> tuple[int | None, str]:
        now = self._clock()
        hit = self._cache.get(job)
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        owner = self._prolog_owner(job)
        if owner is not None:
            self._cache[job] = (now + self.negative_ttl_s, owner, "")  # the epilog may remove it: asked again soon
            return owner, ""
        if self.squeue is None:
            return None, "no Slurm to ask who owns the job (fastpath.slurm disabled): only trusted uids may report"
        if not self._lookups.take(now):
            return None, f"job {job}: owner not checked (more than {self.lookups_per_s:g} new jobs a second)"
        owner, why = self._ask(job)
        if len(self._cache) >= self.max_entries:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            while len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
        self._cache[job] = (now + (self.ttl_s if owner is not None else self.negative_ttl_s), owner, why)
        return owner, why

    def _prolog_owner(self, job: str) -> int | None:
        """The uid in the prolog's file of `job`, when root wrote it where only root may write; else None."""
        if not self.jobs_dir or not job.isdigit():
            return None
        try:
            fd = os.open(os.path.join(self.jobs_dir, job), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            where, st = os.stat(self.jobs_dir), os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _root_only(where) or not _root_only(st):
                return None
            text = os.read(fd, 4096).decode("utf-8", "replace")
        except OSError:
            return None
        finally:
            os.close(fd)
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key == "uid" and value.strip().isdigit():
                return int(value.strip())
        return None

    def _ask(self, job: str) -> tuple[int | None, str]:
        args = ("-h", "-j", job, "-w", self.node, "-t", "RUNNING,COMPLETING", "-o", "%U")
        try:
            proc = self._runner.completed(self.squeue or "squeue", *args)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"job {job}: cannot ask Slurm who owns it: {exc}"
        out = proc.stdout.split()
        if proc.returncode != 0 or not out:
            return None, f"job {job} is not running on {self.node}"
        if not out[0].isdigit():
            return None, f"job {job}: squeue printed {out[0]!r} for its uid"
        return int(out[0]), ""


def _status_message(exc: urllib.error.HTTPError) -> str:
    """': <message>' of the API server's Status body (why a request was refused, e.g. by an admission
    policy), at most 300 characters; '' when the body has none."""
    try:
        msg = json.loads(exc.read(64 * 1024)).get("message")
    except (OSError, ValueError, AttributeError):  # no body, not JSON, not an object
        return ""
    return f": {str(msg)[:300]}" if msg else ""


class KubeNodeTainter:
    """Taint and label this node's own Node object (JSON merge patch guarded by resourceVersion)."""

    def __init__(
        self,
        node: str,
        api_url: str,
        token_file: str,
        *,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        dry_run: bool = False,
    ) -> None:
        self.node = node
        self.api_url = api_url.rstrip("/")
        self.token_file = token_file
        self.timeout_s = timeout_s
        self.dry_run = dry_run
        self._ctx: ssl.SSLContext | None = None
        if self.api_url.startswith("https://"):
            import ssl  # only agents with a Kubernetes API pay for ssl and urllib

            self._ctx = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()

    def _request(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        from fleetheal.httpjson import request_json

        with open(self.token_file) as fh:  # re-read: projected tokens rotate
            token = fh.read().strip()
        doc: dict[str, Any] = request_json(
            method,
            f"{self.api_url}/api/v1/nodes/{self.node}",
            body,
            token=token,
            content_type="application/merge-patch+json",
            timeout=self.timeout_s,
            context=self._ctx,
        )
        return doc

    def taint(self, fault_id: str) -> tuple[str, str]:
        import urllib.error

        for _ in range(3):
            try:
                node = self._request("GET")
                taints = list(node.get("spec", {}).get("taints") or [])
                mine = [t for t in taints if t.get("key") == TAINT_UNHEALTHY]
                if mine:
                    return ALREADY, f"{self.node} already tainted {TAINT_UNHEALTHY}={mine[0].get('value')}"
                if self.dry_run:
                    return WOULD, f"would taint {self.node} {TAINT_UNHEALTHY}={fault_id}:NoSchedule"
                taints.append({"key": TAINT_UNHEALTHY, "value": fault_id, "effect": "NoSchedule"})
                self._request(
                    "PATCH",
                    {
                        "metadata": {
                            "labels": {LABEL_FAULT: fault_id},
                            "resourceVersion": node["metadata"]["resourceVersion"],
                        },
                        "spec": {"taints": taints},
                    },
                )
                return DONE, f"tainted {self.node} {TAINT_UNHEALTHY}={fault_id}:NoSchedule"
            except urllib.error.HTTPError as exc:
                if exc.code == 409:  # someone changed the Node between our GET and PATCH: read again
                    continue
                raise FastPathError(f"kubernetes: {exc.code} {exc.reason}{_status_message(exc)}") from exc
            except (OSError, ValueError, KeyError) as exc:
                raise FastPathError(f"kubernetes: {exc}") from exc
        raise FastPathError("kubernetes: the Node kept changing (3 conflicts)")


def _root_only(st: os.stat_result) -> bool:
    """Owned by root and writable by no one else."""
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
