"""The fast path: isolate this node before any alert has travelled.

`SlurmDrainer` drains this node with the real `scontrol` and an owned reason
(`fleetheal.contracts.drain_reason`). It never touches a node drained for a reason fleetheal does not
own (an operator's drain keeps its reason), and it never undrains: returning a node to service is the
remediator's REJOIN, after revalidation.

`KubeNodeTainter` taints (`fleetheal.io/unhealthy=<fault>:NoSchedule`) and labels
(`fleetheal.io/fault=<fault>`) this node's own Node object through the API server, with a node-scoped
credential (a bearer token that may patch this one Node and nothing more). Standard library only.

Both answer with a result word counted in `fleetheal_agent_fastpath_actions_total{action,result}`:
done, already (ours already), kept_foreign (someone else's drain/taint left alone), would (observe
mode: "would drain", never "drained"), failed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fleetheal.contracts import LABEL_FAULT, TAINT_UNHEALTHY, owns_reason
from fleetheal.scontrol import NodeInfo, parse_node_line

if TYPE_CHECKING:
    import ssl

DONE, ALREADY, KEPT_FOREIGN, WOULD, FAILED = "done", "already", "kept_foreign", "would", "failed"

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class FastPathError(RuntimeError):
    pass


class SlurmDrainer:
    """Drain one Slurm node through `scontrol`."""

    def __init__(
        self,
        node: str,
        scontrol: str = "scontrol",
        *,
        slurm_conf: str | None = None,
        timeout_s: float = 10.0,
        dry_run: bool = False,
        run: Runner = subprocess.run,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.node = node
        self.scontrol = scontrol
        self.timeout_s = timeout_s
        self.dry_run = dry_run
        self._run = run
        self.env = dict(os.environ if env is None else env)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf

    def _scontrol(self, *args: str) -> str:
        try:
            proc = self._run(
                [self.scontrol, *args],
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                env=self.env,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FastPathError(f"scontrol {' '.join(args)}: {exc}") from exc
        if proc.returncode != 0:
            raise FastPathError(
                f"scontrol {' '.join(args)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
            )
        return proc.stdout

    def node_info(self) -> NodeInfo:
        out = self._scontrol("show", "node", "-o", self.node)
        lines = [ln for ln in out.splitlines() if ln.startswith("NodeName=")]
        if not lines:
            raise FastPathError(f"scontrol show node {self.node}: no such node")
        return parse_node_line(lines[0])

    def drain(self, reason: str) -> tuple[str, str]:
        """Drain with `reason` (must be owned). Returns (result, explanation)."""
        if not owns_reason(reason):
            raise ValueError(f"refusing a drain reason fleetheal does not own: {reason!r}")
        info = self.node_info()
        if info.drained:
            if owns_reason(info.reason):
                return ALREADY, f"{self.node} already drained by fleetheal: {info.reason}"
            return KEPT_FOREIGN, f"{self.node} already drained by someone else ({info.reason!r}); their reason is kept"
        if self.dry_run:
            return WOULD, f"would drain {self.node}: {reason}"
        self._scontrol("update", f"nodename={self.node}", "state=drain", f"reason={reason}")
        return DONE, f"drained {self.node}: {reason}"


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
        import urllib.request

        with open(self.token_file) as fh:  # re-read: projected tokens rotate
            token = fh.read().strip()
        req = urllib.request.Request(  # noqa: S310 - the URL is the configured API server
            f"{self.api_url}/api/v1/nodes/{self.node}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/json",
                "Content-Type": "application/merge-patch+json",
            },
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ctx) as resp:  # noqa: S310
            doc: dict[str, Any] = json.loads(resp.read())
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
                raise FastPathError(f"kubernetes: {exc.code} {exc.reason}") from exc
            except (OSError, ValueError, KeyError) as exc:
                raise FastPathError(f"kubernetes: {exc}") from exc
        raise FastPathError("kubernetes: the Node kept changing (3 conflicts)")
