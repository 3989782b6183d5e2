"""JSON over HTTP with the standard library: one request, its decoded answer.

The agent's fast path (Node taint), `fleetheal nodes repaired`, the lab, tests and benchmarks send
their JSON requests through `request_json`; the agent keeps to the standard library this way.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Mapping
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
    with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:  # noqa: S310 - checked above
        raw = resp.read()
    return json.loads(raw) if raw else None
