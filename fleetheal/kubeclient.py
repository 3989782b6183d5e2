"""The one builder of a Kubernetes API client: the remediator's steps (`fleetheal.steps`' `Kube`) and its
leader election (`fleetheal.remediator.leader`) both connect through it. The `kubernetes` package is imported
when a client is built, never on import: importing the steps or the remediator costs nothing without it.
"""

from __future__ import annotations

from typing import Any


def api_client(kubeconfig: str, *, retries: int | None = None, connections: int | None = None) -> Any:
    """A `kubernetes.client.ApiClient` from `kubeconfig`, or ("") from the pod's service account.

    `retries`: urllib3's silent retries inside the client (None: urllib3's default, 3); `connections`: the
    connections kept to the API server (None: the client's default)."""
    from kubernetes import client, config

    conf = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)  # type: ignore[no-untyped-call]
    else:
        config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
    if connections is not None:
        conf.connection_pool_maxsize = connections
    conf.retries = retries
    return client.ApiClient(conf)
