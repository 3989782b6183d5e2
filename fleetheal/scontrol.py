"""Read what `scontrol show job -o` prints (Slurm 22.05 has no `--json` for it): the lab's SlurmCluster
and the benchmarks read jobs this way. Nodes are read by `fleetheal.slurm_nodes`.
"""

from __future__ import annotations

import re

_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_.:/]*)=")


def parse_kv_line(line: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` line into its key=value fields.

    Values may contain spaces (`Comment=`, `Command=`): a value runs up to the next ` Key=`, so a value
    that itself holds ` word=` (a fleetheal comment's `incident=`) is split there.
    """
    line = line.strip()
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out
