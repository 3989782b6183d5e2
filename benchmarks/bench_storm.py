"""Storms: many GPU nodes fail at once (Xid 79); how fast does fleetheal isolate them, and does it stay safe?

The goals are those of the issue "Recovery in seconds". Three storms, each in an environment of its own:

- **A** (FAILED of NODES, 150 of 1,500): the gate's budget and breaker raised to admit every node. Per
  node, from the moment its alert is posted to Alertmanager until the node is drained in Slurm AND
  cordoned in Kubernetes: P50, P99 (goal P99 < 1.5 s) and throughput (goal >= 100 nodes/s). Every failing
  node runs a Slurm batch job: alert -> job signalled and requeued (goal P90 < 5 s). Then the follow-up
  playbooks: time until every incident is done, or, at the time limit, how many were and at what rate.
- **B** (B_FAILED of B_NODES, 600 of 6,000): the same with drain + cordon only (no jobs): goal P99 < 5 s.
- **C** (safety): storm A's failure (without the jobs) with the production gate defaults: only the budget's
  worth of nodes may be drained and cordoned (counted in Slurm and in the API server), the rest held.

Everything else is the product's defaults (`playbooks/vars/remediation.yml`: standby promotion on, 16 engine
workers, `runner.max_concurrent` 4 except where set), with the grace period 0 s, retries 0 and a 1 s Slurm
retry delay. Each isolation figure's notes break the time down and say where the machine's CPU went.

Real parts: a private Slurm (`SlurmCluster`: slurmctld + one real `slurmd -N` per job-bearing failing node;
the other nodes are configured without a slurmd, so Slurm has them DOWN, and they can still be drained);
a real kube-apiserver + etcd (`KubeControlPlane`, no controller manager) holding every Node object;
`fleetheal remediator serve` with its first responder (`runner.first_response: true`, the default) and the
real playbooks through ansible-runner; a real Alertmanager 0.25 (Debian) routing as the stack's
generated AlertmanagerConfig does (`fleetheal/infra/alerting.py`: group by cluster, node, fault_id,
group_wait 0 s) to the remediator's webhook. The alerts are posted to Alertmanager's /api/v2/alerts as
Prometheus' notifier posts them (batches of at most 256) and every time is counted from that post.

Per-node times come from the remediator's store (the incident timeline's `first_step` events), and are
cross-checked against what Slurm saw (slurmctld's log: `update_node ... state set to DRAIN*`,
`Requeuing JobId=`), what the API server saw (a watch on Nodes, `spec.unschedulable`), what the jobs saw
(each traps USR1 and writes the time), and at the end against Slurm's and the API server's state.

Sizes and limits from the environment: FLEETHEAL_BENCH_STORM_NODES / _FAILED / _JOBS (storms A and C),
FLEETHEAL_BENCH_STORM_B_NODES / _B_FAILED, FLEETHEAL_BENCH_STORM_ONLY (e.g. "A,C"),
FLEETHEAL_BENCH_STORM_MAX_CONCURRENT (playbooks at once in storm A), FLEETHEAL_BENCH_STORM_PLAYBOOK_WAIT_S,
FLEETHEAL_BENCH_STORM_FIRST_WAIT_S (per storm, for every first response), FLEETHEAL_BENCH_STORM_SITE_VARS
(JSON merged into runner.site_vars, for diagnosis), FLEETHEAL_BENCH_STORM_KEEP=1 (keep the private
directory), FLEETHEAL_BENCH_STORM_ALERTMANAGER=0 (post to the webhook directly,
grouped as Alertmanager would). A benchmark, not a test: the safety properties are asserted in
tests/remediator.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

from fleetheal import taxonomy
from fleetheal.contracts import LABEL_FAILURE_DOMAIN, LABEL_POOL, TAINT_UNHEALTHY, budget_limit, owns_reason
from fleetheal.lab.controlplane import KubeControlPlane, tools_built
from fleetheal.lab.monitoring import ALERTMANAGER_BIN, Monitoring, find_binary
from fleetheal.lab.slurm import SlurmCluster
from fleetheal.procs import free_ports, pids_mentioning, wait_gone
from fleetheal.remediator.config import BreakerConfig, BudgetConfig
from fleetheal.remediator.store import Store
from fleetheal.slurm.fields import parse_kv_line
from fleetheal.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
_env = os.environ.get
NODES = int(_env("FLEETHEAL_BENCH_STORM_NODES", "1500"))
FAILED = int(_env("FLEETHEAL_BENCH_STORM_FAILED", str(NODES // 10)))
JOBS = min(FAILED, int(_env("FLEETHEAL_BENCH_STORM_JOBS", str(FAILED))))
B_NODES = int(_env("FLEETHEAL_BENCH_STORM_B_NODES", "6000"))
B_FAILED = int(_env("FLEETHEAL_BENCH_STORM_B_FAILED", str(B_NODES // 10)))
ONLY = {s.strip().upper() for s in _env("FLEETHEAL_BENCH_STORM_ONLY", "A,B,C").split(",") if s.strip()}
MAX_CONCURRENT = int(_env("FLEETHEAL_BENCH_STORM_MAX_CONCURRENT", "4"))
PLAYBOOK_WAIT_S = float(_env("FLEETHEAL_BENCH_STORM_PLAYBOOK_WAIT_S", "180"))
FIRST_WAIT_S = float(_env("FLEETHEAL_BENCH_STORM_FIRST_WAIT_S", "150"))
#: Extra runner.site_vars (JSON), for diagnosis, e.g. '{"fleetheal_promote_standby": false}'.
SITE_VARS: dict[str, Any] = json.loads(_env("FLEETHEAL_BENCH_STORM_SITE_VARS", "{}"))
USE_ALERTMANAGER = _env("FLEETHEAL_BENCH_STORM_ALERTMANAGER", "1") != "0"
RACKS = 10
TOKEN = "bench-storm-token-0123456789"
CLUSTER = "storm"
#: Prometheus' notifier sends at most this many alerts per request to Alertmanager.
PROMETHEUS_BATCH = 256

#: NVSentinel's published burst test (simulated nodes, cordon only): nodes -> P99 seconds; 61-71 nodes/s.
PEER_P99 = {100: 1.44, 200: 2.8, 600: 9.2}
PEER_RATE = 66.0
PEER_NOTE = (
    "peer: NVSentinel's published burst test (simulated nodes, cordon only), a published figure, not measured here"
)


# --- small helpers ---------------------------------------------------------------------------------------


def _wait(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    return wait_until(check, timeout, what, interval=interval, ignore=(Exception,))


def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _peer_p99(n: int) -> float | None:
    """NVSentinel's P99 for n nodes, interpolated between its published points (None outside 100..600)."""
    points = sorted(PEER_P99.items())
    for (n0, p0), (n1, p1) in itertools.pairwise(points):
        if n0 <= n <= n1:
            return p0 + (p1 - p0) * (n - n0) / (n1 - n0)
    return None


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def _kill_leftovers(tmp: Path) -> list[str]:
    """Kill (by PID) every process whose command line names this storm's private directory."""
    found = pids_mentioning(str(tmp))
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in wait_gone(found, 5):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [cmd[:80] for cmd in found.values()]


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 25.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _slurm_ts(text: str) -> float:
    """A slurmctld log time ([2026-01-01T12:00:00.123], local time, as slurmctld writes it)."""
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").timestamp()


class CpuSampler(threading.Thread):
    """CPU seconds by command name over a window, from /proc every `interval` (short-lived processes are
    caught if they live across a sample), and the machine's busy share from /proc/stat."""

    def __init__(self, names: dict[int, str], interval: float = 0.5) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.names = names  # pid -> name to use instead of the comm (the remediator, the bench)
        self.interval = interval
        self.by_name: dict[str, float] = {}
        self._last: dict[int, float] = {}
        self._stop_event = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._snapshot(count=False)
        self._busy0 = self._busy()

    @staticmethod
    def _busy() -> tuple[float, float]:
        with open("/proc/stat", encoding="ascii") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    def _snapshot(self, count: bool = True) -> None:
        seen: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                    raw = f.read()
            except OSError:
                continue
            pid = int(entry)
            comm = raw[raw.find("(") + 1 : raw.rfind(")")]
            fields = raw.rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            seen[pid] = cpu
            if count:
                delta = cpu - self._last.get(pid, 0.0)
                if delta > 0:
                    key = self.names.get(pid, comm)
                    self.by_name[key] = self.by_name.get(key, 0.0) + delta
        self._last = seen

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            with contextlib.suppress(Exception):
                self._snapshot()

    def stop(self) -> str:
        self._stop_event.set()
        self.join(5)
        with contextlib.suppress(Exception):
            self._snapshot()
        b1, t1 = self._busy()
        busy = (b1 - self._busy0[0]) / max(1e-9, t1 - self._busy0[1])
        top = sorted(self.by_name.items(), key=lambda kv: -kv[1])[:7]
        return f"machine {busy:.0%} busy; CPU s by process: " + ", ".join(f"{k} {v:.1f}" for k, v in top)


# --- the alerts ----------------------------------------------------------------------------------------------


def _labels(node: str, rack: str) -> dict[str, str]:
    fault = taxonomy.load().fault("xid-79")
    return {
        "alertname": "FleethealXid79", "cluster": CLUSTER, "node": node, "gpu": "3", "fault_id": "xid-79",
        "class": fault.fault_class, "action": fault.action, "severity": fault.severity, "failure_domain": rack,
        "instance": f"{node}:9400", "job": "fleetheal-agent",
    }  # fmt: skip


def _am_alert(node: str, rack: str, now: float) -> dict[str, Any]:
    """One alert as Prometheus posts it to Alertmanager's API v2 (endsAt an hour on: it is not re-sent)."""
    return {
        "labels": _labels(node, rack),
        "annotations": {"summary": f"{node} GPU 3: GPU has fallen off the bus (Xid 79)"},
        "startsAt": _iso(now),
        "endsAt": _iso(now + 3600),
        "generatorURL": "http://prometheus.storm:9090/graph",
    }


def _webhook_payload(node: str, rack: str, now: float) -> dict[str, Any]:
    """The notification Alertmanager sends for one group (group by cluster, node, fault_id)."""
    labels = _labels(node, rack)
    group = {k: labels[k] for k in ("cluster", "node", "fault_id")}
    key = '{}/{alertname=~"Fleetheal.+"}:{' + ",".join(f'{k}="{v}"' for k, v in group.items()) + "}"
    return {
        "receiver": "fleetheal-remediator", "status": "firing", "groupLabels": group, "commonLabels": labels,
        "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093", "version": "4", "groupKey": key,
        "truncatedAlerts": 0,
        "alerts": [{"status": "firing", "labels": labels, "annotations": {}, "startsAt": _iso(now),
                    "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                    "fingerprint": hashlib.sha256(node.encode()).hexdigest()[:16]}],
    }  # fmt: skip


def _post_json(url: str, doc: Any, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(doc).encode(), headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return int(resp.status)


def _alertmanager_config(mon: Monitoring) -> dict[str, Any]:
    """The lab's receiver (bearer token file, max_alerts 0), routed as the stack's AlertmanagerConfig is."""
    cfg = mon.alertmanager_config()
    receiver = cfg["route"]["receiver"]
    cfg["route"] = {
        "receiver": "blackhole",
        "routes": [
            {
                "receiver": receiver,
                "matchers": ['alertname=~"Fleetheal.+"'],
                "group_by": ["cluster", "node", "fault_id"],
                "group_wait": "0s",
                "group_interval": "30s",
                "repeat_interval": "1h",
            }
        ],
    }
    cfg["receivers"].append({"name": "blackhole"})
    return cfg


# --- watching the API server ---------------------------------------------------------------------------------


class NodeWatch(threading.Thread):
    """A watch on Nodes: the first time each one is seen unschedulable (receipt time, wall clock)."""

    def __init__(self, cp: KubeControlPlane) -> None:
        super().__init__(daemon=True, name="node-watch")
        self.cp = cp
        self.cordoned: dict[str, float] = {}
        self.error = ""
        self._resp: Any = None
        rv = cp.request("GET", "/api/v1/nodes?limit=1")["metadata"]["resourceVersion"]
        self.url = f"{cp.url}/api/v1/nodes?watch=true&resourceVersion={rv}&timeoutSeconds=1800"

    def run(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.cp.pki / "ca.crt"))
        ctx.load_cert_chain(self.cp.pki / "admin.crt", self.cp.pki / "admin.key")
        try:
            with urllib.request.urlopen(self.url, context=ctx, timeout=1800) as resp:
                self._resp = resp
                for line in resp:
                    now = time.time()
                    obj = json.loads(line).get("object", {})
                    name = obj.get("metadata", {}).get("name")
                    if name and obj.get("spec", {}).get("unschedulable") and name not in self.cordoned:
                        self.cordoned[name] = now
        except Exception as exc:  # the API server stopping ends the watch
            self.error = f"{type(exc).__name__}: {exc}"[:200]


# --- one storm -----------------------------------------------------------------------------------------------


def _gate(raised: bool, nodes: int) -> dict[str, Any]:
    if not raised:
        return {}  # the production defaults
    return {
        "budget": {"max_isolated": nodes, "max_isolated_fraction": 1.0, "max_isolated_per_domain": nodes,
                   "max_isolated_fraction_per_domain": 1.0},
        "breaker": {"storm_nodes": nodes, "window_s": 60, "quiet_s": 300},
    }  # fmt: skip


@contextlib.contextmanager
def _environment(
    label: str, nodes: int, failed: int, jobs: int, *, gate: dict[str, Any], max_concurrent: int
) -> Iterator[dict[str, Any]]:
    """Slurm, jobs, the API server with every Node, the remediator and Alertmanager; all stopped on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=f"fleetheal-bench-storm{label}-"))
    names = [f"gpu-{i}" for i in range(1, nodes + 1)]
    rack = {n: f"rack-{i % RACKS:02d}" for i, n in enumerate(names)}
    env: dict[str, Any] = {"tmp": tmp, "names": names, "rack": rack, "failed": names[:failed], "jobs": {}}
    cluster: SlurmCluster | None = None
    cp: KubeControlPlane | None = None
    remediator: subprocess.Popen[bytes] | None = None
    am: subprocess.Popen[bytes] | None = None
    logs = tmp / "logs"
    logs.mkdir()
    t_up = time.monotonic()
    try:
        # Slurm: a slurmd for each job-bearing failing node (gpu-1..gpu-JOBS), the rest configured only.
        with_slurmd = max(1, jobs)
        extra = []
        if nodes > with_slurmd:
            extra.append(f"NodeName=gpu-[{with_slurmd + 1}-{nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 "
                         "Port=9 CPUs=8 RealMemory=1000 State=UNKNOWN")  # fmt: skip
        cluster = SlurmCluster(
            tmp / "slurm", nodes=with_slurmd, gpus_per_node=0, node_prefix="gpu-", extra_conf=extra
        ).start(timeout=180)
        env["cluster"] = cluster
        sig = tmp / "signals"
        sig.mkdir()
        if jobs:
            script = (
                "#!/bin/bash\n"
                f"trap 'echo \"$(date +%s.%N)\" >> {sig}/$SLURM_JOB_ID.usr1' USR1\n"
                f"touch {sig}/$SLURM_JOB_ID.ready\n"
                "while :; do sleep 600 & wait $!; done\n"
            )
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                ids = list(pool.map(
                    lambda n: cluster.sbatch(script, "-w", n, "--requeue", "-J", f"storm-{n}", "-o", "/dev/null"),
                    names[:jobs],
                ))  # fmt: skip
            env["jobs"] = dict(zip(names[:jobs], ids, strict=True))
            _wait(lambda: all((sig / f"{j}.ready").exists() for j in ids), 180, f"{jobs} jobs running")
        env["signals"] = sig
        t_slurm = time.monotonic() - t_up

        # Kubernetes: the real API server, one Node object per node.
        cp = KubeControlPlane(tmp / "kube", controller_manager=False).start()
        env["cp"] = cp
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(
                lambda n: cp.add_nodes([n], labels={LABEL_POOL: "active", LABEL_FAILURE_DOMAIN: rack[n]}),
                names,
            ))  # fmt: skip
        t_kube = time.monotonic() - t_up - t_slurm

        # The remediator, configured as the lab configures it with the real control plane.
        rdir = tmp / "remediator"
        (rdir / "reports").mkdir(parents=True)
        (rdir / "token").write_text(TOKEN)
        (rdir / "token").chmod(0o600)
        inventory = rdir / "inventory"
        inventory.write_text(
            f"[fleetheal_control]\nlocalhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
        )
        port = free_ports()[0]
        cfg = {
            "cluster": {"name": CLUSTER, "nodes": rack},
            "listen": {"host": "127.0.0.1", "port": port},
            "auth": {"token_file": str(rdir / "token")},
            "store": {"path": str(rdir / "remediator.sqlite")},
            "runner": {
                "playbook_dir": str(REPO / "playbooks"), "run_dir": str(rdir / "runs"), "inventory": str(inventory),
                # The follow-ups' run may last as long as the bench waits for them.
                "timeout_s": int(max(300, PLAYBOOK_WAIT_S)), "retries": 0, "max_concurrent": max_concurrent,
                "first_response": True,
                "envvars": {"K8S_AUTH_KUBECONFIG": str(cp.kubeconfig), "SLURM_CONF": str(cluster.conf_path)},
                "site_vars": {"fleetheal_grace_seconds": 0, "fleetheal_slurm_retry_delay_s": 1,
                              "fleetheal_k8s_drain_timeout_s": 30, "fleetheal_kubeconfig": str(cp.kubeconfig),
                              "fleetheal_report_dir": str(rdir / "reports"), **SITE_VARS},
            },
            "gate": gate,
        }  # fmt: skip
        (rdir / "remediator.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        penv = dict(os.environ, SLURM_CONF=str(cluster.conf_path), KUBECONFIG=str(cp.kubeconfig))
        penv["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{penv.get('PATH', os.defpath)}"
        remediator = subprocess.Popen(
            [sys.executable, "-m", "fleetheal", "remediator", "serve", "--config", str(rdir / "remediator.yaml")],
            stdout=open(logs / "remediator.log", "wb"), stderr=subprocess.STDOUT, env=penv,  # noqa: SIM115
            start_new_session=True, cwd=REPO,
        )  # fmt: skip
        env["remediator"] = remediator
        env["url"] = f"http://127.0.0.1:{port}"
        _wait(lambda: urllib.request.urlopen(f"{env['url']}/healthz", timeout=2).status == 200, 60, "the remediator")
        env["store_path"] = str(rdir / "remediator.sqlite")

        # Alertmanager, routing to the remediator's webhook.
        env["am_url"] = None
        if USE_ALERTMANAGER and find_binary(ALERTMANAGER_BIN):
            mdir = tmp / "alertmanager"
            mon = Monitoring(mdir, webhook_url=f"{env['url']}/webhook", webhook_token=TOKEN, cluster=CLUSTER)
            mon.write_configs()
            (mdir / "alertmanager.yml").write_text(yaml.safe_dump(_alertmanager_config(mon), sort_keys=False))
            (mdir / "data").mkdir()
            am = subprocess.Popen(
                [str(mon.alertmanager_bin), f"--config.file={mdir / 'alertmanager.yml'}",
                 f"--storage.path={mdir / 'data'}", f"--web.listen-address=127.0.0.1:{mon.alertmanager_port}",
                 "--cluster.listen-address=", "--log.level=warn"],
                stdout=open(logs / "alertmanager.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            env["am_url"] = mon.alertmanager_url
            _wait(lambda: urllib.request.urlopen(f"{mon.alertmanager_url}/-/ready", timeout=2).status == 200, 30,
                  "Alertmanager")  # fmt: skip
        # The service imports ansible_runner in the background once it listens: let that finish.
        time.sleep(4)
        env["setup"] = (
            f"set-up {time.monotonic() - t_up:.0f} s (Slurm + jobs {t_slurm:.0f} s, API server + Nodes {t_kube:.0f} s)"
        )
        yield env
    finally:
        _stop(am, 10)
        _stop(remediator)
        if cp is not None:
            with contextlib.suppress(Exception):
                cp.stop()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.stop(graceful=False)
        left = _kill_leftovers(tmp)  # what outlived its parent (e.g. a playbook the remediator left running)
        if left:
            print(f"bench_storm {label}: killed leftovers {dict(collections.Counter(left))}", file=sys.stderr)
        if _env("FLEETHEAL_BENCH_STORM_KEEP"):
            print(f"bench_storm {label}: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _post_storm(env: dict[str, Any]) -> tuple[dict[str, float], str]:
    """Post every failing node's alert; each node's post time (wall clock) and how they travelled."""
    failed, rack = env["failed"], env["rack"]
    posted: dict[str, float] = {}
    if env["am_url"]:
        for i in range(0, len(failed), PROMETHEUS_BATCH):
            batch = failed[i : i + PROMETHEUS_BATCH]
            now = time.time()
            for n in batch:
                posted[n] = now
            _post_json(f"{env['am_url']}/api/v2/alerts", [_am_alert(n, rack[n], now) for n in batch])
        how = (f"posted to a real Alertmanager 0.25 (/api/v2/alerts, {PROMETHEUS_BATCH} per request as Prometheus "
               "does), routed as the stack's AlertmanagerConfig (group by cluster, node, fault_id; "
               "group_wait 0 s)")  # fmt: skip
        return posted, how

    def one(n: str) -> int:
        now = time.time()
        posted[n] = now
        return _post_json(f"{env['url']}/webhook", _webhook_payload(n, rack[n], now), TOKEN)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(one, failed))
    return posted, "posted to the webhook directly (no Alertmanager), one notification per node, 32 in flight"


def _first_step_times(store: Store, inc_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per incident: the time of each first-response step that ended done, and every step's outcome."""
    out: dict[int, dict[str, Any]] = {}
    for iid in inc_ids:
        rec: dict[str, Any] = {"outcomes": {}}
        for e in store.events(iid):
            if e.kind != "first_step":
                continue
            head = e.detail.split(":", 1)[0].split()
            if len(head) < 2:
                continue
            step, outcome = head[0], head[1]
            rec["outcomes"].setdefault(step, []).append(outcome)
            if outcome == "done":
                rec[step] = e.ts  # the last one (requeue: one event per job)
        out[iid] = rec
    return out


def _slurm_log(cluster: SlurmCluster) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """From slurmctld's log: node -> first drain, job id -> first requeue, job id -> first signal RPC."""
    drained: dict[str, float] = {}
    requeued: dict[str, float] = {}
    signalled: dict[str, float] = {}
    text = (cluster.log_dir / "slurmctld.log").read_text(errors="replace")
    for m in re.finditer(r"^\[([0-9T:.-]+)\] update_node: node (\S+) state set to DRAIN", text, re.M):
        drained.setdefault(m.group(2), _slurm_ts(m.group(1)))
    for m in re.finditer(r"^\[([0-9T:.-]+)\] Requeuing JobId=(\d+)", text, re.M):
        requeued.setdefault(m.group(2), _slurm_ts(m.group(1)))
    for m in re.finditer(r"^\[([0-9T:.-]+)\] _slurm_rpc_kill_job: REQUEST_KILL_JOB JobId=(\d+)", text, re.M):
        signalled.setdefault(m.group(2), _slurm_ts(m.group(1)))
    return drained, requeued, signalled


def _storm(label: str, nodes: int, failed: int, jobs: int, *, raised: bool, max_concurrent: int,
           playbook_wait_s: float) -> dict[str, Any]:  # fmt: skip
    gate = _gate(raised, nodes)
    with _environment(label, nodes, failed, jobs, gate=gate, max_concurrent=max_concurrent) as env:
        cluster: SlurmCluster = env["cluster"]
        cp: KubeControlPlane = env["cp"]
        watch = NodeWatch(cp)
        watch.start()
        time.sleep(0.5)
        rpid = env["remediator"].pid
        cpu0 = {"remediator": _cpu_s(rpid)}
        store = Store(env["store_path"], "NORMAL")
        sampler = CpuSampler({rpid: "remediator", os.getpid(): "bench"})
        sampler.start()
        try:
            posted, how = _post_storm(env)
            t0 = min(posted.values())
            failed_nodes = set(env["failed"])

            def incidents() -> dict[str, Any]:
                return {i.node: i for i in store.incidents(limit=nodes * 2) if i.node in failed_nodes}

            def first_done(i: Any) -> bool:
                return any(s.name == "first_response" and s.ended_at is not None for s in store.steps(i.id))

            def settled() -> dict[str, Any] | None:
                incs = incidents()
                if len(incs) < failed or not all(i.decision or i.hold_reason for i in incs.values()):
                    return None
                if not all(first_done(i) for i in incs.values() if i.decision == "allow"):
                    return None
                return incs

            timed_out = ""
            try:
                incs = _wait(settled, FIRST_WAIT_S, "every first response", interval=0.25)
            except RuntimeError as exc:
                timed_out = str(exc)
                incs = incidents()
            t_settled = time.time()
            cpu_first = _cpu_s(rpid) - cpu0["remediator"]
            cpu_note = sampler.stop()
            allowed = {n: i for n, i in incs.items() if i.decision == "allow"}
            held = {n: i for n, i in incs.items() if i.hold_reason}
            steps = _first_step_times(store, [i.id for i in incs.values()])
            by_node = {n: steps[i.id] for n, i in incs.items()}

            # Playbooks started while first responses were still running (they share the 2 cores).
            last_first = max(
                (max(r.get("slurm_drain", 0), r.get("k8s_cordon", 0)) for r in by_node.values()), default=t0
            )
            pb_during = sum(
                1
                for i in incs.values()
                for s in store.steps(i.id)
                if s.name == "playbook" and s.started_at <= last_first
            )

            done_info = None
            if playbook_wait_s > 0 and allowed:
                t_pb = time.monotonic()

                def all_done() -> bool:
                    fresh = [store.get(i.id) for i in allowed.values()]
                    return all(f is not None and f.state in ("done", "failed") for f in fresh)

                with contextlib.suppress(RuntimeError):
                    _wait(all_done, max(1.0, playbook_wait_s - (time.time() - t0)), "the follow-up playbooks", 1.0)
                fresh = [store.get(i.id) for i in allowed.values()]
                states: dict[str, int] = {}
                for f in fresh:
                    if f is not None:
                        states[f.state] = states.get(f.state, 0) + 1
                ends = [f.updated_at - posted[f.node] for f in fresh if f is not None and f.state == "done"]
                outcomes = collections.Counter(f.outcome for f in fresh if f is not None and f.state == "failed")
                done_info = {"states": states, "ends": ends, "waited": time.monotonic() - t_pb,
                             "elapsed": time.time() - t0, "failed": dict(outcomes.most_common(3))}  # fmt: skip

            # Cross-checks: Slurm's and the API server's state now, slurmctld's log, the jobs' own files.
            snodes = cluster.nodes()
            drained_now = {n for n, info in snodes.items() if info.drained and owns_reason(info.reason)}
            kitems = cp.request("GET", "/api/v1/nodes")["items"]
            cordoned_now = {
                o["metadata"]["name"] for o in kitems
                if o.get("spec", {}).get("unschedulable")
                and any(t.get("key") == TAINT_UNHEALTHY for t in o["spec"].get("taints") or [])
            }  # fmt: skip
            log_drain, log_requeue, log_signal = _slurm_log(cluster)
            jobs_now: dict[str, dict[str, str]] = {}
            if env["jobs"]:
                out = cluster.scontrol("show", "job", "-o")
                for line in out.splitlines():
                    if line.startswith("JobId="):
                        kv = parse_kv_line(line)  # (the comment's own `incident=` splits it: keep the line)
                        jobs_now[kv["JobId"]] = {**kv, "_line": line}
            usr1: dict[str, float] = {}
            for path in env["signals"].glob("*.usr1"):
                with contextlib.suppress(ValueError, IndexError):
                    usr1[path.stem] = float(path.read_text().split()[0])
            metrics = urllib.request.urlopen(f"{env['url']}/metrics", timeout=10).read().decode()
            breaker = any(line.startswith("fleetheal_remediator_breaker_open 1") for line in metrics.splitlines())
            first_cordon_lat = None
            cordon_ts = sorted((r["k8s_cordon"], n) for n, r in by_node.items() if "k8s_cordon" in r)
            if cordon_ts:
                first_cordon_lat = cordon_ts[0][0] - posted[cordon_ts[0][1]]
        finally:
            sampler._stop_event.set()
            store.close()
        setup = env["setup"]
        jobs_map: dict[str, str] = env["jobs"]

    # --- figures -------------------------------------------------------------------------------------
    iso = {n: max(r["slurm_drain"], r["k8s_cordon"]) - posted[n] for n, r in by_node.items()
           if "slurm_drain" in r and "k8s_cordon" in r}  # fmt: skip
    drain = [r["slurm_drain"] - posted[n] for n, r in by_node.items() if "slurm_drain" in r]
    cordon = [r["k8s_cordon"] - posted[n] for n, r in by_node.items() if "k8s_cordon" in r]
    received = [i.received_at - posted[n] for n, i in incs.items()]
    # The clock starts at the fault's arrival at fleetheal: Alertmanager's post to the webhook.
    arrived = [max(r["slurm_drain"], r["k8s_cordon"]) - incs[n].received_at for n, r in by_node.items()
               if "slurm_drain" in r and "k8s_cordon" in r and n in incs]  # fmt: skip
    failures: dict[str, int] = {}
    for r in by_node.values():
        for step, outs in r["outcomes"].items():
            for o in outs:
                if o != "done":
                    failures[f"{step} {o}"] = failures.get(f"{step} {o}", 0) + 1
    obs_drain = [log_drain[n] - posted[n] for n in failed_nodes if n in log_drain]
    obs_cordon = [watch.cordoned[n] - posted[n] for n in failed_nodes if n in watch.cordoned]
    obs_iso = [max(log_drain[n], watch.cordoned[n]) - posted[n] for n in failed_nodes
               if n in log_drain and n in watch.cordoned]  # fmt: skip
    span = max(iso.values()) if iso else None
    rate = len(iso) / span if span else None
    res: dict[str, Any] = {
        "label": label, "nodes": nodes, "failed": failed, "setup": setup, "how": how, "timed_out": timed_out,
        "allowed": len(allowed), "held": len(held), "iso": list(iso.values()), "drain": drain, "cordon": cordon,
        "received": received, "arrived": arrived, "failures": failures, "rate": rate, "span": span, "breaker": breaker,
        "drained_failed": len(drained_now & failed_nodes), "drained_other": len(drained_now - failed_nodes),
        "cordoned_failed": len(cordoned_now & failed_nodes), "cordoned_other": len(cordoned_now - failed_nodes),
        "obs_drain": obs_drain, "obs_cordon": obs_cordon, "obs_iso": obs_iso, "watch_error": watch.error,
        "cpu_first": cpu_first, "settle_s": t_settled - t0, "pb_during": pb_during, "done": done_info,
        "first_cordon": first_cordon_lat, "max_concurrent": max_concurrent, "cpu_note": cpu_note,
        "hold_reasons": sorted({str(i.hold_reason).split(":")[0] for i in held.values()}),
    }  # fmt: skip
    if jobs_map:
        sig_t = [by_node[n]["slurm_signal"] - posted[n] for n in jobs_map if "slurm_signal" in by_node.get(n, {})]
        req_t = [by_node[n]["slurm_requeue"] - posted[n] for n in jobs_map if "slurm_requeue" in by_node.get(n, {})]
        job_obs_req = [log_requeue[j] - posted[n] for n, j in jobs_map.items() if j in log_requeue]
        job_obs_sig = [usr1[j] - posted[n] for n, j in jobs_map.items() if j in usr1]
        requeued_now = sum(
            1 for j in jobs_map.values()
            if int(jobs_now.get(j, {}).get("Restarts", "0") or 0) > 0
            and "incident=inc-" in jobs_now.get(j, {}).get("_line", "")
        )  # fmt: skip
        pending_now = sum(1 for j in jobs_map.values() if jobs_now.get(j, {}).get("JobState") == "PENDING")
        res.update(jobs=len(jobs_map), sig_t=sig_t, req_t=req_t, job_obs_req=job_obs_req, job_obs_sig=job_obs_sig,
                   requeued_now=requeued_now, pending_now=pending_now,
                   kill_rpc=sum(1 for j in jobs_map.values() if j in log_signal))  # fmt: skip
    return res


# --- the report ----------------------------------------------------------------------------------------------


def _dist(values: list[float]) -> str:
    return f"P50 {_f(_pct(values, 50))} / P90 {_f(_pct(values, 90))} / P99 {_f(_pct(values, 99))} s (n {len(values)})"


def _isolation_rows(r: dict[str, Any], goal: str) -> list[dict[str, Any]]:
    n = r["failed"]
    iso = r["iso"]
    complete = len(iso) == n
    p99 = _pct(iso, 99) if complete else (r["settle_s"] if not iso else max(_pct(iso, 99) or 0, r["settle_s"]))
    peer = _peer_p99(n)
    notes = (
        f"{n} of {r['nodes']} nodes, Xid 79, gate budget and breaker raised (allowed {r['allowed']}, "
        f"held {r['held']}); "
        f"per node from the alert's post to Alertmanager until drained in Slurm AND cordoned+tainted in the API "
        f"server, from the store's first_step events: {_dist(iso)}; isolated {len(iso)}/{n}"
        f"{'' if complete else ' (INCOMPLETE at the time limit: p99 is a lower bound)'}; from the alert's arrival "
        f"at fleetheal (Alertmanager's post to the webhook, the issue's clock) {_dist(r['arrived'])}. Breakdown: "
        f"webhook received {_dist(r['received'])}; drained {_dist(r['drain'])}; cordoned {_dist(r['cordon'])}; the "
        f"first cordon {_f(r['first_cordon'])} s. Seen by Slurm (slurmctld log, DRAIN set) {_dist(r['obs_drain'])}; "
        f"by the API server (Node watch, unschedulable) {_dist(r['obs_cordon'])}; both {_dist(r['obs_iso'])}. "
        f"State at the end: Slurm drained (owned reason) {r['drained_failed']}/{n} failing + {r['drained_other']} "
        f"others; API server cordoned+tainted {r['cordoned_failed']}/{n} + {r['cordoned_other']} others. "
        f"Non-done step outcomes {r['failures'] or 'none'}. Remediator CPU {r['cpu_first']:.1f} s until every first "
        f"response ended ({r['settle_s']:.1f} s; {r['cpu_note']}); {r['pb_during']} playbook attempts queued "
        f"(runner.max_concurrent {r['max_concurrent']} at once) before the last isolation. "
        f"Alerts {r['how']}. {r['setup']}. {PEER_NOTE}: P99 {_f(peer)} s for {n} nodes"
        f"{' (interpolated between 100 -> 1.44 s and 200 -> 2.8 s)' if n not in PEER_P99 and peer else ''}."
        f"{' ' + r['timed_out'] if r['timed_out'] else ''}"
        f"{' watch: ' + r['watch_error'] if r['watch_error'] and not r['obs_cordon'] else ''}"
    )  # fmt: skip
    rate = r["rate"]
    return [
        {"name": f"storm {r['label']}: alert -> drained + cordoned, {n} of {r['nodes']} nodes", "unit": "s",
         "median": _pct(iso, 50), "p99": p99, "n": len(iso), "goal": goal, "peer": peer,
         "ratio_to_peer": (p99 / peer) if (p99 is not None and peer) else None, "notes": notes},
        {"name": f"storm {r['label']}: isolation throughput, {n} nodes", "unit": "nodes/s", "median": rate, "p99": rate,
         "n": 1, "goal": ">= 100 nodes/s", "peer": PEER_RATE,
         "ratio_to_peer": (rate / PEER_RATE) if rate else None,
         "notes": f"{len(iso)} nodes isolated / {_f(r['span'])} s from the first alert's post to the last node "
                  f"drained and cordoned; {PEER_NOTE}: 61-71 nodes/s (66 taken)"},
    ]  # fmt: skip


def _job_row(r: dict[str, Any]) -> dict[str, Any]:
    req = r["req_t"]
    notes = (
        f"{r['jobs']} batch jobs (one per failing node, sbatch -w NODE --requeue, a script trapping USR1), grace "
        f"period 0 s (fleetheal_grace_seconds: 0). From the alert's post: requeued (store, slurm_requeue done: "
        f"scontrol requeue + priority/comment update) {_dist(req)}; signalled (store) {_dist(r['sig_t'])}; "
        f"USR1 received by the job script {_dist(r['job_obs_sig'])}; requeue seen by slurmctld ('Requeuing "
        f"JobId') {_dist(r['job_obs_req'])}. At the end Slurm shows {r['requeued_now']}/{r['jobs']} with Restarts>0 "
        f"and incident= in the comment, {r['pending_now']} PENDING; slurmctld logged a signal RPC for "
        f"{r['kill_rpc']}. Goal is on P90: {_f(_pct(req, 90))} s."
    )  # fmt: skip
    return {"name": f"storm {r['label']}: alert -> every job signalled and requeued ({r['jobs']} jobs)", "unit": "s",
            "median": _pct(req, 50), "p99": _pct(req, 99), "n": len(req), "goal": "P90 < 5 s", "peer": None,
            "ratio_to_peer": None, "notes": notes}  # fmt: skip


def _playbook_row(r: dict[str, Any]) -> dict[str, Any]:
    d = r["done"]
    ends = d["ends"]
    n = r["allowed"]
    finished = d["states"].get("done", 0) + d["states"].get("failed", 0)
    complete = finished == n
    rate = (len(ends) / max(ends)) if ends else 0.0
    notes = (
        f"{n} allowed incidents, ISOLATE_AND_RELOCATE playbook through ansible-runner after the first response, "
        f"runner.max_concurrent {r['max_concurrent']}, retries 0; states after {d['elapsed']:.0f} s: {d['states']}; "
        f"done per node from the alert {_dist(ends)}; {len(ends)} done at {rate:.2f} incidents/s"
        f"{'; failed outcomes ' + str(d['failed']) if d.get('failed') else ''}"
        f"{'' if complete else f' (time limit {PLAYBOOK_WAIT_S:.0f} s reached: not all done)'}"
    )  # fmt: skip
    return {"name": f"storm {r['label']}: every allowed incident done (follow-up playbooks)", "unit": "s",
            "median": _pct(ends, 50), "p99": (max(ends) if complete and ends else d["elapsed"]), "n": len(ends),
            "goal": "-", "peer": None, "ratio_to_peer": None, "notes": notes}  # fmt: skip


def _safety_row(r: dict[str, Any]) -> dict[str, Any]:
    b, br = BudgetConfig(), BreakerConfig()
    limit = budget_limit(b.max_isolated, b.max_isolated_fraction, r["nodes"])
    per_rack = budget_limit(b.max_isolated_per_domain, b.max_isolated_fraction_per_domain, r["nodes"] // RACKS)
    isolated = max(r["drained_failed"] + r["drained_other"], r["cordoned_failed"] + r["cordoned_other"])
    notes = (
        f"{r['failed']} of {r['nodes']} nodes fail at once, production gate defaults (budget {limit} nodes, "
        f"{per_rack} per rack of {r['nodes'] // RACKS}; breaker at {br.storm_nodes} nodes in {br.window_s:g} s): "
        f"allowed {r['allowed']}, held "
        f"{r['held']} ({', '.join(r['hold_reasons'])}), breaker open {r['breaker']}. Counted in Slurm: "
        f"{r['drained_failed'] + r['drained_other']} nodes drained with an owned reason ({r['drained_other']} not "
        f"failing); in the API server: {r['cordoned_failed'] + r['cordoned_other']} cordoned+tainted; the other "
        f"{r['failed'] - isolated} failing nodes left in service, their incidents held. "
        f"{'WITHIN' if isolated <= limit else 'OVER'} the budget. Decided {r['settle_s']:.1f} s after the first post. "
        f"{r['setup']}."
    )  # fmt: skip
    name = f"storm {r['label']} (safety): nodes isolated with the default budget, {r['failed']} of {r['nodes']} failing"
    return {"name": name,
            "unit": "nodes", "median": float(isolated), "p99": float(isolated), "n": 1,
            "goal": f"<= {limit} (the budget), the rest held", "peer": None, "ratio_to_peer": None,
            "notes": notes}  # fmt: skip


def run() -> list[dict[str, Any]]:
    if not tools_built():
        raise RuntimeError("kube-apiserver and etcd are not built (make tools): the storm needs the real API server")
    rows: list[dict[str, Any]] = []
    if "A" in ONLY:
        a = _storm("A", NODES, FAILED, JOBS, raised=True, max_concurrent=MAX_CONCURRENT,
                   playbook_wait_s=PLAYBOOK_WAIT_S)  # fmt: skip
        rows += _isolation_rows(a, "P99 < 1.5 s")
        if a.get("jobs"):
            rows.append(_job_row(a))
        if a["done"] is not None:
            rows.append(_playbook_row(a))
    if "B" in ONLY:
        b = _storm("B", B_NODES, B_FAILED, 0, raised=True, max_concurrent=4, playbook_wait_s=0)
        rows += _isolation_rows(b, "P99 < 5 s")
    if "C" in ONLY:
        c = _storm("C", NODES, FAILED, 0, raised=False, max_concurrent=4, playbook_wait_s=0)
        rows.append(_safety_row(c))
    return rows
