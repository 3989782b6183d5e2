"""Real Prometheus and Alertmanager (Debian packages) on 127.0.0.1, for tests and the lab.

    from fleetheal.lab.monitoring import Monitoring

    with Monitoring(
        base_dir,                                   # configs, data, logs and pid files go here
        scrape_targets=["127.0.0.1:9400"],          # the agent (or a test exporter)
        rules_files=["policies/alert-rules.yml"],
        webhook_url="http://127.0.0.1:9105/webhook",
        webhook_token="...",                        # written to a 0600 file: credentials_file
        cluster="lab",                              # external label -> the alerts' `cluster` label
    ) as mon:
        mon.wait_for_alert("FleethealXid79")

Both daemons are started by hand (Debian's packages do not start them here), each with its own data
directory; Alertmanager runs with `--cluster.listen-address=` (no gossip port). Ports default to free
ones; intervals default to test speed (scrape and evaluation every 1 s, Alertmanager group_wait 0 s,
group_interval 1 s) -- give production-like ones for a demo. Each alert is its own group
(`group_by: ['...']`), so one bad alert never delays another. `stop()` ends both by PID (SIGTERM, then
SIGKILL), also after a failed start; the pid files in `base_dir` let another process stop them
(`stop_recorded(base_dir)`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import yaml

from fleetheal.lab.supervisor import Supervisor, spawn
from fleetheal.procs import stop_pid
from fleetheal.wait import WaitTimeout, wait_until

PROMETHEUS_BIN = "prometheus"
ALERTMANAGER_BIN = "prometheus-alertmanager"  # Debian's name for alertmanager


class MonitoringError(RuntimeError):
    """A daemon did not start or answer; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_binary(name: str) -> str | None:
    """The daemon's path (Debian installs alertmanager as prometheus-alertmanager)."""
    found = shutil.which(name)
    if found is None and name == ALERTMANAGER_BIN:
        found = shutil.which("alertmanager")
    return found


def available() -> bool:
    return find_binary(PROMETHEUS_BIN) is not None and find_binary(ALERTMANAGER_BIN) is not None


@dataclass
class Daemon:
    name: str
    pid: int
    url: str
    log: Path
    process: subprocess.Popen[bytes] | None = None


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an HTTP URL: {url}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - scheme checked above
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def stop_recorded(base_dir: str | os.PathLike[str]) -> None:
    """Stop daemons a Monitoring with this base_dir started (from their pid files)."""
    for pidfile in sorted(Path(base_dir).glob("*.pid")):
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            continue
        stop_pid(pid)
        pidfile.unlink(missing_ok=True)


class Monitoring(Supervisor):
    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        scrape_targets: Sequence[str] = (),
        rules_files: Sequence[str | os.PathLike[str]] = (),
        webhook_url: str | None = None,
        webhook_token: str | None = None,
        cluster: str = "lab",
        host: str = "127.0.0.1",
        prometheus_port: int = 0,
        alertmanager_port: int = 0,
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        group_wait: str = "0s",
        group_interval: str = "1s",
        repeat_interval: str = "1h",
        job_name: str = "fleetheal-agent",
        prometheus_bin: str | None = None,
        alertmanager_bin: str | None = None,
    ) -> None:
        self.base = Path(base_dir).resolve()
        self.scrape_targets = list(scrape_targets)
        self.rules_files = [str(Path(f).resolve()) for f in rules_files]
        self.webhook_url = webhook_url
        self.webhook_token = webhook_token
        self.cluster = cluster
        self.host = host
        self.prometheus_port = prometheus_port or free_port(host)
        self.alertmanager_port = alertmanager_port or free_port(host)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.group_wait = group_wait
        self.group_interval = group_interval
        self.repeat_interval = repeat_interval
        self.job_name = job_name
        self.prometheus_bin = prometheus_bin or find_binary(PROMETHEUS_BIN)
        self.alertmanager_bin = alertmanager_bin or find_binary(ALERTMANAGER_BIN)
        self.prometheus: Daemon | None = None
        self.alertmanager: Daemon | None = None

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://{self.host}:{self.alertmanager_port}"

    # --- configuration -----------------------------------------------------------------------------

    def prometheus_config(self) -> dict[str, Any]:
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "evaluation_interval": self.evaluation_interval,
                "external_labels": {"cluster": self.cluster},
            },
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [f"{self.host}:{self.alertmanager_port}"]}]}]
            },
            "rule_files": self.rules_files,
            "scrape_configs": [
                {"job_name": self.job_name, "static_configs": [{"targets": self.scrape_targets}]},
            ],
        }

    def alertmanager_config(self) -> dict[str, Any]:
        receiver: dict[str, Any] = {"name": "fleetheal-remediator"}
        if self.webhook_url:
            hook: dict[str, Any] = {"url": self.webhook_url, "send_resolved": True, "max_alerts": 0}
            if self.webhook_token is not None:
                hook["http_config"] = {
                    "authorization": {"type": "Bearer", "credentials_file": str(self.base / "webhook-token")}
                }
            receiver["webhook_configs"] = [hook]
        return {
            "route": {
                "receiver": "fleetheal-remediator",
                "group_by": ["..."],  # every alert its own group: no alert waits on another
                "group_wait": self.group_wait,
                "group_interval": self.group_interval,
                "repeat_interval": self.repeat_interval,
            },
            "receivers": [receiver],
        }

    def write_configs(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "prometheus.yml").write_text(yaml.safe_dump(self.prometheus_config(), sort_keys=False))
        (self.base / "alertmanager.yml").write_text(yaml.safe_dump(self.alertmanager_config(), sort_keys=False))
        if self.webhook_token is not None:
            token_file = self.base / "webhook-token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.webhook_token)

    # --- lifecycle ---------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], url: str) -> Daemon:
        log = self.base / f"{name}.log"
        proc = spawn(argv, log)
        (self.base / f"{name}.pid").write_text(str(proc.pid))
        return Daemon(name, proc.pid, url, log, proc)

    def _wait_ready(self, daemon: Daemon, timeout: float) -> None:
        def ready() -> bool:
            if daemon.process is not None and daemon.process.poll() is not None:
                raise MonitoringError(f"{daemon.name} exited")
            return _get(daemon.url + "/-/ready", timeout=1.0)[0] == 200

        try:
            wait_until(ready, timeout, f"{daemon.name} at {daemon.url}", interval=0.05, ignore=(OSError,))
        except (WaitTimeout, MonitoringError) as e:
            tail = daemon.log.read_text(errors="replace")[-2000:] if daemon.log.exists() else ""
            raise MonitoringError(
                f"{daemon.name} did not become ready at {daemon.url} within {timeout:g} s:\n{tail}"
            ) from e

    def start(self, timeout: float = 20.0) -> Self:
        if not self.prometheus_bin or not self.alertmanager_bin:
            raise MonitoringError("prometheus and prometheus-alertmanager are not installed (apt-get install them)")
        self.write_configs()
        try:
            (self.base / "alertmanager-data").mkdir(exist_ok=True)
            self.alertmanager = self._spawn(
                "alertmanager",
                [
                    self.alertmanager_bin,
                    f"--config.file={self.base / 'alertmanager.yml'}",
                    f"--storage.path={self.base / 'alertmanager-data'}",
                    f"--web.listen-address={self.host}:{self.alertmanager_port}",
                    "--cluster.listen-address=",
                    "--log.level=info",
                ],
                self.alertmanager_url,
            )
            (self.base / "prometheus-data").mkdir(exist_ok=True)
            self.prometheus = self._spawn(
                "prometheus",
                [
                    self.prometheus_bin,
                    f"--config.file={self.base / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.base / 'prometheus-data'}",
                    f"--web.listen-address={self.host}:{self.prometheus_port}",
                    "--web.enable-lifecycle",
                    "--log.level=info",
                ],
                self.prometheus_url,
            )
            self._wait_ready(self.alertmanager, timeout)
            self._wait_ready(self.prometheus, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for daemon in (self.prometheus, self.alertmanager):
            if daemon is None:
                continue
            stop_pid(daemon.pid)
            if daemon.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.process.wait(timeout=1)
            (self.base / f"{daemon.name}.pid").unlink(missing_ok=True)
        self.prometheus = self.alertmanager = None

    # --- queries -----------------------------------------------------------------------------------

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query's result vector."""
        code, body = _get(f"{self.prometheus_url}/api/v1/query?query={urllib.parse.quote(expr)}")
        if code != 200:
            raise MonitoringError(f"query {expr!r}: HTTP {code}: {body[:200]!r}")
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result

    def prometheus_alerts(self) -> list[dict[str, Any]]:
        """Alerts Prometheus holds (pending or firing)."""
        code, body = _get(self.prometheus_url + "/api/v1/alerts")
        if code != 200:
            raise MonitoringError(f"Prometheus alerts: HTTP {code}")
        alerts: list[dict[str, Any]] = json.loads(body)["data"]["alerts"]
        return alerts

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds (API v2)."""
        code, body = _get(self.alertmanager_url + "/api/v2/alerts")
        if code != 200:
            raise MonitoringError(f"Alertmanager alerts: HTTP {code}")
        alerts: list[dict[str, Any]] = json.loads(body)
        return alerts

    def wait_for_alert(self, alertname: str, timeout: float = 30.0, state: str = "firing") -> dict[str, Any]:
        """The first Prometheus alert named `alertname` in `state`; MonitoringError after `timeout`."""

        def found() -> dict[str, Any] | None:
            return next(
                (
                    a
                    for a in self.prometheus_alerts()
                    if a["labels"].get("alertname") == alertname and a.get("state") == state
                ),
                None,
            )

        try:
            return wait_until(found, timeout, f"alert {alertname} {state}")
        except WaitTimeout as e:
            raise MonitoringError(f"alert {alertname} not {state} within {timeout:g} s") from e
