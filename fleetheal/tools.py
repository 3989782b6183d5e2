"""Where `make tools` (scripts/build-tools.sh) puts the programs it builds from Go modules: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and kwok (the lab's control plane), Slinky's
slurm-operator, pulumi and its Kubernetes provider (`fleetheal infra`), and the files that come with them
(`share/`). `$FLEETHEAL_TOOLS` names another build directory."""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout this package sits in, the repository root: `make tools` builds into its .tools, `fleetheal generate`
#: writes its files, the lab and `fleetheal render` read its stacks. The one place that derives it from __file__.
CHECKOUT = Path(__file__).resolve().parents[1]


def tools_dir() -> Path:
    """The directory holding the built programs: `$FLEETHEAL_TOOLS/bin`, else the checkout's .tools/bin."""
    return Path(os.environ.get("FLEETHEAL_TOOLS", CHECKOUT / ".tools")) / "bin"


def tools_share() -> Path:
    """Files that come with the built programs (kwok's stages, the slurm-operator's CRDs): beside `tools_dir()`."""
    return tools_dir().parent / "share"
