"""Interruption rates per component and GPU-day: Llama 3's Table 5.

Llama 3 pre-training, 54 days on 16,384 H100 GPUs: the 419 unexpected interruptions of Table 5 ("The Llama 3
Herd of Models", arXiv 2407.21783; transcribed in shared/reference/failure-stats.md, section 1). Rate per
GPU-day = count / (16,384 GPUs x 54 days). Each component also says how it is noticed (detect) and handled
(kind); that mapping is fleetheal's, following the coarse buckets of failure-stats.md note (c): host
maintenance is an unplanned node drain, handled like hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_GPU_DAYS = LLAMA3_GPUS * LLAMA3_DAYS
LLAMA3_TABLE5: tuple[tuple[str, str, int, str, str], ...] = (
    # component, category, count, kind, detect
    ("Faulty GPU", "GPU", 148, "hardware", "hw"),
    ("GPU HBM3 Memory", "GPU", 72, "hardware", "hw"),
    ("Software Bug", "Dependency", 54, "transient", "crash"),
    ("Network Switch/Cable", "Network", 35, "hardware", "hw"),
    ("Host Maintenance", "Unplanned Maintenance", 32, "hardware", "hw"),
    ("GPU SRAM Memory", "GPU", 19, "hardware", "hw"),
    ("GPU System Processor", "GPU", 17, "hardware", "hw"),
    ("NIC", "Host", 7, "hardware", "hw"),
    ("NCCL Watchdog Timeouts", "Unknown", 7, "transient", "symptom"),
    ("Silent Data Corruption", "GPU", 6, "hardware", "symptom"),
    ("GPU Thermal Interface + Sensor", "GPU", 6, "hardware", "hw"),
    ("SSD", "Host", 3, "hardware", "hw"),
    ("Power Supply", "Host", 3, "hardware", "hw"),
    ("Server Chassis", "Host", 2, "hardware", "hw"),
    ("IO Expansion Board", "Host", 2, "hardware", "hw"),
    ("Dependency", "Dependency", 2, "transient", "crash"),
    ("CPU", "Host", 2, "hardware", "hw"),
    ("System Memory", "Host", 2, "hardware", "hw"),
)
SOURCE = (
    f"Llama 3 Table 5 (arXiv 2407.21783): {sum(row[2] for row in LLAMA3_TABLE5)} unexpected interruptions, "
    f"{LLAMA3_GPUS:,} GPUs x {LLAMA3_DAYS} days"
)


@dataclass(frozen=True)
class Component:
    name: str
    category: str
    kind: str  # hardware | transient
    detect: str  # hw | crash | symptom
    per_gpu_day: float


FAILURE_RATES: tuple[Component, ...] = tuple(
    Component(name, cat, kind, detect, count / LLAMA3_GPU_DAYS) for name, cat, count, kind, detect in LLAMA3_TABLE5
)
