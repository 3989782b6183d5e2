"""`FakeKubeApiServer`: a TEST DOUBLE of the Kubernetes API server, for the lab and tests.

The lab runs it when `make tools` has not built the real control plane (`fleetheal.lab.controlplane`):
`make demo` does not build it, and `fleetheal lab up` says which one it started. It is not Kubernetes: it
holds a few resource types in memory, has no kubelet, scheduler or controllers, and deletes pods at once
(no graceful termination). What it does
follow is the API's wire semantics, closely enough that the official `kubernetes` Python client and
Ansible's `kubernetes.core` modules (k8s, k8s_info, k8s_drain, k8s_taint, which discover resources
through /api, /apis and the group-version resource lists) work against it over HTTP:

- discovery: /version, /api, /apis, /api/v1, /apis/policy, /apis/policy/v1;
- Nodes and Namespaces (cluster scoped), Pods and PodDisruptionBudgets (namespaced): get, list, create,
  replace (PUT), patch (strategic-merge, merge and JSON patch), delete, and the `status` subresources;
- label selectors (=, ==, !=, exists, !exists, in, notin) and field selectors (metadata.name,
  metadata.namespace, spec.nodeName, status.phase);
- `pods/eviction` (policy/v1 Eviction): 201 when every matching PodDisruptionBudget allows a disruption,
  429 TooManyRequests with a DisruptionBudget cause when one would be violated, 500 when more than one
  budget selects the pod (as the real server answers); PDB status is computed when read;
- one global resourceVersion counter (like etcd's revision) stamped on every object, 409 Conflict when an
  update or patch carries a stale `metadata.resourceVersion` or a delete a stale precondition, 409
  AlreadyExists, 404 NotFound and 422 Invalid answered as `Status` objects;
- watch (`?watch=1`) for every type: newline-delimited events, replayed from a `resourceVersion` still
  in the history window (410 Gone as an ERROR event when it is not), `timeoutSeconds`;
- `?dryRun=All` validates without storing; optional bearer-token check; optional JSON persistence of
  the whole state (written after each change), so `fleetheal lab up` can run it as a background
  process: `python -m fleetheal.lab.kube --port P --state FILE --kubeconfig FILE`.

Server-side apply (`application/apply-patch+yaml`) is answered 415: nothing here needs it.

The package, by concern: `model` (the resource types, `Status` errors, validation, the objects the lab
seeds), `patch` (patches and selectors), `store` (the objects, resourceVersion, history and evictions),
`server` (HTTP, watch, the kubeconfig) and `__main__` (the command line). This module is its public face.
"""

from fleetheal.lab.kube.model import node_object, pod_object
from fleetheal.lab.kube.patch import json_patch, label_selector, merge_patch, strategic_merge_patch
from fleetheal.lab.kube.server import FakeKubeApiServer, write_kubeconfig

__all__ = [
    "FakeKubeApiServer",
    "json_patch",
    "label_selector",
    "merge_patch",
    "node_object",
    "pod_object",
    "strategic_merge_patch",
    "write_kubeconfig",
]
