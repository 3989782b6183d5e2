"""fleetheal's Pulumi program: read the stack config once, build the components, export a few outputs.

The components live in the importable package `fleetheal.infra` (tests build them under mocks);
this folder has no __init__.py on purpose: it would shadow the `pulumi` SDK.
"""

from pathlib import Path

import pulumi

from fleetheal.infra import config, program

# Pulumi.yaml beside this folder holds every key's declaration (type, default, description).
cfg = config.from_pulumi(Path(__file__).resolve().parent.parent / "Pulumi.yaml")
fleet = program.build(cfg)

pulumi.export("clusterName", cfg.cluster_name)
pulumi.export("slurmNamespace", cfg.slurm_namespace)
pulumi.export("nodeSets", fleet.slinky.nodeset_names)
pulumi.export("standbyNodes", {p.name: p.standby_nodes for p in cfg.gpu_pools})
pulumi.export("remediatorWebhook", fleet.remediator.webhook_url)
pulumi.export("sharedClaim", fleet.storage.claim_name)
