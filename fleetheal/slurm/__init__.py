"""The Slurm wing: everything fleetheal knows about Slurm's commands and what they print, in one place.

- `runner`: which binaries (names, a bin dir, their environment), timeout, retries; `Runner.checked` (output or
  an error naming the command), `Runner.read` (what it printed, and why not all of it), `Runner.completed` (raw).
- `client`: `Client`, the runner shared by concurrent callers: shared reads (`Shared`) and batched
  `scontrol`/`scancel` (`Batched`). The remediator's steps use it.
- `fields`: how Slurm prints fields: the `-O` field separator, `-M` cluster sections, `scontrol show -o`
  key=value lines, JSON numbers of every data parser.
- `nodes`: the one reader of nodes (`sinfo` text or JSON) and the rules on them.
- `jobs`: the one reader of jobs (`squeue --json`, `squeue` text of the fleet, `squeue -o` of one job).
- `gres`: GPU counts in GRES and TRES strings.

Standard library only: the agent's fast path on every GPU node uses it.
"""
