"""`FakeKubeApiServer`: the fake API server's HTTP face (discovery, the resource handlers, watch, the
bearer-token check), run on its own thread or in the foreground; and the kubeconfig it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from aiohttp import web

from fleetheal.lab.kube.model import KUBE_VERSION, RESOURCES, VERBS, ApiError, Obj, ResourceType
from fleetheal.lab.kube.patch import field_selector, json_patch, label_selector, merge_patch, strategic_merge_patch
from fleetheal.lab.kube.store import Store
from fleetheal.lab.supervisor import Supervisor

# ---- HTTP ----------------------------------------------------------------------------------------


def _resource_list(group: str, version: str) -> Obj:
    resources: list[Obj] = []
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        resources.append(
            {
                "name": r.plural,
                "singularName": r.singular,
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": VERBS,
                "shortNames": list(r.short_names),
            }
        )
        for sub in r.subresources:
            if sub == "eviction":
                resources.append(
                    {
                        "name": f"{r.plural}/eviction",
                        "singularName": "",
                        "namespaced": True,
                        "group": "policy",
                        "version": "v1",
                        "kind": "Eviction",
                        "verbs": ["create"],
                    }
                )
            else:
                resources.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def _group(name: str) -> Obj:
    gv = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


def _json(body: Obj, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _static(body: Obj) -> Callable[[web.Request], Any]:
    async def handle(_: web.Request) -> web.Response:
        return _json(body)

    return handle


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class FakeKubeApiServer(Supervisor):
    """Test double of kube-apiserver on 127.0.0.1 (see the module docstring for what it follows).

    Args:
        port: TCP port on 127.0.0.1 (0: pick a free one; `url` tells which).
        state_file: JSON file the whole state is loaded from (if present) and saved to after each change.
        token: when set, every request must carry `Authorization: Bearer <token>` (401 otherwise).
    """

    def __init__(
        self, port: int = 0, state_file: str | os.PathLike[str] | None = None, token: str | None = None
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port
        self.token = token
        self.store = Store(Path(state_file) if state_file else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- direct access for tests and the lab (same semantics as the HTTP API)

    def resource(self, plural: str) -> ResourceType:
        return next(r for r in RESOURCES if r.plural == plural)

    def add(self, plural: str, body: Obj, namespace: str = "default") -> Obj:
        return self.store.create(self.resource(plural), namespace, body)

    def get(self, plural: str, name: str, namespace: str = "default") -> Obj:
        return self.store.get(self.resource(plural), namespace, name)

    def write_kubeconfig(self, path: str | os.PathLike[str], context: str = "fleetheal-lab") -> Path:
        """A kubeconfig pointing at this server (plain HTTP on loopback, bearer token if one is set)."""
        return write_kubeconfig(path, self.url, self.token, context)

    # -- the app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=16 * 1024 * 1024)
        r = app.router
        for path in ("/version", "/version/"):
            r.add_get(path, _static(KUBE_VERSION))
        for path in ("/healthz", "/readyz", "/livez"):
            r.add_get(path, _ok)
        r.add_get("/api", self._api_versions)
        r.add_get("/apis", self._api_groups)
        r.add_get("/api/v1", _static(_resource_list("", "v1")))
        r.add_get("/apis/policy", _static({"kind": "APIGroup", "apiVersion": "v1", **_group("policy")}))
        r.add_get("/apis/policy/v1", _static(_resource_list("policy", "v1")))
        # Namespaced routes first: /api/v1/namespaces/{ns}/pods must not match Namespace's /{name}/{sub}.
        for rt in sorted(RESOURCES, key=lambda r: not r.namespaced):
            base = f"/api/{rt.version}" if not rt.group else f"/apis/{rt.group}/{rt.version}"
            h = self._handler(rt)
            if rt.namespaced:
                r.add_route("*", f"{base}/{rt.plural}", h)  # all namespaces (list, watch)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}", h)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}", h)
                r.add_route("*", f"{base}/namespaces/{{namespace}}/{rt.plural}/{{name}}/{{sub}}", h)
            else:
                r.add_route("*", f"{base}/{rt.plural}", h)
                r.add_route("*", f"{base}/{rt.plural}/{{name}}", h)
                r.add_route("*", f"{base}/{rt.plural}/{{name}}/{{sub}}", h)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _json(ApiError(401, "Unauthorized", "Unauthorized").status(), 401)
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except ApiError as exc:
            return _json(exc.status(), exc.code)
        except web.HTTPNotFound:
            return _json(ApiError(404, "NotFound", "the server could not find the requested resource").status(), 404)
        except web.HTTPMethodNotAllowed:
            return _json(
                ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                ).status(),
                405,
            )

    async def _api_versions(self, _: web.Request) -> web.Response:
        return _json(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                ],
            }
        )

    async def _api_groups(self, _: web.Request) -> web.Response:
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group("policy")]})

    def _handler(self, rt: ResourceType) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._dispatch(rt, request)

        return handle

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"the request body is not JSON: {exc}") from exc

    async def _dispatch(self, rt: ResourceType, request: web.Request) -> web.StreamResponse:
        ns = request.match_info.get("namespace", "")
        name = request.match_info.get("name")
        sub = request.match_info.get("sub", "")
        q = request.query
        dry_run = "dryRun" in q
        method = request.method
        store = self.store
        if sub and sub not in rt.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub == "eviction":
            if method != "POST":
                raise web.HTTPMethodNotAllowed(method, ["POST"])
            body = await self._body(request)
            if (body.get("metadata") or {}).get("name", name) != name:
                raise ApiError(400, "BadRequest", "name in URL does not match name in Eviction object")
            store.evict(ns, name or "", body, dry_run=dry_run)
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)
        if name is None:
            if method == "GET":
                if q.get("watch") in ("1", "true", "True"):
                    return await self._watch(rt, request, ns or None)
                items, rv = store.list_objects(rt, ns or None, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                for obj in items:
                    obj.pop("apiVersion", None)
                    obj.pop("kind", None)
                return _json(
                    {
                        "kind": f"{rt.kind}List",
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    }
                )
            if method == "POST":
                return _json(store.create(rt, ns, await self._body(request), dry_run=dry_run), 201)
            if method == "DELETE":
                items, _ = store.list_objects(rt, ns or None, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                for obj in items:
                    store.delete(rt, ns, obj["metadata"]["name"], dry_run=dry_run)
                return _json({"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {}, "items": items})
            raise web.HTTPMethodNotAllowed(method, ["GET", "POST", "DELETE"])
        if method == "GET":
            return _json(store.get(rt, ns, name))
        if method == "PUT":
            body = await self._body(request)
            replacement: Obj = body

            def replace(_cur: Obj) -> Obj:
                return copy.deepcopy(replacement)

            return _json(store.update(rt, ns, name, replace, sub, dry_run=dry_run))
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            body = await self._body(request)
            if ctype == "application/strategic-merge-patch+json":

                def change(cur: Obj) -> Obj:
                    out = strategic_merge_patch(cur, body)
                    return out if out is not None else {}
            elif ctype == "application/merge-patch+json":

                def change(cur: Obj) -> Obj:
                    out = merge_patch(cur, body)
                    return out if isinstance(out, dict) else {}
            elif ctype == "application/json-patch+json":

                def change(cur: Obj) -> Obj:
                    out = json_patch(cur, body)
                    return out if isinstance(out, dict) else {}
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types include: "
                    "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json"
                    f" (got {ctype!r}; server-side apply is not implemented by this test double)",
                )
            return _json(store.update(rt, ns, name, change, sub, dry_run=dry_run))
        if method == "DELETE":
            body = await self._body(request)
            return _json(store.delete(rt, ns, name, body.get("preconditions"), dry_run=dry_run))
        raise web.HTTPMethodNotAllowed(method, ["GET", "PUT", "PATCH", "DELETE"])

    async def _watch(self, rt: ResourceType, request: web.Request, ns: str | None) -> web.StreamResponse:
        q = request.query
        lsel = label_selector(q["labelSelector"]) if q.get("labelSelector") else None
        fsel = field_selector(rt, q["fieldSelector"]) if q.get("fieldSelector") else None
        rv_text = q.get("resourceVersion", "")
        since = int(rv_text) if rv_text not in ("", "0") else None
        timeout = float(q.get("timeoutSeconds", "1800"))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, str, str, Obj] | None] = asyncio.Queue()

        def push(event: tuple[int, str, str, Obj]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        )
        try:
            cancel = self.store.watch(rt.plural, since, push)
        except ApiError as exc:
            # The real server answers an expired resourceVersion with 200 and an ERROR event.
            await resp.prepare(request)
            await resp.write(json.dumps({"type": "ERROR", "object": exc.status()}).encode() + b"\n")
            await resp.write_eof()
            return resp
        await resp.prepare(request)
        deadline = loop.time() + timeout
        stopping = self._stopping
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0 or (stopping is not None and stopping.is_set()):
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=min(left, 0.5))
                except TimeoutError:
                    continue
                if event is None:
                    break
                _, _, kind, obj = event
                meta = obj["metadata"]
                if ns and rt.namespaced and meta.get("namespace") != ns:
                    continue
                if lsel and not lsel(meta.get("labels") or {}):
                    continue
                if fsel and not fsel(obj):
                    continue
                out = self.store._decorate(rt, copy.deepcopy(obj))
                out["apiVersion"], out["kind"] = rt.api_version, rt.kind
                await resp.write(json.dumps({"type": kind, "object": out}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            cancel()
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    # -- lifecycle

    async def _start_site(self) -> None:
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        if self.port == 0 and server is not None:
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1]

    async def _stop_site(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def start(self) -> Self:
        """Serve from a background thread (tests); returns once the port is bound."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # reported to the caller of start()
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop_site())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-kube-apiserver", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = None
        self._thread = None

    def serve_forever(self, ready_file: Path | None = None) -> None:
        """Serve in this process until SIGTERM/SIGINT (`fleetheal lab up` runs it this way)."""

        async def main() -> None:
            await self._start_site()
            if ready_file is not None:
                ready_file.write_text(json.dumps({"pid": os.getpid(), "url": self.url}))
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            await self._stop_site()

        asyncio.run(main())


def write_kubeconfig(
    path: str | os.PathLike[str], url: str, token: str | None = None, context: str = "fleetheal-lab"
) -> Path:
    """Write a kubeconfig for `url` (JSON is valid YAML; both the client and kubectl read it)."""
    user: Obj = {"token": token} if token else {}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": "default"}}],
        "current-context": context,
        "preferences": {},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    os.chmod(out, 0o600)
    return out
