#!/usr/bin/env python3
"""A training loop that reports to the fleetheal agent: step, step time and loss, once a second.

Stands in for a real script (PyTorch, JAX...): the lines marked `fleetheal` are all a real script adds.
Run it under Slurm (`srun python3 train_with_fleetheal.py`) or by hand next to a running agent:

    python3 agent/examples/train_with_fleetheal.py --steps 300 --nan-at 120
    FLEETHEAL_TRAINING_SOCKET=/tmp/training.sock python3 agent/examples/train_with_fleetheal.py --hang-at 50

--nan-at makes the loss NaN at that step (the agent raises nan-loss); --hang-at stops making progress at
that step, as a rank stuck in a collective would (the agent raises job-hang after its hang timeout and
names this rank as the suspect).
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import sys
import time
from pathlib import Path

try:
    from fleetheal.agent.client import TrainingReporter  # fleetheal
except ImportError:  # run from a checkout without installing fleetheal
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from fleetheal.agent.client import TrainingReporter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds per simulated step")
    parser.add_argument("--nan-at", type=int, help="make the loss NaN at this step")
    parser.add_argument("--hang-at", type=int, help="stop making progress at this step")
    args = parser.parse_args()

    reporter = TrainingReporter()  # fleetheal: job, rank and GPU from SLURM_*/RANK/LOCAL_RANK

    def stopped(signum: int, frame: object) -> None:
        # Slurm's SIGTERM (requeue or cancel) ends this run on this node: say so, or the agent would
        # wait for progress that now happens elsewhere and call the job hung. (Save a checkpoint here too.)
        reporter.end()  # fleetheal
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stopped)
    rng = random.Random(0)  # noqa: S311 - a simulated loss curve
    loss = 4.0
    for step in range(1, args.steps + 1):
        started = time.monotonic()
        if args.hang_at is not None and step >= args.hang_at:
            print(f"step {step}: stuck (simulated collective hang)", flush=True)
            time.sleep(3600)
        time.sleep(args.step_time)  # the forward/backward pass
        loss = max(0.5, loss * 0.99 + rng.uniform(-0.02, 0.02))
        if args.nan_at is not None and step == args.nan_at:
            loss = math.nan
        reporter.report(step, step_time=time.monotonic() - started, loss=loss)  # fleetheal
        if step % 10 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    reporter.end()  # fleetheal: finished, so silence from now on is not a hang
    print(f"done: {reporter.sent} reports sent, {reporter.dropped} dropped (no agent?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
