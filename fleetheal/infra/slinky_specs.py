"""What a SlinkyCluster renders, apart from the component that creates it: the custom resources' specs
(Controller, Accounting, RestApi, LoginSet, one NodeSet per GPU pool), the slurm chart's values (helm
mode, the same settings in the chart's shape), the slurm-operator's command line, and the names and
labels they share. Plain data from the component's checked arguments: no Pulumi here, so each piece can
be built and compared on its own (fleetheal.infra.slinky.SlinkyCluster creates the objects).
"""

from __future__ import annotations

from typing import Any

from fleetheal import contracts
from fleetheal.infra import common, slurm_hooks
from fleetheal.infra.policy import shared
from fleetheal.infra.stack_model import SLURMDBD_PORT, GpuPool

#: sssd.conf of the slurm chart 1.2.1 (values.yaml `sssd.conf`): local users only.
SSSD_CONF = """[sssd]
services = nss,pam
domains = DEFAULT

[nss]
filter_groups = root,slurm
filter_users = root,slurm

[pam]

[domain/DEFAULT]
id_provider = proxy
proxy_lib_name = files
auth_provider = proxy
proxy_pam_target = sssd-shadowutils
"""
GPU_RESOURCE = "nvidia.com/gpu"
SHARED_VOLUME = "shared"
HOOKS_VOLUME = "fleetheal-hooks"
AGENT_STATE_VOLUME = "fleetheal-state"


#: slurm.conf lines of every federation member: `sinfo`/`squeue` show the whole federation by default.
FEDERATION_CONF = "FederationParameters=fed_display\n"


def accounting_service(cluster_name: str) -> str:
    """The Service the slurm-operator makes for the Accounting `<cluster>-accounting` (its `<name>-accounting`)."""
    return f"{cluster_name}-accounting-accounting"


def controller_service(cluster_name: str) -> str:
    """The Service the slurm-operator makes for the Controller `<cluster>` (its `<name>-controller`)."""
    return f"{cluster_name}-controller"


def _key_ref(name: str, key: str) -> dict[str, str]:
    return {"name": name, "key": key}


class SlinkySpecs:
    """The objects of one Slinky Slurm cluster as data, from a SlinkyCluster's checked arguments."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.nodeset_names = [self.nodeset_name(p) for p in args["pools"]]

    # -- names -----------------------------------------------------------------------------------

    def nodeset_name(self, pool: GpuPool) -> str:
        return f"{self.args['cluster_name']}-{pool.name}"

    def labels(self, component: str) -> dict[str, str]:
        extra = {"app.kubernetes.io/instance": self.args["cluster_name"]}
        if self.args["federation_role"] != "none" and component in ("controller", "accounting"):
            # The policy pack finds the federation's members (and their manager) by this label.
            extra[shared.LABEL_FEDERATION_ROLE] = self.args["federation_role"]
        return common.labels(component, f"{self.args['cluster_name']}-{component}", extra)

    @property
    def prolog_name(self) -> str:
        return f"{self.args['cluster_name']}-fleetheal-prolog"

    @property
    def epilog_name(self) -> str:
        return f"{self.args['cluster_name']}-fleetheal-epilog"

    @property
    def hooks_name(self) -> str:
        return f"{self.args['cluster_name']}-fleetheal-hooks"

    # -- the custom resources' specs and their pieces -------------------------------------------------

    def extra_conf(self) -> str:
        a = self.args
        conf = slurm_hooks.slurm_conf_lines(a["requeue_grace_seconds"], a["large_job_min_nodes"], self.nodeset_names)
        return conf + (FEDERATION_CONF if a["federation_role"] != "none" else "")

    def _shared_volume(self) -> dict[str, Any]:
        return {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": self.args["shared_claim"]}}

    def _shared_mount(self) -> dict[str, Any]:
        return {"name": SHARED_VOLUME, "mountPath": self.args["shared_mount_path"]}

    def nodeset_pod_volumes(self) -> list[dict[str, Any]]:
        return [
            self._shared_volume(),
            {"name": HOOKS_VOLUME, "configMap": {"name": self.hooks_name, "defaultMode": 0o755}},
            {"name": AGENT_STATE_VOLUME, "hostPath": {"path": contracts.AGENT_STATE_DIR, "type": "DirectoryOrCreate"}},
        ]

    def slurmd_mounts(self) -> list[dict[str, Any]]:
        return [
            self._shared_mount(),
            {"name": HOOKS_VOLUME, "mountPath": slurm_hooks.HOOKS_MOUNT, "readOnly": True},
            {"name": AGENT_STATE_VOLUME, "mountPath": contracts.AGENT_STATE_DIR},
        ]

    def nodeset_node_selector(self, pool: GpuPool) -> dict[str, str]:
        return {"kubernetes.io/os": "linux", contracts.LABEL_POOL: "active", contracts.LABEL_GPU_POOL: pool.name}

    @staticmethod
    def nodeset_tolerations() -> list[dict[str, str]]:
        # GPU nodes commonly carry the nvidia.com/gpu taint; the standby and unhealthy taints are
        # deliberately NOT tolerated: slurmd must not start on a standby or isolated node.
        return [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]

    def nodeset_spec(self, pool: GpuPool) -> dict[str, Any]:
        a = self.args
        features = ",".join(dict.fromkeys((pool.gpu_type, pool.name)))
        return {
            "controllerRef": self._ref(a["cluster_name"]),
            # One slurmd per matching node: promoting a standby node (relabel to active) is enough
            # for the operator to start slurmd on it; no replica count to edit.
            "scalingMode": "DaemonSet",
            "slurmd": {
                "name": "slurmd",
                "image": a["images"]["slurmd"],
                "resources": {
                    "requests": {GPU_RESOURCE: str(pool.gpus_per_node)},
                    "limits": {GPU_RESOURCE: str(pool.gpus_per_node)},
                },
                "volumeMounts": self.slurmd_mounts(),
            },
            "logfile": {"image": a["images"]["helper"]},
            "extraConf": f"Gres=gpu:{pool.gpu_type}:{pool.gpus_per_node} Features={features}",
            "partition": {"enabled": True, "config": "State=UP MaxTime=UNLIMITED"},
            "template": {
                "metadata": {"labels": {contracts.LABEL_GPU_POOL: pool.name}},
                "spec": {
                    "containers": [],
                    "nodeSelector": self.nodeset_node_selector(pool),
                    "tolerations": self.nodeset_tolerations(),
                    "volumes": self.nodeset_pod_volumes(),
                },
            },
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
            # Jobs running on a node keep a PodDisruptionBudget until Slurm has drained it.
            "workloadDisruptionProtection": True,
            **self._prune_slurm_node_records(),
        }

    @property
    def _before_1_2(self) -> bool:
        """An operator older than 1.2, whose CRDs differ in the fields below (tests/infra/test_slinky_operator.py
        runs the real 1.1.0 on them)."""
        major, minor = (int(x) for x in self.args["version"].lstrip("v").split(".")[:2])
        return (major, minor) < (1, 2)

    def _ref(self, name: str) -> dict[str, str]:
        # Before 1.2 a reference names its namespace; an operator 1.1 looks for the object in "" otherwise.
        return {"name": name, "namespace": self.args["namespace"]} if self._before_1_2 else {"name": name}

    def _prune_slurm_node_records(self) -> dict[str, str]:
        # A failed node replaced by a standby one should not linger in slurm.conf. The field came with 1.2.
        return {} if self._before_1_2 else {"pruneSlurmNodeRecords": "NodeNotFound"}

    def controller_spec(self) -> dict[str, Any]:
        a = self.args
        return {
            "clusterName": a["cluster_name"],
            "slurmKeyRef": _key_ref(a["slurm_key_secret"], "slurm.key"),
            "jwtHs256KeyRef": _key_ref(a["jwt_key_secret"], "jwt.key"),
            "accountingRef": self._ref(f"{a['cluster_name']}-accounting"),
            "slurmctld": {"image": a["images"]["slurmctld"], "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
            "reconfigure": {"image": a["images"]["slurmctld"]},
            "logfile": {"image": a["images"]["helper"]},
            "extraConf": self.extra_conf(),
            "prologScriptRefs": [{"name": self.prolog_name}],
            "epilogScriptRefs": [{"name": self.epilog_name}],
            "persistence": {
                "enabled": True,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "4Gi"}},
            },
            "metrics": {"enabled": True},
        }

    def accounting_spec(self) -> dict[str, Any]:
        a = self.args
        if a["federation_role"] == "worker":
            # The federation's one slurmdbd (and its database) run in the manager's stack; this cluster's
            # controller writes its job records there and learns its siblings from it.
            host, port = a["manager_address"]
            return {"external": True, "externalConfig": {"host": host, "port": port}}
        spec = self._local_accounting_spec()
        if a["federation_role"] == "manager":
            # The workers' controllers (other Kubernetes clusters) reach slurmdbd through this Service.
            spec["service"] = {
                "spec": {"type": a.get("accounting_service_type", "LoadBalancer")},
                "port": SLURMDBD_PORT,
            }
        return spec

    def _local_accounting_spec(self) -> dict[str, Any]:
        a = self.args
        return {
            "slurmKeyRef": _key_ref(a["slurm_key_secret"], "slurm.key"),
            "jwtHs256KeyRef": _key_ref(a["jwt_key_secret"], "jwt.key"),
            "slurmdbd": {"image": a["images"]["slurmdbd"]},
            "storageConfig": self.storage_config(),
        }

    def storage_config(self) -> dict[str, Any]:
        """slurmdbd's database (the Accounting's and the chart's `storageConfig`)."""
        a = self.args
        return {
            "host": a["accounting_db_host"],
            "port": 3306,
            "database": "slurm_acct_db",
            "username": "slurm",
            "passwordKeyRef": _key_ref(a["accounting_db_password_secret"], "password"),
        }

    def restapi_spec(self) -> dict[str, Any]:
        a = self.args
        return {
            "controllerRef": self._ref(a["cluster_name"]),
            "replicas": 1,
            "slurmrestd": {"image": a["images"]["slurmrestd"]},
        }

    def loginset_spec(self) -> dict[str, Any]:
        a = self.args
        return {
            "controllerRef": self._ref(a["cluster_name"]),
            "replicas": 1,
            "sssdConfRef": _key_ref(f"{a['cluster_name']}-sssd-conf", "sssd.conf"),
            "login": {"name": "login", "image": a["images"]["login"], "volumeMounts": [self._shared_mount()]},
            "initconf": {"image": a["images"]["helper"]},
            "template": {"spec": {"containers": [], "volumes": [self._shared_volume()]}},
        }

    def operator_args(self) -> list[str]:
        """The operator's command line (cmd/manager's flags; tests run the real operator with them)."""
        ns = self.args["operator_namespace"]
        return ["--leader-elect", f"--leader-elect-namespace={ns}", "--health-addr=:8081", "--metrics-addr=:8080"]

    # -- helm mode: the slurm chart's values ------------------------------------------------------

    def helm_values(self) -> dict[str, Any]:
        """Values for the slurm chart 1.2.1 (shape of its values.yaml, not of the custom resources)."""
        a = self.args

        def image(ref: str) -> dict[str, Any]:
            repo, _, tag = ref.rpartition(":")
            return {"repository": repo, "tag": tag}

        nodesets: dict[str, Any] = {}
        for pool in a["pools"]:
            spec = self.nodeset_spec(pool)
            nodesets[pool.name] = {
                "enabled": True,
                "scalingMode": "DaemonSet",
                "workloadDisruptionProtection": True,
                **self._prune_slurm_node_records(),
                "slurmd": {
                    "image": image(a["images"]["slurmd"]),
                    "resources": spec["slurmd"]["resources"],
                    "volumeMounts": self.slurmd_mounts(),
                },
                "logfile": {"image": image(a["images"]["helper"])},
                "extraConf": spec["extraConf"],
                "partition": {"enabled": True, "config": spec["partition"]["config"]},
                "updateStrategy": spec["updateStrategy"],
                "metadata": {"labels": {contracts.LABEL_GPU_POOL: pool.name}},
                "podSpec": {
                    "nodeSelector": self.nodeset_node_selector(pool),
                    "tolerations": self.nodeset_tolerations(),
                    "volumes": self.nodeset_pod_volumes(),
                },
            }
        return {
            "clusterName": a["cluster_name"],
            "slurmKey": {"create": False, "secretRef": _key_ref(a["slurm_key_secret"], "slurm.key")},
            "jwtKey": {"create": False, "secretRef": _key_ref(a["jwt_key_secret"], "jwt.key")},
            "prologScripts": {"10-fleetheal-agent.sh": slurm_hooks.prolog_script()},
            "epilogScripts": {"90-fleetheal-agent.sh": slurm_hooks.epilog_script()},
            "controller": {
                "slurmctld": {"image": image(a["images"]["slurmctld"])},
                "reconfigure": {"image": image(a["images"]["slurmctld"])},
                "logfile": {"image": image(a["images"]["helper"])},
                "extraConf": self.extra_conf(),
                "metrics": {"enabled": True},
            },
            "restapi": {"replicas": 1, "slurmrestd": {"image": image(a["images"]["slurmrestd"])}},
            "accounting": {
                "enabled": True,
                "slurmdbd": {"image": image(a["images"]["slurmdbd"])},
                "storageConfig": self.storage_config(),
            },
            "sssd": {"secretRef": _key_ref(f"{a['cluster_name']}-sssd-conf", "sssd.conf")},
            "loginsetDefaults": {
                "login": {"image": image(a["images"]["login"]), "volumeMounts": [self._shared_mount()]},
                "initconf": {"image": image(a["images"]["helper"])},
                "podSpec": {"volumes": [self._shared_volume()]},
            },
            "loginsets": {"login": {"enabled": True, "replicas": 1}},
            "nodesets": nodesets,
            # Partitions come from controller.extraConf (large/small); the chart's example `all` stays off.
            "partitions": {"all": {"enabled": False}},
        }
