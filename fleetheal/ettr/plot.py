"""`fleetheal ettr simulate --plot FILE.png`: ETTR against scale, the profile and its baseline (matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetheal.ettr.model import GOAL


def plot(rows: Sequence[dict[str, Any]], path: Path, name: str, baseline: str) -> None:
    """Write a PNG of the rows of `fleetheal ettr simulate --json` (gpus, ettr, baseline_ettr)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(gpus, [100 * r["ettr"] for r in rows], marker="o", label=name)
    ax.plot(gpus, [100 * r["baseline_ettr"] for r in rows], marker="s", label=f"{baseline} (baseline)")
    ax.axhline(100 * GOAL, color="grey", linestyle="--", linewidth=1, label=f"goal {GOAL:.1%}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [f"{g:,}" for g in gpus], rotation=30)
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("ETTR at the best checkpoint interval (%)")
    ax.set_title("Simulated ETTR, Llama 3 Table 5 failure rates")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
