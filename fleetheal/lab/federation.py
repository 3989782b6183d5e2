"""A real Slurm federation on one machine: several `SlurmCluster`s sharing one slurmdbd and MariaDB.

`Federation(state_dir).start()` brings up, all on loopback and all under `state_dir`:

- `base/`: one `munged`, a private MariaDB (`mariadb-install-db` once, then `mariadbd`) and one
  `slurmdbd`, in their own PID namespace (one PID takes them all down, like `SlurmCluster`);
- one `SlurmCluster` per cluster (`a/`, `b/`, `c/` by default, nodes `a1,a2,b1,...`), each with its
  own namespace, all with the same munge key, accounting to the shared slurmdbd, typed GPU GRES
  (`gpu:<type>:<n>`) and multifactor priority (AGE and JOBSIZE weights, PriorityCalcPeriod=1);
- the accounting objects fleetheal expects: QOS `large` and `small`, account `fleetheal` with user
  root as its default (AccountingStorageEnforce=associations,limits,qos, so a plain `sbatch` needs
  them), and the federation itself.

Slurm 22.05 forms a federation only in one order, and never retries a broken link (measured, see
ENVIRONMENT.md "Slurm federation"): munged, MariaDB, slurmdbd, `sacctmgr add cluster`, the
controllers one after another (each listening and registered in the database before the next), then
`sacctmgr add federation`, then wait until every sibling is `Synced:Yes`. `start`, `rejoin` and
`resync` follow it; `resync` (remove + add the federation) is the repair when a link stays broken, and `start`
applies it too when a link has not synced 15 s after forming (seen once in CI, with 22.05).

A cluster's remediator for this federation is `fleetheal.lab.fedremediator.ClusterRemediator`. This module stays
over 500 lines because `Federation` is one supervisor whose parts (the shared base's files and namespace, the
clusters, the ordered forming and repair of the federation, placement reads) follow that one start order and
share its state; split apart, they would only hand it to each other.

Clients reach the federation through `env` (its `SLURM_CONF` names the slurmdbd and the first cluster's
controller): `squeue -M all`, `sbatch -M a`, `sacctmgr ...`. Each cluster's own `env` works too.

Example::

    fed = Federation(tmp_path / "fed").start()
    try:
        job = fed.clusters["a"].sbatch("#!/bin/sh\\nsleep 60\\n", "--gres=gpu:8")
        print(fed.run("squeue", "-M", "all").stdout)
    finally:
        fed.stop()
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Self

import yaml

from fleetheal import procs
from fleetheal.fleet.config import NAME, Cluster, FleetConfig
from fleetheal.lab.slurm import (
    Release,
    SlurmCluster,
    SlurmError,
    find_tool,
    namespace_init,
    recorded_holder,
    stop_holder,
)
from fleetheal.lab.supervisor import Supervisor, spawn
from fleetheal.procs import free_ports
from fleetheal.wait import WaitTimeout, wait_until

__all__ = ["DEFAULT_GPU_TYPES", "Federation", "SlurmError"]

#: GPU models of the default clusters: two alike (a, b) and one different (c).
DEFAULT_GPU_TYPES: Mapping[str, str] = MappingProxyType({"a": "h100", "b": "h100", "c": "a100"})

_META_FILE = "federation.json"
_DB_USER = "slurm"
_DB_PASS = "fleetheal-lab-slurmdbd"  # noqa: S105 - a loopback lab database
_DB_NAME = "slurm_acct_db"

#: Multifactor priority with visible AGE and JOBSIZE factors. PriorityMaxAge=10 (minutes) makes AGE
#: grow by a tenth of its weight per minute; Slurm recomputes it at most once a minute.
PRIORITY_CONF: tuple[str, ...] = (
    "PriorityType=priority/multifactor",
    "PriorityWeightAge=10000",
    "PriorityWeightJobSize=1000",
    "PriorityMaxAge=10",
    "PriorityCalcPeriod=1",
)


class Federation(Supervisor):
    """A Slurm federation of `clusters` (one slurmctld and `nodes_per_cluster` slurmd each) on loopback.

    Args:
        state_dir: every file lives here; reusing it keeps MariaDB's data and each controller's state.
        clusters: ClusterNames, in start order (the first one's controller is the clients' default).
        nodes_per_cluster: slurmd per cluster; node names are `<cluster><i>`.
        gpus_per_node: fake GPUs per node.
        gpu_types: GRES type per cluster (`gpu:<type>:<n>`); a cluster missing here has untyped GPUs.
        name: the federation's name (`sacctmgr show federation`).
        extra_conf: slurm.conf lines added to every cluster (after the federation's own).
        fast_timers: the short timers of tests (`SlurmCluster`); False: the deployed ones (the demo's).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        clusters: Sequence[str] = ("a", "b", "c"),
        nodes_per_cluster: int = 2,
        gpus_per_node: int = 8,
        gpu_types: Mapping[str, str] | None = None,
        *,
        name: str = "fed",
        cpus_per_node: int = 8,
        extra_conf: Sequence[str] = (),
        fast_timers: bool = True,
    ) -> None:
        names = list(clusters)
        if len(names) < 2:
            raise ValueError(f"a federation needs at least 2 clusters, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"cluster names repeat: {names}")
        for n in [*names, name]:
            # Cluster names become node-name prefixes and database table prefixes: keep them plain.
            if not NAME.fullmatch(n) or not re.fullmatch(r"[a-z][a-z0-9]*", n):
                raise ValueError(f"name {n!r}: use lower-case letters and digits, starting with a letter")
        if nodes_per_cluster < 1 or gpus_per_node < 1:
            raise ValueError("nodes_per_cluster and gpus_per_node must be at least 1")
        types = dict(DEFAULT_GPU_TYPES if gpu_types is None else gpu_types)
        self.state_dir = Path(state_dir).resolve()
        self.base = self.state_dir / "base"
        self.name = name
        self.names = names
        self.nodes_per_cluster = nodes_per_cluster
        self.gpus_per_node = gpus_per_node
        self.gpu_types = {n: types[n] for n in names if n in types}
        self.cpus_per_node = cpus_per_node
        self.extra_conf = list(extra_conf)
        self.fast_timers = fast_timers
        self.holder_pid: int | None = None
        self._holder: subprocess.Popen[bytes] | None = None
        self.clusters: dict[str, SlurmCluster] = {}
        self.dbd_port = 0
        self.db_port = 0
        #: How many times `resync` had to re-create the federation (rejoins that did not heal by themselves).
        self.resyncs = 0

    # ---- paths and clients -----------------------------------------------------------------

    @property
    def conf_path(self) -> Path:
        """The clients' slurm.conf: the shared slurmdbd, and the first cluster as the default one."""
        return self.base / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients that reach every cluster (`-M all`, `-M b`, `sacctmgr`)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    @staticmethod
    def _tool(name: str) -> str:
        return find_tool(name)

    @functools.cached_property
    def release(self) -> Release:
        """The Slurm the federation runs (`fleetheal.lab.slurm.Release`)."""
        return Release.of(self._tool("slurmctld"))

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client against the federation (`env`)."""
        proc = subprocess.run(
            [self._tool(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise SlurmError(
                f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def sacctmgr(self, *args: str, check: bool = True) -> str:
        """`sacctmgr -i ARGS` (no confirmation prompt); returns its output."""
        return self.run("sacctmgr", "-i", *args, check=check).stdout

    def squeue(self, *args: str) -> str:
        """`squeue -M all ARGS`: the jobs of every cluster, as each cluster sees them."""
        return self.run("squeue", "-M", "all", *args).stdout

    # ---- lifecycle -------------------------------------------------------------------------

    def _munge_key(self) -> bytes:
        key = self.base / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        return key.read_bytes()

    def _write_client_conf(self, ctld_port: int) -> None:
        lines = [
            "# Written by fleetheal.lab.federation.Federation: clients of the federation (sacctmgr, squeue -M).",
            f"ClusterName={self.names[0]}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=localhost",
            f"AccountingStoragePort={self.dbd_port}",
            # 22.05: AuthInfo=socket= does not cover the link to slurmdbd; this does.
            f"AccountingStoragePass={self.munge_socket}",
            "FederationParameters=fed_display",
            "GresTypes=gpu",
            f"NodeName=placeholder NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={self.cpus_per_node} State=UNKNOWN",
            "PartitionName=gpu Nodes=ALL Default=YES State=UP",
            *self.release.conf_lines(),
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _write_base(self) -> None:
        b = self.base
        for sub in ("etc", "log", "run", "munge", "db"):
            (b / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o755)  # noqa: S103 - clients traverse to the munge socket
        os.chmod(b, 0o755)  # noqa: S103 - same
        os.chmod(b / "munge", 0o755)  # noqa: S103 - same
        self._munge_key()
        self.dbd_port, self.db_port, placeholder = free_ports(3)
        self._write_client_conf(placeholder)
        dbd = [
            "# Written by fleetheal.lab.federation.Federation.",
            "DbdHost=localhost",
            "DbdAddr=127.0.0.1",
            f"DbdPort={self.dbd_port}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"LogFile={b / 'log' / 'slurmdbd.log'}",
            f"PidFile={b / 'run' / 'slurmdbd.pid'}",
            "DebugLevel=info",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={self.db_port}",
            f"StorageUser={_DB_USER}",
            f"StoragePass={_DB_PASS}",
            f"StorageLoc={_DB_NAME}",
            *self.release.conf_lines(),
        ]
        path = b / "etc" / "slurmdbd.conf"
        path.write_text("\n".join(dbd) + "\n")
        os.chmod(path, 0o600)  # slurmdbd refuses a readable slurmdbd.conf (it holds the password)

    def _init_script(self) -> str:
        b = self.base
        q = shlex.quote
        data = b / "db" / "data"
        dbsock = b / "run" / "mysqld.sock"
        install = ""
        if not (data / "mysql").is_dir():
            install = (
                f"{q(self._tool('mariadb-install-db'))} --no-defaults --datadir={q(str(data))} --user=root "
                f"--auth-root-authentication-method=socket --skip-test-db >>{q(str(b / 'log' / 'mariadb-install.out'))}"
                " 2>&1 || exit 4"
            )
        sql = (
            f"CREATE USER IF NOT EXISTS '{_DB_USER}'@'127.0.0.1' IDENTIFIED BY '{_DB_PASS}'; "
            f"GRANT ALL ON *.* TO '{_DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        # PID 1 of the namespace: munged, MariaDB, slurmdbd in that order; on TERM every process of the
        # namespace (kill -1 from a namespace's init reaches them all) gets TERM, then init waits.
        return f"""\
export SLURM_CONF={q(str(self.conf_path))}
stop() {{ kill -TERM -1 2>/dev/null; i=0
  while kill -0 -1 2>/dev/null && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 0; }}
trap stop TERM INT
{q(self._tool("munged"))} -F -f --socket={q(str(self.munge_socket))} --key-file={q(str(b / "munge" / "munge.key"))} \
 --log-file={q(str(b / "log" / "munged.log"))} --pid-file={q(str(b / "run" / "munged.pid"))} \
 --seed-file={q(str(b / "munge" / "munged.seed"))} >>{q(str(b / "log" / "munged.out"))} 2>&1 &
{install}
rm -f {q(str(dbsock))}
{q(self._tool("mariadbd"))} --no-defaults --datadir={q(str(data))} --user=root --port={self.db_port} \
 --bind-address=127.0.0.1 --socket={q(str(dbsock))} --skip-name-resolve \
 --pid-file={q(str(b / "run" / "mariadbd.pid"))} >>{q(str(b / "log" / "mariadbd.out"))} 2>&1 &
i=0; while [ ! -S {q(str(dbsock))} ] || [ ! -S {q(str(self.munge_socket))} ]; do
  sleep 0.02; i=$((i+1)); [ $i -gt 3000 ] && exit 3; done
{q(self._tool("mariadb"))} --no-defaults --socket={q(str(dbsock))} -u root -e {q(sql)} \
 >>{q(str(b / "log" / "mariadb-user.out"))} 2>&1 || exit 5
{q(self._tool("slurmdbd"))} -D >>{q(str(b / "log" / "slurmdbd.out"))} 2>&1 &
while :; do wait; sleep 1; done
"""

    def running(self) -> bool:
        return self.holder_pid is not None and procs.alive(self.holder_pid)

    def _base_ns_init(self) -> int | None:
        return namespace_init(self.holder_pid)

    def _start_base(self, timeout: float) -> None:
        if recorded_holder(self.base, _META_FILE) is not None:
            raise SlurmError(f"a federation is already running in {self.state_dir}; stop it first")
        self._write_base()
        script = self.base / "run" / "init.sh"
        script.write_text(self._init_script())
        self._holder = spawn(
            [self._tool("unshare"), "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", str(script)],
            self.base / "log" / "init.out",
            env=self.env,
        )
        self.holder_pid = self._holder.pid
        self._save_meta()

        def dbd_up() -> bool:
            if not self.running():
                raise SlurmError(f"munged/MariaDB/slurmdbd exited; see {self.base / 'log'}")
            return self.run("sacctmgr", "-n", "-P", "show", "cluster", check=False, timeout=10).returncode == 0

        self._wait("slurmdbd to answer", dbd_up, timeout, interval=0.1)

    def _save_meta(self) -> None:
        meta = {
            "holder_pid": self.holder_pid,
            "clusters": self.names,
            "name": self.name,
            "nodes_per_cluster": self.nodes_per_cluster,
            "gpus_per_node": self.gpus_per_node,
            "gpu_types": self.gpu_types,
            "cluster_holders": {n: c.holder_pid for n, c in self.clusters.items()},
        }
        (self.base / _META_FILE).write_text(json.dumps(meta))

    def _cluster(self, name: str) -> SlurmCluster:
        sock = self.state_dir / name / "munge" / "munge.socket"
        conf = [
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=localhost",
            f"AccountingStoragePort={self.dbd_port}",
            f"AccountingStoragePass={sock}",
            "AccountingStorageEnforce=associations,limits,qos",
            "AccountingStorageTRES=gres/gpu",
            "FederationParameters=fed_display",
            *PRIORITY_CONF,
            *self.extra_conf,
        ]
        return SlurmCluster(
            self.state_dir / name,
            nodes=self.nodes_per_cluster,
            gpus_per_node=self.gpus_per_node,
            cpus_per_node=self.cpus_per_node,
            node_prefix=name,
            extra_conf=conf,
            cluster_name=name,
            gpu_type=self.gpu_types.get(name),
            munge_key=self._munge_key(),
            fast_timers=self.fast_timers,
        )

    def _accounts(self) -> None:
        """Clusters, QOS, the `fleetheal` account and root's association: before any controller starts,
        so each loads them from slurmdbd at once. Idempotent (a reused state dir already has them)."""
        existing = set(self.run("sacctmgr", "-n", "-P", "show", "cluster", "format=cluster").stdout.split())
        missing = [n for n in self.names if n not in existing]
        if missing:
            self.sacctmgr("add", "cluster", *missing)
        qos = set(self.run("sacctmgr", "-n", "-P", "show", "qos", "format=name").stdout.split())
        if missing_qos := [q for q in ("large", "small") if q not in qos]:
            self.sacctmgr("add", "qos", ",".join(missing_qos))
        clusters = ",".join(self.names)
        accounts = self.run("sacctmgr", "-n", "-P", "show", "assoc", "format=cluster,account,user").stdout
        have = {tuple(line.split("|")) for line in accounts.split()}
        if any((c, "fleetheal", "") not in have for c in self.names):
            self.sacctmgr(
                "add", "account", "fleetheal", f"cluster={clusters}", "description=fleetheal", "organization=lab"
            )
        if any((c, "fleetheal", "root") not in have for c in self.names):
            self.sacctmgr("add", "user", "root", "account=fleetheal", f"cluster={clusters}", "qos=normal,large,small")
        self.sacctmgr("modify", "user", "root", "set", "defaultaccount=fleetheal")

    def start(self, timeout: float = 60.0) -> Self:
        """Bring everything up in the one order that works (module docstring); on failure nothing stays up."""
        try:
            self._start_base(timeout)
            self._accounts()
            for name in self.names:
                cluster = self._cluster(name)
                cluster.start(timeout=timeout)
                self.clusters[name] = cluster
                self._save_meta()
                if name == self.names[0]:
                    self._write_client_conf(self._ctld_port(cluster))
                self._wait_controller(name, timeout)
            self._form(timeout)
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    @staticmethod
    def _ctld_port(cluster: SlurmCluster) -> int:
        m = re.search(r"^SlurmctldPort=(\d+)$", cluster.conf_path.read_text(), re.M)
        if m is None:
            raise SlurmError(f"no SlurmctldPort in {cluster.conf_path}")
        return int(m.group(1))

    def _wait_controller(self, name: str, timeout: float) -> None:
        """Until the cluster's controller has registered its ControlPort in slurmdbd and answers ping."""
        cluster = self.clusters[name]
        port = str(self._ctld_port(cluster))

        def registered() -> bool:
            out = self.run(
                "sacctmgr", "-n", "-P", "show", "cluster", f"name={name}", "format=controlport", check=False
            ).stdout.split()
            return out == [port] and "is UP" in cluster.run("scontrol", "ping", check=False, timeout=10).stdout

        self._wait(f"cluster {name}'s controller to register with slurmdbd", registered, timeout, interval=0.1)

    #: How long a freshly made federation may take to sync before it is made again: 22.05 never retries a link
    #: that broke while the federation formed, so waiting longer for it does not help.
    FORM_SETTLE_S = 15.0

    def _form(self, timeout: float) -> None:
        """Make the federation and wait for every link; a link still broken after FORM_SETTLE_S gets the
        repair (remove + add) until `timeout`. The error names what each controller saw last."""
        deadline = time.monotonic() + timeout
        while True:
            feds = self.run("sacctmgr", "-n", "-P", "show", "federation", "format=federation").stdout.split()
            if self.name in feds:
                self.sacctmgr("remove", "federation", self.name)
            self.sacctmgr("add", "federation", self.name, f"clusters={','.join(self.names)}")
            left = deadline - time.monotonic()
            try:
                self.wait_synced(timeout=min(left, self.FORM_SETTLE_S))
                return
            except SlurmError as e:
                if left <= self.FORM_SETTLE_S:
                    raise SlurmError(f"{e}; what each controller saw last:\n{self._federation_views()}") from e

    def _federation_views(self) -> str:
        views = []
        for name, cluster in self.clusters.items():
            try:
                seen = cluster.run("scontrol", "show", "federation", check=False, timeout=10).stdout.strip()
            except subprocess.TimeoutExpired:
                seen = "(scontrol show federation did not answer in 10 s)"
            views.append(f"{name}: {seen}")
        return "\n".join(views)

    def synced(self, names: Sequence[str] | None = None) -> bool:
        """True when every cluster in `names` (default all) sees every other as a synced sibling."""
        want = list(names or self.names)
        for name in want:
            out = self.clusters[name].run("scontrol", "show", "federation", check=False, timeout=10).stdout
            sib = {m.group(1): m.group(2) for m in re.finditer(r"^Sibling:\s+(\S+?):.*?Synced:(\w+)", out, re.M)}
            if any(sib.get(other) != "Yes" for other in want if other != name):
                return False
        return True

    def wait_synced(self, names: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        # A controller slow to answer (`scontrol` past its 10 s) is "not yet", not a failure of the wait.
        self._wait(
            "every sibling Synced:Yes",
            lambda: self.synced(names),
            timeout,
            interval=0.1,
            ignore=(subprocess.TimeoutExpired,),
        )

    def resync(self, timeout: float = 30.0) -> None:
        """Remove and re-add the federation: 22.05's repair for links that never come back by themselves."""
        self.resyncs += 1
        self._form(timeout)

    def drop(self, name: str, timeout: float = 30.0) -> None:
        """Take cluster `name` out: stop its slurmctld gracefully (jobs and node state saved; its slurmd
        and their jobs keep running). The others stay synced with each other."""
        self._known(name).stop_slurmctld(timeout=timeout)

    def rejoin(self, name: str, timeout: float = 60.0, settle: float = 5.0) -> None:
        """Start cluster `name`'s slurmctld again (it recovers its saved state) and get every link back:
        first wait `settle` seconds for the siblings to reconnect; if they do not, `resync`."""
        cluster = self._known(name)
        cluster.start_slurmctld(timeout=timeout)
        self._wait_controller(name, timeout)
        with contextlib.suppress(SlurmError):
            self.wait_synced(timeout=settle)
            return
        self.resync(timeout=timeout)

    def _known(self, name: str) -> SlurmCluster:
        if name not in self.clusters:
            raise SlurmError(
                f"unknown cluster {name!r}; clusters are {', '.join(self.clusters) or 'none (not started)'}"
            )
        return self.clusters[name]

    def processes(self) -> dict[int, str]:
        """Every process of the federation (all its PID namespaces): {pid as we see it: command line}."""
        init = self._base_ns_init()
        found = {} if init is None else procs.namespace_processes(init)
        for cluster in self.clusters.values():
            found.update(cluster.processes())
        return found

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop every cluster, then slurmdbd, MariaDB and munged; nothing survives, even after a failure."""
        errors: list[str] = []

        def stop_one(cluster: SlurmCluster) -> None:
            try:
                cluster.stop(graceful=graceful, timeout=timeout)
            except Exception as exc:  # keep stopping the rest; reported below
                errors.append(str(exc))

        # The clusters are independent: stopping them side by side (each saves its own state) takes as long
        # as the slowest one.
        with ThreadPoolExecutor(max_workers=max(1, len(self.clusters))) as pool:
            list(pool.map(stop_one, list(self.clusters.values())))
        if self.holder_pid is not None:
            init = self._base_ns_init()
            if graceful and init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGTERM)
                procs.wait_gone([init], timeout)
            left = stop_holder(self._holder, self.holder_pid, init, timeout)
            if left:
                errors.append(f"federation base in {self.base} did not stop (pids {left})")
            self._holder = None
            self.holder_pid = None
        with contextlib.suppress(FileNotFoundError):
            (self.base / _META_FILE).unlink()
        if errors:
            raise SlurmError("; ".join(errors))

    @classmethod
    def attach(cls, state_dir: str | os.PathLike[str]) -> Federation:
        """The federation started earlier (maybe by another process, `fleetheal lab up`) in state_dir."""
        state = Path(state_dir).resolve()
        base = state / "base"
        if recorded_holder(base, _META_FILE) is None:
            raise SlurmError(f"no running federation in {state}")
        meta = json.loads((base / _META_FILE).read_text())
        fed = cls(
            state,
            meta["clusters"],
            meta["nodes_per_cluster"],
            meta["gpus_per_node"],
            meta["gpu_types"],
            name=meta["name"],
        )
        fed.holder_pid = int(meta["holder_pid"])
        for name in meta["cluster_holders"]:
            with contextlib.suppress(SlurmError):
                fed.clusters[name] = SlurmCluster.attach(state / name)
        return fed

    # ---- jobs ------------------------------------------------------------------------------

    def placements(self) -> dict[str, list[tuple[str, str]]]:
        """{job id: [(cluster, state)]} from each running controller's own view (`squeue --local`): where
        each job really is. A federated job has a copy on every viable sibling until one starts it; then
        the others (the origin's included) are REVOKED."""
        seen: dict[str, list[tuple[str, str]]] = {}
        for name, cluster in self.clusters.items():
            proc = cluster.run("squeue", "--local", "-h", "-t", "all", "-o", "%i|%T", check=False, timeout=10)
            for line in proc.stdout.split() if proc.returncode == 0 else ():
                jid, state = line.split("|")
                seen.setdefault(jid, []).append((name, state))
        return seen

    def active(self) -> dict[str, list[str]]:
        """{job id: clusters where a copy is pending, running, configuring or completing}."""
        live = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")
        out: dict[str, list[str]] = {}
        for jid, where in self.placements().items():
            clusters = [c for c, state in where if state in live]
            if clusters:
                out[jid] = clusters
        return out

    def cancel(self, job_ids: Sequence[str], timeout: float = 60.0) -> None:
        """Cancel jobs and wait until no copy of them is active on any cluster.

        22.05 can leave a sibling's copy running when the origin cancels a federated job just as that
        sibling starts it (seen here); such copies are cancelled on their own cluster, newest job first.
        """
        want = set(job_ids)
        for jid in sorted(want, key=int, reverse=True):
            self.clusters[self._origin(jid)].run("scancel", jid, check=False)

        def gone() -> bool:
            left = {j: w for j, w in self.active().items() if j in want}
            for jid, where in left.items():
                for name in where:
                    self.clusters[name].run("scancel", "--sibling", name, jid, check=False)
                    self.clusters[name].run("scancel", "-M", name, jid, check=False)
            return not left

        try:
            wait_until(gone, timeout, "cancelled jobs to leave every cluster", interval=0.5)
        except WaitTimeout as e:
            left = {j: w for j, w in self.placements().items() if j in want}
            raise SlurmError(f"{e}: {left}") from e

    def _origin(self, job_id: str) -> str:
        """The origin cluster of a job: federated job ids carry the origin's cluster id in bits 26-31."""
        cid = int(job_id.split("_", 1)[0]) >> 26
        ids = self._cluster_ids()
        return ids.get(cid, self.names[0])

    def _cluster_ids(self) -> dict[int, str]:
        """{federation cluster id: name} from any controller that answers `scontrol show federation`."""
        for cluster in self.clusters.values():
            out = cluster.run("scontrol", "show", "federation", check=False, timeout=10).stdout
            ids = {int(i): n for n, i in re.findall(r"^(?:Self|Sibling):\s+(\w+):\S*\s+ID:(\d+)", out, re.M)}
            if ids:
                return ids
        return {}

    # ---- description -----------------------------------------------------------------------

    def fleet_config(self) -> FleetConfig:
        """The fleet file that describes this federation (clusters with their GPU type and size)."""
        return FleetConfig(
            federation=self.name,
            clusters=MappingProxyType(
                {n: Cluster(gpu_type=self.gpu_types.get(n, ""), gpus_per_node=self.gpus_per_node) for n in self.names}
            ),
        )

    def write_fleet_file(
        self, path: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str], readers: Sequence[str] = ("a", "b")
    ) -> Path:
        """The fleet file of this federation with one checkpoint store, `shared` at `checkpoint_dir`, that the
        clusters `readers` read (the lab's clusters share a disk; the others are declared unable to)."""
        doc = {
            "federation": self.name,
            "clusters": {
                n: {
                    "gpu_type": self.gpu_types.get(n, ""),
                    "gpus_per_node": self.gpus_per_node,
                    "checkpoint_stores": ["shared"] if n in readers else [],
                }
                for n in self.names
            },
            "checkpoint_stores": {"shared": {"path": str(checkpoint_dir)}},
        }
        out = Path(path)
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
        return out

    @staticmethod
    def _wait(
        what: str,
        check: Callable[[], object],
        timeout: float,
        interval: float,
        ignore: tuple[type[BaseException], ...] = (),
    ) -> None:
        try:
            wait_until(check, timeout, what, interval=interval, ignore=ignore)
        except WaitTimeout as e:
            raise SlurmError(str(e)) from e
