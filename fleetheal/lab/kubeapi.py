"""Requests to a Kubernetes API server (the lab's real control plane or its test double) through the
`kubernetes` client: `token_client` makes an ApiClient with a bearer token, `api_request` sends one request
with any ApiClient and retries a 429 as client-go does, `KubeApiError` is the API server's error answer.
"""

from __future__ import annotations

import time
from typing import Any

#: How long a request keeps retrying the API server's 429 (Too Many Requests) before it fails.
TOO_MANY_REQUESTS_S = 30.0


class KubeApiError(RuntimeError):
    """The API server answered an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def token_client(url: str, token: str, ca_file: str | None = None) -> Any:
    """A `kubernetes.client.ApiClient` for the API server at `url` with a bearer `token`."""
    from kubernetes import client

    cfg = client.Configuration(host=url, api_key={"authorization": token}, api_key_prefix={"authorization": "Bearer"})
    cfg.ssl_ca_cert = ca_file
    return client.ApiClient(cfg)


def api_request(
    api: Any, method: str, path: str, body: Any = None, content_type: str = "application/json", *, timeout: float = 30.0
) -> Any:
    """One request through the `kubernetes` client's ApiClient `api` (its credentials): `path` may carry a query
    string; the decoded JSON answer. Raises KubeApiError on a 4xx/5xx. A 429 is retried after its Retry-After,
    as client-go does, for up to TOO_MANY_REQUESTS_S: the API server answers 429 ("storage is (re)initializing")
    for a moment after a CRD is Established, and under load that moment was long enough to fail a test."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    headers = {"Accept": "application/json", "Content-Type": content_type}
    deadline = time.monotonic() + TOO_MANY_REQUESTS_S
    while True:
        _, url, header_params, data, _ = api.param_serialize(
            method, path, header_params=dict(headers), body=body, auth_settings=["BearerToken"]
        )
        try:
            resp = api.call_api(method, url, header_params=header_params, body=data, _request_timeout=timeout)
            resp.read()
            return api.response_deserialize(resp, {"2XX": "object"}).data
        except urllib3.exceptions.HTTPError as e:  # no connection: an OSError, as from urllib
            raise ConnectionError(f"{method} {url}: {e}") from e
        except ApiException as e:
            if not e.status:  # the client's own failure (TLS): no answer either
                raise ConnectionError(f"{method} {url}: {e.reason}") from e
            if e.status == 429 and time.monotonic() < deadline:
                time.sleep(_retry_after((e.headers or {}).get("Retry-After")))
                continue
            raise KubeApiError(int(e.status), e.body or str(e.reason or "")) from e


def _retry_after(value: str | None) -> float:
    """Seconds to wait for a 429's Retry-After (delta-seconds; a date or nothing: 1 s), between 0.1 and 2."""
    try:
        return min(2.0, max(0.1, float(value or 1)))
    except ValueError:
        return 1.0
