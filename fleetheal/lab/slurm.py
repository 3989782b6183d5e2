"""A real, private Slurm cluster on one machine: the harness tests, the lab and benchmarks share.

`SlurmCluster` starts Debian's Slurm 22.05 daemons — one `munged`, one `slurmctld` and N `slurmd`
(`slurmd -N <name>`, each on its own port, all `NodeHostname=localhost NodeAddr=127.0.0.1`) — with
every file under one state directory: `slurm.conf`, `gres.conf`, the munge key and socket, spools,
logs, pid files and the fake GPU device files. Nothing under `/etc` is read or written: clients
find the cluster through `SLURM_CONF`, which `env` (and every helper here) sets.

Each node has `gpus_per_node` fake GPUs declared as GRES: character devices with `/dev/null`'s
numbers and `AutoDetect=off`, so `--gres=gpu:N` schedules and sets `CUDA_VISIBLE_DEVICES`.
slurm.conf is the deployed stack's configuration with the lab's differences
(`fleetheal.lab.slurmconf.LAB_DIFFERENCES`). Its timers are the deployed ones with `fast_timers=False` (the
lab, the demo, the benchmarks) and the short ones of tests of one mechanism otherwise
(`slurmconf.FAST_TIMERS`: `cred_expire=5`, `sched_interval=2`, `SlurmdTimeout=10`, ...); `extra_conf`
appends lines such as `HealthCheckProgram=...` (a later key overrides an earlier one in slurm.conf).

All daemons run in one PID namespace (`unshare --pid --fork --mount-proc --kill-child`), whose
holder process is detached from the caller: killing that one PID takes every daemon down, and a
cluster can outlive the Python process that started it (`fleetheal lab up`). `SlurmCluster.attach`
finds a running cluster again by its state directory. Needs root (the daemons and `unshare` do).

slurm.conf and gres.conf are rendered by `fleetheal.lab.slurmconf`. This module stays over 500 lines because
`SlurmCluster` is one supervisor: its lifecycle (start, attach, stop, killing, freezing and restarting single
daemons) and the client helpers the tests call (`scontrol`, `sbatch`, `wait_nodes`) share one state directory
and PID namespace; split apart, they would only hand that state to each other.

Example::

    with SlurmCluster(tmp_path / "slurm", nodes=2, gpus_per_node=8) as cluster:
        job = cluster.sbatch("#!/bin/sh\\nsleep 60\\n", "--gres=gpu:8")
        cluster.scontrol("update", "nodename=n1", "state=drain", "reason=fleetheal:test")
        assert cluster.node("n1").drained
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil

from fleetheal import procs
from fleetheal.lab.slurmconf import gres_conf, slurm_conf
from fleetheal.lab.supervisor import Supervisor, spawn
from fleetheal.procs import free_ports
from fleetheal.slurm.fields import parse_kv_line
from fleetheal.slurm.nodes import Node, read, sinfo_argv
from fleetheal.wait import WaitTimeout, wait_until

__all__ = ["IDLE", "Node", "Release", "SlurmCluster", "SlurmError", "find_tool", "parse_kv_line"]

#: A base state Slurm reports (`fleetheal.slurm.nodes.BASE_STATES`).
IDLE = "IDLE"

_META_FILE = "cluster.json"
#: The command line of a node's slurmd (`SlurmCluster.slurmd_argv` + `-D -N NODE`).
_SLURMD = re.compile(r"(^|/)slurmd -d \S+ -D -N ")


class SlurmError(RuntimeError):
    """A Slurm command failed, or the cluster did not reach the expected state in time."""


def find_tool(name: str, bin_dir: str | os.PathLike[str] | None = None) -> str:
    """A Slurm or munge program: in `bin_dir`, else the first on PATH (a relocated Slurm tree's `bin`, put
    first on PATH by the Makefile, wins over Debian's), else in the system directories."""
    if bin_dir is not None:
        return str(Path(bin_dir) / name)
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        raise SlurmError(f"{name} not found: run `make setup` (Debian's Slurm) or scripts/slurm-tree.sh (Slurm 26.05)")
    return found


@dataclass(frozen=True)
class Release:
    """A Slurm release on this machine: Debian's own (installed under /usr), or a relocated tree that
    scripts/slurm-tree.sh unpacked from a newer Debian under `root` (its programs load their libraries and
    plugins from `root`, so several releases live side by side)."""

    version: tuple[int, int, int]
    #: `/` for Debian's Slurm; the tree's root file system for a relocated one.
    root: Path

    @classmethod
    def of(cls, slurmctld: str) -> Release:
        """The release of a `slurmctld` program (`slurmctld -V` prints `slurm-wlm 26.05.5`)."""
        out = subprocess.run([slurmctld, "-V"], capture_output=True, text=True, timeout=30, check=False).stdout
        found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
        if not found:
            raise SlurmError(f"{slurmctld} -V printed no version: {out.strip()!r}")
        real = Path(os.path.realpath(slurmctld))  # <root>/usr/sbin/slurmctld-wlm
        root = real.parents[2] if real.parent.name == "sbin" and real.parent.parent.name == "usr" else Path("/")
        major, minor, patch = (int(g) for g in found.groups())
        return cls((major, minor, patch), root)

    @property
    def name(self) -> str:
        """As Slurm prints it: `26.05.5`."""
        major, minor, patch = self.version
        return f"{major}.{minor:02d}.{patch}"

    @property
    def plugin_dir(self) -> Path:
        return self.root / "usr" / "lib" / "x86_64-linux-gnu" / "slurm-wlm"

    def conf_lines(self) -> list[str]:
        """slurm.conf lines this release needs: a relocated tree's plugins are not where its programs were
        built to look."""
        return [f"PluginDir={self.plugin_dir}"] if self.root != Path("/") else []

    def cgroup_conf(self) -> str:
        """cgroup.conf: from 24.11 slurmd loads a cgroup plugin even with proctrack/linuxproc and fails in a
        container without a delegated cgroup file system unless told not to (measured on 26.05.5)."""
        return "CgroupPlugin=disabled\n" if self.version >= (24, 11, 0) else ""


def recorded_holder(state_dir: Path, meta_file: str = _META_FILE) -> int | None:
    """The holder PID recorded in state_dir's `meta_file`, if that process is alive and still our `unshare`
    (a cluster's, or a federation's base)."""
    try:
        pid = int(json.loads((state_dir / meta_file).read_text())["holder_pid"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
    cmd = procs.cmdline(pid)
    return pid if procs.alive(pid) and "unshare" in cmd and str(state_dir) in cmd else None


def namespace_init(holder_pid: int | None) -> int | None:
    """PID 1 of the PID namespace that the `unshare` holder `holder_pid` made, as this namespace sees it."""
    if holder_pid is None:
        return None
    try:
        kids = psutil.Process(holder_pid).children()
    except psutil.Error:
        return None
    return min(k.pid for k in kids) if kids else None


def stop_holder(holder: subprocess.Popen[bytes] | None, holder_pid: int, init: int | None, timeout: float) -> list[int]:
    """SIGKILL the `unshare --kill-child` holder (its namespace dies with it), reap it if it is our child, and
    wait up to `timeout` for it and the namespace's init to be gone; the PIDs still there."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(holder_pid, signal.SIGKILL)
    if holder is not None:
        holder.wait()
    return procs.wait_gone([holder_pid] if init is None else [holder_pid, init], timeout)


class SlurmCluster(Supervisor):
    """A private Slurm cluster (slurmctld + N slurmd + munged) on this machine.

    Args:
        state_dir: every file of the cluster lives here (created if missing). Reusing the directory
            of a stopped cluster keeps slurmctld's saved state (jobs, drained nodes).
        nodes: number of slurmd; names are `{node_prefix}1..{node_prefix}N`.
        gpus_per_node: fake GPUs per node (GRES `gpu`); 0 for none.
        cpus_per_node: CPUs each node declares (`SlurmdParameters=config_overrides` lets this exceed
            the real machine).
        extra_conf: lines appended to slurm.conf (e.g. `HealthCheckProgram=...`); a later key overrides
            an earlier one, so accounting and priority lines given here replace the defaults.
        gpu_type: GRES type of the GPUs (`gpu:<type>:<n>`, e.g. `h100`), None for untyped `gpu:<n>`.
        munge_key: the munge key to use (several clusters of one federation must share one); None
            keeps the state dir's key, or makes a random one.
        partition: the one partition, default, holding every node.
        slurm_bin: directory of the Slurm daemons and clients (None: found on PATH / /usr/sbin).
        slurm_user: the account slurmctld runs as (SlurmUser): root, or an existing user such as `slurm`,
            as Slinky's images run it (then only root and that user may drain nodes); it gets slurmctld's
            state, log and pid directories.
        fast_timers: the short timers of tests (`slurmconf.FAST_TIMERS`), so a test of one requeue or one
            lost node takes seconds; False: the deployed stack's timers, as the lab and benchmarks run.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        nodes: int = 2,
        gpus_per_node: int = 8,
        *,
        cpus_per_node: int = 8,
        node_prefix: str = "n",
        extra_conf: Sequence[str] = (),
        cluster_name: str = "fleetheal",
        partition: str = "gpu",
        slurm_bin: str | os.PathLike[str] | None = None,
        gpu_type: str | None = None,
        munge_key: bytes | None = None,
        slurm_user: str = "root",
        fast_timers: bool = True,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
        self.state_dir = Path(state_dir).resolve()
        self.node_names = [f"{node_prefix}{i}" for i in range(1, nodes + 1)]
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.extra_conf = list(extra_conf)
        self.cluster_name = cluster_name
        self.partition = partition
        self._bin = Path(slurm_bin) if slurm_bin else None
        if gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", gpu_type):
            raise ValueError(f"gpu_type must be letters, digits, '-' or '_', got {gpu_type!r}")
        self.gpu_type = gpu_type
        self.munge_key = munge_key
        self.slurm_user = slurm_user
        self.fast_timers = fast_timers
        self._holder: subprocess.Popen[bytes] | None = None
        self.holder_pid: int | None = None

    # ---- paths and environment -------------------------------------------------------------

    @property
    def conf_path(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm client needs to talk to this cluster (os.environ + SLURM_CONF)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    def gpu_devices(self, node: str) -> list[Path]:
        """The fake GPU device files of one node, in index order."""
        return [self.state_dir / "dev" / node / f"nvidia{i}" for i in range(self.gpus_per_node)]

    def _tool(self, name: str) -> str:
        return find_tool(name, self._bin)

    def slurmd_argv(self) -> list[str]:
        """slurmd and the slurmstepd of its own release (slurmd runs the one it was built for otherwise)."""
        return [self._tool("slurmd"), "-d", self._tool("slurmstepd")]

    @functools.cached_property
    def release(self) -> Release:
        """The Slurm this cluster runs (`Release.of` its slurmctld)."""
        return Release.of(self._tool("slurmctld"))

    # ---- lifecycle -------------------------------------------------------------------------

    def _write_files(self) -> None:
        d = self.state_dir
        for sub in ("etc", "log", "run", "ctld", "spool", "munge", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses group/other-writable dirs; clients need to traverse to the socket.
        os.chmod(d, 0o755)  # noqa: S103 - clients must traverse to the munge socket
        os.chmod(d / "munge", 0o755)  # noqa: S103 - same
        key = d / "munge" / "munge.key"
        if self.munge_key is not None:
            if key.exists():
                os.chmod(key, 0o600)
            key.write_bytes(self.munge_key)
        elif not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

        for node in self.node_names:
            (d / "spool" / node).mkdir(exist_ok=True)
            (d / "dev" / node).mkdir(exist_ok=True)
            null = os.stat("/dev/null").st_rdev
            for dev in self.gpu_devices(node):
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, null)  # S_IFCHR with /dev/null's major/minor

        ports = free_ports(len(self.node_names) + 1)
        ctld_port, node_ports = ports[0], ports[1:]
        self.conf_path.write_text(
            slurm_conf(
                cluster_name=self.cluster_name,
                slurm_user=self.slurm_user,
                state_dir=d,
                ctld_port=ctld_port,
                munge_socket=d / "munge" / "munge.socket",
                node_ports=dict(zip(self.node_names, node_ports, strict=True)),
                cpus_per_node=self.cpus_per_node,
                gpus_per_node=self.gpus_per_node,
                gpu_type=self.gpu_type,
                partition=self.partition,
                plugin_dir=self.release.plugin_dir,
                extra=self.extra_conf,
                fast_timers=self.fast_timers,
            )
        )
        (d / "etc" / "gres.conf").write_text(gres_conf(d, self.node_names, self.gpus_per_node, self.gpu_type))
        (d / "etc" / "cgroup.conf").write_text(self.release.cgroup_conf())
        if self.slurm_user != "root":
            # slurmctld drops to SlurmUser at start; it keeps writing its state, log and pid file.
            user = pwd.getpwnam(self.slurm_user)
            (d / "log" / "slurmctld.log").touch()
            for path in (d / "ctld", d / "run", d / "log", d / "log" / "slurmctld.log"):
                os.chown(path, user.pw_uid, user.pw_gid)

    def _init_script(self) -> str:
        d = self.state_dir
        q = shlex.quote
        sock = d / "munge" / "munge.socket"
        munged = (
            f"{q(self._tool('munged'))} -F -f --socket={q(str(sock))} --key-file={q(str(d / 'munge' / 'munge.key'))}"
            f" --log-file={q(str(d / 'log' / 'munged.log'))} --pid-file={q(str(d / 'run' / 'munged.pid'))}"
            f" --seed-file={q(str(d / 'munge' / 'munged.seed'))}"
        )
        slurmd = shlex.join(self.slurmd_argv())
        slurmds = "\n".join(
            f'{slurmd} -D -N {q(n)} >>{q(str(d / "log" / f"slurmd-{n}.out"))} 2>&1 &\npids="$pids $!"'
            for n in self.node_names
        )
        # PID 1 of the namespace: starts the daemons in order, forwards SIGTERM to them (a graceful
        # stop lets slurmctld save its state), and reaps whatever re-parents to it.
        return f"""\
export SLURM_CONF={q(str(self.conf_path))}
pids=""
trap 'kill -TERM $pids 2>/dev/null; wait $pids; kill -TERM $munged_pid; wait; exit 0' TERM INT
{munged} >>{q(str(d / "log" / "munged.out"))} 2>&1 &
munged_pid=$!
i=0; while [ ! -S {q(str(sock))} ]; do sleep 0.02; i=$((i+1)); [ $i -gt 500 ] && exit 3; done
{q(self._tool("slurmctld"))} -D -i >>{q(str(d / "log" / "slurmctld.out"))} 2>&1 &
pids="$pids $!"
{slurmds}
while :; do wait; sleep 1; done
"""

    def start(self, timeout: float = 30.0) -> Self:
        """Write the config, start the daemons in their own PID namespace, wait for every node idle."""
        other = recorded_holder(self.state_dir)
        if self.running() or other is not None:
            pid = self.holder_pid if self.running() else other
            raise SlurmError(f"a cluster is already running in {self.state_dir} (holder pid {pid}); stop it first")
        self._write_files()
        script = self.state_dir / "run" / "init.sh"
        script.write_text(self._init_script())
        self._holder = spawn(
            [self._tool("unshare"), "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", str(script)],
            self.log_dir / "init.out",
            env=self.env,
        )
        self.holder_pid = self._holder.pid
        (self.state_dir / _META_FILE).write_text(
            json.dumps({"holder_pid": self.holder_pid, "nodes": self.node_names, "gpus_per_node": self.gpus_per_node})
        )
        try:
            self.wait_registered(timeout=timeout)
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    @classmethod
    def attach(cls, state_dir: str | os.PathLike[str]) -> SlurmCluster:
        """The cluster started earlier (maybe by another process) in `state_dir`."""
        state = Path(state_dir).resolve()
        if recorded_holder(state) is None:
            raise SlurmError(f"no running cluster in {state}")
        meta = json.loads((state / _META_FILE).read_text())
        names: list[str] = meta["nodes"]
        prefix = names[0].rstrip("0123456789")
        cluster = cls(state, nodes=len(names), gpus_per_node=meta["gpus_per_node"], node_prefix=prefix)
        cluster.holder_pid = int(meta["holder_pid"])
        return cluster

    def running(self) -> bool:
        """True while the namespace holder process is alive."""
        return self.holder_pid is not None and procs.alive(self.holder_pid)

    def _ns_init_pid(self) -> int | None:
        """PID 1 of the cluster's namespace, as this namespace sees it."""
        return namespace_init(self.holder_pid)

    def processes(self) -> dict[int, str]:
        """Every process in the cluster's PID namespace: {pid (as we see it): command line}."""
        init = self._ns_init_pid()
        return {} if init is None else procs.namespace_processes(init)

    def stop(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop every daemon; nothing of the cluster survives this call.

        graceful: SIGTERM first (slurmctld saves its state), SIGKILL after `timeout`. Either way the
        holder is killed last, and the kernel kills whatever is left in the namespace with it.
        """
        if self.holder_pid is None:
            return
        init = self._ns_init_pid()
        if graceful and init is not None:
            # A slurmctld restarted by `start_slurmctld` is not the init script's child: stop it first so
            # that it, too, saves its state.
            restarted = [p for p, cmd in self.processes().items() if p != init and self._is_ctld(cmd)]
            for pid in restarted:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            procs.wait_gone(restarted, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGTERM)
            procs.wait_gone([init], timeout)
        stop_holder(self._holder, self.holder_pid, init, timeout)
        if init is not None and procs.alive(init):
            raise SlurmError(f"cluster in {self.state_dir} did not stop (namespace init pid {init})")
        self._holder = None
        self.holder_pid = None
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / _META_FILE).unlink()

    # ---- one node's slurmd -----------------------------------------------------------------

    def kill_slurmd(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Kill one node's slurmd (its jobs keep running, as on a real node): the node goes
        NOT_RESPONDING, then DOWN after SlurmdTimeout."""
        pids = [p for p, cmd in self.processes().items() if _SLURMD.search(cmd) and cmd.endswith(f" -N {node}")]
        if not pids:
            raise SlurmError(f"no slurmd running for node {node}")
        for pid in pids:
            os.kill(pid, sig)
        # A signal is delivered asynchronously: return once the daemon is gone, so callers see it gone.
        procs.wait_gone(pids, 5.0)

    def _node_processes(self, node: str) -> list[int]:
        """The node's slurmd and every process of the jobs that run on it (their slurmstepd and tasks)."""
        jobs = {j for j in self.run("squeue", "-h", "-w", node, "-o", "%i", check=False).stdout.split() if j}
        found = []
        for pid, cmd in self.processes().items():
            if _SLURMD.search(cmd) and cmd.endswith(f" -N {node}"):
                found.append(pid)
                continue
            step = re.match(r"slurmstepd: \[(\d+)\.", cmd)
            if step and step.group(1) in jobs:
                found.append(pid)
                continue
            with contextlib.suppress(psutil.Error):
                env = psutil.Process(pid).environ()
                if env.get("SLURM_JOB_ID") in jobs and env.get("SLURMD_NODENAME") == node:
                    found.append(pid)
        return found

    def freeze_nodes(self, nodes: Sequence[str]) -> list[int]:
        """Cut `nodes` off, as a lost leaf switch does: their slurmd and their jobs' processes stop (SIGSTOP),
        so Slurm hears nothing from them (NOT_RESPONDING, then DOWN after SlurmdTimeout) and their jobs hang
        as a job hangs in a collective whose peers are gone. Returns the frozen PIDs (for `thaw_nodes`)."""
        pids = sorted({p for n in nodes for p in self._node_processes(n)})
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw_nodes(self, pids: Sequence[int]) -> None:
        """Undo `freeze_nodes`: the frozen job processes are killed (their job was restarted elsewhere: a
        thawed copy would write beside it), the slurmd continue."""
        procs_now = self.processes()
        for pid in pids:
            cmd = procs_now.get(pid, "")
            with contextlib.suppress(ProcessLookupError):
                if _SLURMD.search(cmd):
                    os.kill(pid, signal.SIGCONT)
                else:
                    os.kill(pid, signal.SIGKILL)

    def start_slurmd(self, node: str) -> None:
        """Start one node's slurmd again inside the cluster's namespace."""
        if node not in self.node_names:
            raise SlurmError(f"unknown node {node}; nodes are {', '.join(self.node_names)}")
        init = self._ns_init_pid()
        if init is None:
            raise SlurmError("cluster is not running")
        spawn(
            ["nsenter", f"--target={init}", "--pid", "--mount", "--", *self.slurmd_argv(), "-D", "-N", node],
            self.log_dir / f"slurmd-{node}.out",
            env=self.env,
        )

    # ---- the controller --------------------------------------------------------------------

    @staticmethod
    def _is_ctld(cmd: str) -> bool:
        return bool(re.search(r"(^|/)slurmctld -D", cmd))

    def stop_slurmctld(self, timeout: float = 15.0) -> None:
        """Stop the cluster's slurmctld gracefully (SIGTERM: it saves its jobs and nodes to
        StateSaveLocation); the slurmd and their running jobs stay, as when a real controller goes away."""
        pids = [p for p, cmd in self.processes().items() if self._is_ctld(cmd)]
        if not pids:
            raise SlurmError(f"no slurmctld running in {self.state_dir}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if procs.wait_gone(pids, timeout):
            raise SlurmError(f"slurmctld in {self.state_dir} did not stop within {timeout}s")

    def start_slurmctld(self, timeout: float = 30.0) -> None:
        """Start slurmctld again inside the cluster's namespace, recovering its saved state; returns once
        it answers `scontrol ping`."""
        init = self._ns_init_pid()
        if init is None:
            raise SlurmError("cluster is not running")
        if any(self._is_ctld(cmd) for cmd in self.processes().values()):
            raise SlurmError(f"slurmctld is already running in {self.state_dir}")
        spawn(
            ["nsenter", f"--target={init}", "--pid", "--mount", "--", self._tool("slurmctld"), "-D", "-i"],
            self.log_dir / "slurmctld.out",
            env=self.env,
        )
        self.wait_for(
            "slurmctld to answer scontrol ping",
            lambda: "is UP" in self.run("scontrol", "ping", check=False, timeout=10).stdout,
            timeout,
            interval=0.1,
        )

    # ---- clients ---------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (`scontrol`, `squeue`, `sbatch`...) against this cluster."""
        cmd = [self._tool(argv[0]), *argv[1:]]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise SlurmError(
                f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def scontrol(self, *args: str, check: bool = True) -> str:
        return self.run("scontrol", *args, check=check).stdout

    def squeue(self, *args: str) -> str:
        return self.run("squeue", *args).stdout

    def job_state(self, job: str) -> str:
        """The job's state ("" once Slurm has forgotten it)."""
        return self.run("squeue", "-j", job, "-h", "-o", "%T", check=False).stdout.strip()

    def sbatch(self, script: str, *args: str) -> str:
        """Submit a batch script (its text); returns the job id."""
        jobs_dir = self.state_dir / "jobs"
        jobs_dir.mkdir(exist_ok=True)
        path = jobs_dir / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        out = self.run("sbatch", "--parsable", f"--chdir={jobs_dir}", *args, str(path)).stdout.strip()
        return out.split(";", 1)[0]

    def nodes(self) -> dict[str, Node]:
        """Every node's state and reason (`fleetheal.slurm.nodes`)."""
        return read(self.run(*sinfo_argv()).stdout)

    def node(self, name: str) -> Node:
        node = read(self.run(*sinfo_argv("sinfo", name)).stdout).get(name)
        if node is None:
            raise SlurmError(f"sinfo: no node {name}")
        return node

    def job(self, job_id: str) -> dict[str, str]:
        """One job's fields from `scontrol show job -o` (JobState, NodeList, Reason, Restarts...)."""
        return parse_kv_line(self.scontrol("show", "job", "-o", job_id).strip().splitlines()[0])

    def wait_registered(self, timeout: float = 30.0) -> None:
        """Wait until every slurmd has registered with slurmctld (state no longer UNKNOWN, responding).

        A node drained in an earlier run of the same state dir stays drained: that is Slurm's saved state.
        """
        seen: dict[str, Node] = {}

        def registered() -> bool:
            nonlocal seen
            self._check_running()
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                seen = self.nodes()
            return all(n in seen and seen[n].state != "UNKNOWN" and seen[n].responding for n in self.node_names)

        try:
            wait_until(registered, timeout, "slurmd to register", interval=0.05)
        except WaitTimeout as e:
            states = {n: f"{i.state}+{'+'.join(sorted(i.flags))}" for n, i in seen.items()}
            raise SlurmError(f"slurmd not registered after {timeout}s: {states}; logs in {self.log_dir}") from e

    def _check_running(self) -> None:
        """SlurmError (which no wait ignores) once the cluster's daemons are gone."""
        if self.holder_pid is not None and not self.running():
            raise SlurmError(f"cluster daemons exited; see {self.log_dir}")

    def wait_nodes(self, state: str = IDLE, nodes: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        """Wait until every node (or `nodes`) has base state `state` and no flags but DRAIN-less
        steady ones; raises SlurmError with the last states seen."""
        want = list(nodes or self.node_names)
        seen: dict[str, Node] = {}
        last_err = ""

        def reached() -> bool:
            nonlocal seen, last_err
            self._check_running()
            try:
                seen = self.nodes()
            except (SlurmError, subprocess.TimeoutExpired) as exc:
                last_err = str(exc)
                return False
            return all(n in seen and seen[n].state == state and not (seen[n].flags - {"DYNAMIC_NORM"}) for n in want)

        try:
            wait_until(reached, timeout, f"nodes {state}", interval=0.05)
        except WaitTimeout as e:
            states = {n: f"{i.state}+{'+'.join(sorted(i.flags))}" for n, i in seen.items()}
            raise SlurmError(f"nodes not {state} after {timeout}s: {states or last_err}; logs in {self.log_dir}") from e

    @staticmethod
    def wait_for(what: str, check: Callable[[], object], timeout: float = 30.0, interval: float = 0.05) -> None:
        """Poll `check()` until it returns something true; `what` names the condition in the error."""
        try:
            wait_until(check, timeout, what, interval=interval)
        except WaitTimeout as e:
            raise SlurmError(str(e)) from e
