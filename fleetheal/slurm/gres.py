"""GPU counts in Slurm's GRES strings (`sinfo`'s `Gres`/`GresUsed`) and TRES strings (`squeue`'s `tres-alloc`,
`sacct`'s ReqTRES/AllocTRES): the fleet view, placement and the queue replay all count GPUs here.
"""

from __future__ import annotations

import re

_GRES = re.compile(r"([^,(]+)(?:\([^)]*\))?")


def parse_gres(text: str, default_type: str = "") -> dict[str, int]:
    """GPUs by type in a `Gres`/`GresUsed` field: `gpu:h100:8(S:0-1),gpu:a100:2` -> {h100: 8, a100: 2};
    an untyped `gpu:8` counts under `default_type`. Other GRES (`shard`, `mps`) and `(null)` are ignored."""
    counts: dict[str, int] = {}
    for m in _GRES.finditer(text.strip()):
        parts = m.group(1).strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if not count.isdigit():  # `gpu:h100` without a count: one GPU (gres.conf semantics)
            count, kind = "1", parts[1]
        else:
            kind = parts[1] if len(parts) > 2 else default_type
        counts[kind] = counts.get(kind, 0) + int(count)
    return counts


def tres_gpus(tres: str) -> int:
    """GPUs in a TRES string: `cpu=1,mem=1G,node=1,billing=1,gres/gpu=8` -> 8. The untyped `gres/gpu=N` when
    present (Slurm lists the typed `gres/gpu:h100=N` beside it), otherwise the sum of the typed counts.
    Fields other than GPUs are not read; a GPU field whose value is not a count raises ValueError naming it."""
    untyped: int | None = None
    typed = 0
    for item in tres.split(","):
        key, _, value = item.strip().partition("=")
        if key != "gres/gpu" and not key.startswith("gres/gpu:"):
            continue
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"{item.strip()!r} in TRES {tres!r}: the GPU count is not a number")
        if key == "gres/gpu":
            untyped = (untyped or 0) + int(value)
        else:
            typed += int(value)
    return typed if untyped is None else untyped
