"""Effective training time ratio (ETTR) at scale: `fleetheal ettr simulate`. See docs/ettr.md.

ETTR is the share of a training job's wall time that produced training progress that was kept:
productive time / allocated time. Everything else is lost work (steps redone after a restart from the last
checkpoint), checkpoint overhead, detection time, recovery time and time spent waiting for a replacement node.

- `rates`: per-component interruption rates (Llama 3 Table 5).
- `model`: the discrete-event simulator and the Young/Daly closed form.
- `profile`: how interruptions are handled: fleetheal's platform timings from the benchmark results,
  the manual and Llama 3-like peers.
- `cli`: `fleetheal ettr simulate`; `plot`: ETTR against scale (matplotlib).

ETTR measured on a lab run is the lab's (`fleetheal.lab.measure`, `fleetheal ettr measure`).
"""
