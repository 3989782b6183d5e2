"""SlinkyCluster: the slurm-operator and one Slurm cluster (Slinky v1.2.1 custom resources).

Two modes:
- `manifests`: applies the slurm-operator CRDs (vendored verbatim in `crds/`), the operator
  Deployment with its RBAC, and the Controller, Accounting, RestApi, LoginSet and one NodeSet per
  GPU pool as custom resources. No chart access needed; every object is validated in tests against
  the CRDs' schemas.
- `helm`: installs the slurm-operator-crds, slurm-operator and slurm charts as `helm.v3.Release`s
  with values built from the same settings (the chart renders the same custom resources).

This module creates the objects and checks the arguments; what the custom resources and the chart's
values hold is rendered by fleetheal.infra.slinky_specs.SlinkySpecs (`SlinkyCluster.specs`).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any, TypedDict

import pulumi
import pulumi_kubernetes as k8s
import yaml

from fleetheal.infra import common, slurm_hooks
from fleetheal.infra.slinky_specs import SSSD_CONF, SlinkySpecs
from fleetheal.infra.stack_model import ACCOUNTING_SERVICE_TYPES, FEDERATION_ROLES, SLINKY_MODES, GpuPool

COMPONENT = "SlinkyCluster"
API = "slinky.slurm.net/v1beta1"
CRD_FILES = (
    "slinky.slurm.net_accountings.yaml",
    "slinky.slurm.net_controllers.yaml",
    "slinky.slurm.net_loginsets.yaml",
    "slinky.slurm.net_nodesets.yaml",
    "slinky.slurm.net_restapis.yaml",
    "slinky.slurm.net_tokens.yaml",
)


@cache
def crd_documents() -> tuple[dict[str, Any], ...]:
    """The slurm-operator v1.2.1 CRDs shipped with fleetheal."""
    pkg = resources.files("fleetheal.infra") / "crds"
    return tuple(yaml.safe_load((pkg / f).read_text(encoding="utf-8")) for f in CRD_FILES)


class _SlinkyClusterRequired(TypedDict):
    mode: str
    """`manifests` (CRDs + operator + custom resources) or `helm` (chart releases)."""
    cluster_name: str
    """Slurm ClusterName; also the Controller's name."""
    namespace: str
    """Namespace of the Slurm cluster's custom resources (must exist)."""
    operator_namespace: str
    """Namespace of the slurm-operator (created here)."""
    version: str
    """slurm-operator release (operator image tag, chart version)."""
    chart_repo: str
    """Helm repository of the Slinky charts (helm mode)."""
    operator_image: str
    """Pinned slurm-operator image."""
    images: dict[str, str]
    """Pinned images by component: slurmctld, slurmd, slurmdbd, slurmrestd, login, helper."""
    pools: tuple[GpuPool, ...]
    """GPU pools: one DaemonSet-mode NodeSet each, on the pool's active nodes."""
    large_job_min_nodes: int
    """Jobs with at least this many nodes belong to the `large` partition."""
    requeue_grace_seconds: int
    """Slurm KillWait: the checkpoint grace before SIGKILL."""
    slurm_key_secret: str
    """Secret with key slurm.key (auth/slurm)."""
    jwt_key_secret: str
    """Secret with key jwt.key (HS256)."""
    accounting_db_host: str
    """Database host slurmdbd writes to."""
    accounting_db_password_secret: str
    """Secret with key `password` for the database user `slurm`."""
    shared_claim: str
    """ReadWriteMany claim mounted in slurmd and login pods."""
    shared_mount_path: str
    """Mount path of the shared claim."""


class SlinkyClusterArgs(_SlinkyClusterRequired, total=False):
    federation_role: str
    """`none` (default), `manager` (runs the federation's slurmdbd, exposed to the workers) or `worker`
    (accounting is the manager's slurmdbd, an external Accounting)."""
    manager_address: tuple[str, int]
    """worker: (host, port) of the manager's slurmdbd."""
    accounting_service_type: str
    """manager: the Kubernetes Service type of slurmdbd (LoadBalancer, NodePort or ClusterIP)."""


class SlinkyCluster(pulumi.ComponentResource):
    """The slurm-operator and a Slurm cluster whose GPU NodeSets follow fleetheal's pool labels."""

    nodeset_names: list[str]

    def __init__(self, name: str, args: SlinkyClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        a: dict[str, Any] = {"federation_role": "none", **dict(args)}
        common.require(a, COMPONENT, _SlinkyClusterRequired.__annotations__)
        mode = common.one_of(COMPONENT, "mode", a["mode"], SLINKY_MODES)
        role = common.one_of(COMPONENT, "federation_role", a["federation_role"], FEDERATION_ROLES)
        if role != "none" and mode != "manifests":
            raise common.ComponentArgError(
                f"{COMPONENT}.mode: {mode!r} is not accepted with federation_role {role}; use manifests"
            )
        if role == "worker":
            address = a.get("manager_address")
            if not (isinstance(address, tuple) and len(address) == 2 and address[0] and isinstance(address[1], int)):
                raise common.ComponentArgError(
                    f"{COMPONENT}.manager_address: {address!r} is not accepted; a worker needs (host, port) of the "
                    "manager's slurmdbd"
                )
        if role == "manager":
            common.one_of(
                COMPONENT,
                "accounting_service_type",
                a.get("accounting_service_type", "LoadBalancer"),
                ACCOUNTING_SERVICE_TYPES,
            )
        common.dns_label(COMPONENT, "cluster_name", a["cluster_name"], 40)
        common.dns_label(COMPONENT, "namespace", a["namespace"])
        common.dns_label(COMPONENT, "operator_namespace", a["operator_namespace"])
        common.pinned_image(COMPONENT, "operator_image", a["operator_image"])
        for comp in ("slurmctld", "slurmd", "slurmdbd", "slurmrestd", "login", "helper"):
            if comp not in a["images"]:
                raise common.ComponentArgError(
                    f"{COMPONENT}.images: missing {comp!r}; "
                    "needs slurmctld, slurmd, slurmdbd, slurmrestd, login, helper"
                )
            common.pinned_image(COMPONENT, f"images.{comp}", a["images"][comp])
        if not a["pools"]:
            raise common.ComponentArgError(f"{COMPONENT}.pools: at least one GPU pool is required")
        common.positive(COMPONENT, "large_job_min_nodes", a["large_job_min_nodes"], 2)
        common.positive(COMPONENT, "requeue_grace_seconds", a["requeue_grace_seconds"])
        super().__init__("fleetheal:slinky:SlinkyCluster", name, None, opts)
        self.args = a
        self.specs = SlinkySpecs(a)
        self.nodeset_names = self.specs.nodeset_names
        child = pulumi.ResourceOptions(parent=self)

        self.operator_ns = k8s.core.v1.Namespace(
            f"{name}-operator-ns",
            metadata={"name": a["operator_namespace"], "labels": common.labels("slinky", "slurm-operator")},
            opts=child,
        )
        self.hooks = self._hook_config_maps(name, child)
        self.sssd = k8s.core.v1.Secret(
            f"{name}-sssd",
            metadata={
                "name": f"{a['cluster_name']}-sssd-conf",
                "namespace": a["namespace"],
                "labels": self.specs.labels("login"),
            },
            string_data={"sssd.conf": SSSD_CONF},
            opts=child,
        )
        if mode == "manifests":
            self.crds = [
                k8s.apiextensions.v1.CustomResourceDefinition(
                    f"{name}-crd-{doc['spec']['names']['plural']}",
                    metadata={"name": doc["metadata"]["name"], "annotations": doc["metadata"].get("annotations", {})},
                    spec=doc["spec"],
                    # Deleting a CRD deletes every custom resource of its kind: keep them on destroy.
                    opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True),
                )
                for doc in crd_documents()
            ]
            self._operator(name, child)
            after_crds = pulumi.ResourceOptions(parent=self, depends_on=[*self.crds, *self.hooks, self.sssd])
            self.custom_resources = self._custom_resources(name, after_crds)
        else:
            self.releases = self._helm(name, pulumi.ResourceOptions(parent=self, depends_on=[*self.hooks, self.sssd]))
        self.register_outputs({"controller": a["cluster_name"], "nodesets": self.nodeset_names})

    def _hook_config_maps(self, name: str, child: pulumi.ResourceOptions) -> list[k8s.core.v1.ConfigMap]:
        a = self.args
        md = {"namespace": a["namespace"], "labels": self.specs.labels("slurm-hooks")}
        return [
            k8s.core.v1.ConfigMap(
                f"{name}-prolog",
                metadata={"name": self.specs.prolog_name, **md},
                data={"10-fleetheal-agent.sh": slurm_hooks.prolog_script()},
                opts=child,
            ),
            k8s.core.v1.ConfigMap(
                f"{name}-epilog",
                metadata={"name": self.specs.epilog_name, **md},
                data={"90-fleetheal-agent.sh": slurm_hooks.epilog_script()},
                opts=child,
            ),
            k8s.core.v1.ConfigMap(
                f"{name}-hooks",
                metadata={"name": self.specs.hooks_name, **md},
                data={slurm_hooks.HEALTHCHECK: slurm_hooks.healthcheck_script()},
                opts=child,
            ),
        ]

    # -- manifests mode --------------------------------------------------------------------------

    def _operator(self, name: str, child: pulumi.ResourceOptions) -> None:
        a = self.args
        ns = a["operator_namespace"]
        labels = common.labels("operator", "slurm-operator")
        self.operator_sa = k8s.core.v1.ServiceAccount(
            f"{name}-operator-sa", metadata={"name": "slurm-operator", "namespace": ns, "labels": labels}, opts=child
        )
        rw = ["get", "list", "watch", "create", "update", "patch", "delete"]
        slinky = ["controllers", "accountings", "loginsets", "nodesets", "restapis", "tokens"]
        self.operator_role = k8s.rbac.v1.ClusterRole(
            f"{name}-operator-role",
            metadata={"name": "slurm-operator", "labels": labels},
            # The operator's own role (config/rbac of slurm-operator 1.1.0 and of 1.2.1, both granted), plus
            # pods/eviction. tests/infra/test_slinky_operator.py runs the real operator on this role.
            rules=[
                {"apiGroups": ["slinky.slurm.net"], "resources": slinky, "verbs": rw},
                {
                    "apiGroups": ["slinky.slurm.net"],
                    "resources": [*(f"{r}/status" for r in slinky), "nodesets/scale"],
                    "verbs": ["get", "update", "patch"],
                },
                {
                    "apiGroups": ["slinky.slurm.net"],
                    "resources": [f"{r}/finalizers" for r in slinky],
                    "verbs": ["update"],
                },
                {
                    "apiGroups": [""],
                    "resources": ["pods", "services", "configmaps", "secrets", "persistentvolumeclaims", "events"],
                    "verbs": rw,
                },
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "update", "patch"]},
                {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["secrets/finalizers"], "verbs": ["update"]},
                {
                    "apiGroups": ["apps"],
                    "resources": ["deployments", "statefulsets", "daemonsets", "controllerrevisions"],
                    "verbs": rw,
                },
                {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": rw},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": rw},
                {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors"], "verbs": rw},
                {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
            ],
            opts=child,
        )
        self.operator_binding = k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-operator-binding",
            metadata={"name": "slurm-operator", "labels": labels},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "slurm-operator"},
            subjects=[{"kind": "ServiceAccount", "name": "slurm-operator", "namespace": ns}],
            opts=child,
        )
        sel = {"app.kubernetes.io/name": "slurm-operator"}
        self.operator = k8s.apps.v1.Deployment(
            f"{name}-operator",
            metadata={"name": "slurm-operator", "namespace": ns, "labels": labels},
            spec={
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {
                    "metadata": {"labels": {**labels, **sel}},
                    "spec": {
                        "serviceAccountName": "slurm-operator",
                        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [
                            {
                                "name": "slurm-operator",
                                "image": a["operator_image"],
                                "imagePullPolicy": "IfNotPresent",
                                "args": self.specs.operator_args(),
                                "ports": [
                                    {"name": "health", "containerPort": 8081},
                                    {"name": "metrics", "containerPort": 8080},
                                ],
                                "livenessProbe": {"httpGet": {"path": "/healthz", "port": "health"}},
                                "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}},
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "128Mi"},
                                    "limits": {"memory": "512Mi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.operator_ns, self.operator_binding]),
        )

    def _cr(self, name: str, kind: str, obj_name: str, spec: dict[str, Any], opts: pulumi.ResourceOptions) -> Any:
        return k8s.apiextensions.CustomResource(
            name,
            api_version=API,
            kind=kind,
            metadata={"name": obj_name, "namespace": self.args["namespace"], "labels": self.specs.labels(kind.lower())},
            spec=spec,
            opts=opts,
        )

    def _custom_resources(self, name: str, opts: pulumi.ResourceOptions) -> list[Any]:
        a = self.args
        cn = a["cluster_name"]
        out = [
            self._cr(f"{name}-accounting", "Accounting", f"{cn}-accounting", self.specs.accounting_spec(), opts),
            self._cr(f"{name}-controller", "Controller", cn, self.specs.controller_spec(), opts),
            self._cr(f"{name}-restapi", "RestApi", f"{cn}-restapi", self.specs.restapi_spec(), opts),
            self._cr(f"{name}-login", "LoginSet", f"{cn}-login", self.specs.loginset_spec(), opts),
        ]
        for pool in a["pools"]:
            out.append(
                self._cr(
                    f"{name}-nodeset-{pool.name}",
                    "NodeSet",
                    self.specs.nodeset_name(pool),
                    self.specs.nodeset_spec(pool),
                    opts,
                )
            )
        return out

    def _helm(self, name: str, opts: pulumi.ResourceOptions) -> list[k8s.helm.v3.Release]:
        a = self.args
        repo = a["chart_repo"]
        op_repo, _, op_tag = a["operator_image"].rpartition(":")

        def release(
            suffix: str, chart: str, ns: str, values: dict[str, Any], ropts: pulumi.ResourceOptions
        ) -> k8s.helm.v3.Release:
            return k8s.helm.v3.Release(
                f"{name}-{suffix}",
                name=suffix,
                chart=f"{repo}/{chart}",
                version=a["version"],
                namespace=ns,
                values=values,
                atomic=True,
                opts=ropts,
            )

        crds = release(
            "slurm-operator-crds",
            "slurm-operator-crds",
            a["operator_namespace"],
            {},
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[self.operator_ns])),
        )
        operator = release(
            "slurm-operator",
            "slurm-operator",
            a["operator_namespace"],
            {"crds": {"enabled": False}, "operator": {"image": {"repository": op_repo, "tag": op_tag}}},
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[crds])),
        )
        slurm = release(
            "slurm",
            "slurm",
            a["namespace"],
            self.specs.helm_values(),
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[operator])),
        )
        return [crds, operator, slurm]
