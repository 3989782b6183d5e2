"""JSON over HTTP with the standard library: one request, its decoded answer.

The agent's fast path (Node taint), `fleetheal nodes repaired`, the lab, tests and benchmarks send
their JSON requests through `request_json`; the agent keeps to the standard library this way. A
notification whose answer does not matter (the remediator's repair reports to a ticketing webhook) goes
through `send_json`, which tries again on a failure and returns only the answer's status.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any


def request_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    token: str | None = None,
    content_type: str = "application/json",
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    context: ssl.SSLContext | None = None,
) -> Any:
    """`method` `url` with `body` as JSON (and a bearer `token`); the decoded JSON answer (None when empty).

    An error status raises urllib.error.HTTPError (its `code`, and `read()` for the body); a failure to
    connect raises urllib.error.URLError (an OSError).
    """
    req = _request(method, url, body, token=token, content_type=content_type, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:  # noqa: S310 - _request checked the scheme
        raw = resp.read()
    return json.loads(raw) if raw else None


def send_json(
    method: str,
    url: str,
    body: Any,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    attempts: int = 1,
    on_error: Callable[[int, OSError], None] | None = None,
) -> int:
    """`method` `url` with `body` as JSON (and a bearer `token`); the answer's status, its body unread.

    A failure (an error status or no connection: an OSError) is handed to `on_error(attempt, error)` and
    tried again after 1, 2, 4... seconds, `attempts` times in all; the last one's error is raised.
    """
    req = _request(method, url, body, token=token, content_type="application/json", headers=None)
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - _request checked the scheme
                return int(resp.status)
        except OSError as exc:
            if on_error is not None:
                on_error(attempt, exc)
            if attempt >= attempts:
                raise
            time.sleep(2 ** (attempt - 1))
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def _request(
    method: str, url: str, body: Any, *, token: str | None, content_type: str, headers: Mapping[str, str] | None
) -> urllib.request.Request:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an HTTP URL: {url}")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - the scheme is checked above
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", content_type)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    return req
