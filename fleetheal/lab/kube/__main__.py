"""`python -m fleetheal.lab.kube`: run the fake API server in the foreground (the lab starts it this way)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fleetheal.lab.kube.server import FakeKubeApiServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetheal.lab.kube", description="Run the FakeKubeApiServer test double."
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--state", help="JSON state file (loaded if present, saved after each change)")
    parser.add_argument("--token", help="require this bearer token")
    parser.add_argument("--kubeconfig", help="write a kubeconfig here once serving")
    parser.add_argument("--ready-file", help="write {pid, url} here once serving")
    args = parser.parse_args(argv)
    server = FakeKubeApiServer(args.port, args.state, args.token)

    ready = Path(args.ready_file) if args.ready_file else None
    if args.kubeconfig:
        # The port is known before serving only when given; with 0 the kubeconfig follows the bind.
        orig = server._start_site

        async def start_and_write() -> None:
            await orig()
            server.write_kubeconfig(args.kubeconfig)

        server._start_site = start_and_write  # type: ignore[method-assign]
    server.serve_forever(ready)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
