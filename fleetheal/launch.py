"""`fleetheal launch -- CMD`: restart a job's training in place, inside its own Slurm allocation.

A requeued job cannot start again on the same nodes until the credential of its previous run has
expired there (Slurm's `cred_expire` + 1 s, "Job credential revoked" if sooner), and it pays the
scheduler and the prolog again. A job whose batch script ends with

    exec fleetheal launch -- srun python train.py ...

is restarted by the remediator without any of that: the wrapper runs CMD in a process group of its own
and, when ordered, stops it (SIGTERM, which the training's own handler turns into "checkpoint and exit";
SIGKILL after --stop-timeout) and runs it again in the same allocation. New job steps get new
credentials, so nothing waits for the old ones.

The protocol, all through Slurm (the remediator never reaches the node):

1. At start, the wrapper adds the word `fleetheal-launch` to its job's comment: "this job restarts in
   place". It does so only when it is the batch script itself (its parent is `slurmstepd`: `exec` it),
   because the order is a signal to the batch step (`scancel --batch`), and a shell that is sent SIGUSR2
   dies of it, job and all. Otherwise it says why and just runs CMD (the remediator then requeues).
2. The remediator writes `incident=<id> restart=<id>` into the comment, then sends SIGUSR2 (`scancel
   --batch`). `restart=` is the order; a comment naming an incident without it (a refusal: "not requeued")
   orders nothing.
3. The wrapper restarts CMD once per incident id it has not restarted for (a SIGUSR2 without one, sent
   by the job's owner, restarts too), and exports FLEETHEAL_LAUNCH_RESTARTS and FLEETHEAL_INCIDENT.
4. When CMD fails after printing a line the rules flag (an out-of-memory, an NCCL timeout: `OutputWatch`),
   fleetheal is deciding: the wrapper waits up to ORDER_WAIT_S for its order before it exits with CMD's
   status, and stops waiting at once when the comment names a new incident without an order (refused).

Spare nodes: with `--nodes N` the command needs N nodes and the rest of the allocation are spares (the sbatch
script asked for more, the command runs `srun -N "$FLEETHEAL_LAUNCH_NODES" ...`, which the wrapper exports);
the wrapper adds `fleetheal-nodes=N` to the comment. When a node of such a job fails (and it is not the batch
host, where the wrapper itself runs), the remediator relocates the job inside its allocation: it writes
`shrink=NODE` with the incident, sends the restart order, and takes NODE out of the allocation (`scontrol
update jobid=J nodelist=REST`). The wrapper stops CMD, waits until NODE has left the allocation, and starts
CMD again with the allocation's SLURM_JOB_NODELIST, SLURM_NODELIST, SLURM_JOB_NUM_NODES and SLURM_NNODES
(SLURM_JOB_CPUS_PER_NODE and SLURM_TASKS_PER_NODE, which no longer hold, are removed). No requeue, no
scheduler, no credential wait. Shrinking kills the job step's tasks on NODE, and CMD may end of that before
the order arrives: when CMD fails, the wrapper first reads the comment, and an order it has not handled is
carried out.

Every other signal (Slurm's SIGTERM, fleetheal's grace signal SIGUSR1, SIGINT, SIGHUP) is passed on to
CMD's process group. The wrapper exits with CMD's status when CMD ends by itself.

The job's output is a fault source (`OutputWatch`, in a Slurm job, unless --no-watch): the lines that the
application log rules flag (an NCCL watchdog timeout, a CUDA out-of-memory, an illegal address, a
configuration error...) go to the node's agent over its training socket, whose kernel-attested sender uid
proves the job is the sender's. The agent classifies them again and raises job-scoped faults only (a job's
words never move a node: `fleetheal.agent.joboutput`). Looking never slows the job: a batch job's output
file CMD writes itself, and the wrapper reads it back; any other stdout or stderr (a pipe, a terminal) CMD
writes into pipes that the wrapper copies to its own, unchanged, before it looks at them (so the order of
stdout lines against stderr lines may differ from a shared file's by what one read holds). Lines are judged
on another thread, within a byte and a line budget, from a bounded queue that drops what it cannot hold
(counted); a line longer than `logparse.MAX_LINE` is judged by its start; without an agent the job runs on.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from fleetheal.contracts import LAUNCH_TAG
from fleetheal.rate import TokenBucket
from fleetheal.slurm.jobs import job_allocation, job_comment, one_job
from fleetheal.slurm.runner import Runner

if TYPE_CHECKING:
    from fleetheal.logparse import LogParser

TAG = LAUNCH_TAG
#: The restart order; one fixed signal, so the remediator and every job agree on it.
RESTART_SIGNAL = signal.SIGUSR2
#: Comment words: the nodes the command needs (the rest are spares), the node an order shrinks away.
NODES_WORD = "fleetheal-nodes="
SHRINK_WORD = "shrink="
#: Exported to the command with --nodes: how many nodes to run on (`srun -N "$FLEETHEAL_LAUNCH_NODES" ...`).
NODES_ENV = "FLEETHEAL_LAUNCH_NODES"
#: Restarts inside the allocation so far (Slurm's restart count sees only requeues); the remediator's.
RESTARTS_WORD = "fleetheal-restarts="
#: How long the wrapper waits for the remediator to take a node out of the allocation.
SHRINK_WAIT_S = 120.0
#: The restart order word the remediator writes with the incident (`restart=<incident>`).
ORDER_WORD = "restart="
_ORDER = re.compile(rf"(?:^|\s){ORDER_WORD}(\S+)")
_INCIDENT = re.compile(r"(?:^|\s)incident=(\S+)")
#: How long the wrapper waits for fleetheal's order after CMD failed having printed a flagged line.
ORDER_WAIT_S = 30.0
_RESIZED_ENV = ("SLURM_JOB_CPUS_PER_NODE", "SLURM_TASKS_PER_NODE")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGCONT)


def _say(text: str) -> None:
    print(f"fleetheal launch: {text}", file=sys.stderr, flush=True)


def word_value(comment: str, prefix: str) -> str | None:
    """The value of the last word of `comment` that starts with `prefix` (`shrink=n2` -> "n2"), or None."""
    values = [w.removeprefix(prefix) for w in comment.split() if w.startswith(prefix)]
    return values[-1] if values else None


def word_count(comment: str, prefix: str) -> int | None:
    """A count word (`fleetheal-nodes=8`) as an int; None when absent or not an ASCII count (the job's
    owner can write its comment too)."""
    value = word_value(comment, prefix)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def needed_nodes(comment: str) -> int | None:
    """The nodes a launched job's command needs (`fleetheal-nodes=N` in its comment), or None."""
    count = word_count(comment, NODES_WORD)
    return count if count else None


#: `squeue` and `scontrol` for the wrapper's own job.
_SLURM = Runner(timeout_s=10)

#: Reads of CMD's output waiting to be judged (READ_BYTES each at most); a job printing faster than the rules
#: run has its surplus skipped, never held.
WATCH_QUEUE = 64
#: Flagged lines sent to the agent per second at most (the agent applies its own limit too).
LINES_PER_S = 10
#: Seconds between a line the agent did not take and the next try: a full agent queue (a stuck agent, or another
#: process flooding it) holds each try up to `agent.client.SEND_WAIT_S`, so the judge waits a tenth of its time
#: at most, and gets through a flood of flagged lines at its own pace.
SEND_BACKOFF_S = 1.0
#: Lines a second that the rules' regular expressions may judge (lines with a rule's keyword); past it the
#: rest of a read is skipped (counted): a job printing a million error lines a second costs the launcher
#: this much work, and the copy thread, which shares the interpreter with the judge, is never starved.
JUDGED_PER_S = 2000
#: Bytes of output a second that are decoded and searched for the rules' keywords at most (about 15 ms of CPU a
#: MiB); past it, output is skipped for judging (counted) until the budget refills: the judge's work has a
#: ceiling whatever the job prints. A crash's last lines come after the flood stops, when the budget is there
#: again (and the last READ_BYTES of an output file are judged when the command ends, whatever the budget).
JUDGED_BYTES_PER_S = 512 << 10
#: The pipes' capacity: a copy thread kept from running for a moment (the judge holds the interpreter) does
#: not block a fast-printing job (Linux's default is 64 KiB; unprivileged processes may ask for 1 MiB).
PIPE_BYTES = 1 << 20
#: Seconds between reads of an output file the command writes itself (`_Tail`).
TAIL_S = 0.2
#: Bytes one read of the command's output takes at most, and how long the copy waits after a short read.
READ_BYTES = 256 << 10
COALESCE_S = 0.005
#: Seconds the launcher waits, once its command has ended, for its last output to be judged: the rules may still be
#: loading (about 0.3 s on an idle node, many times that on a loaded one) and the judge may have reads queued
#: (WATCH_QUEUE at most). The last lines are a crash's, worth the wait.
LAST_LINES_S = 60.0


class OutputWatch:
    """Watches the command's stdout and stderr and sends the lines the application rules flag to the node's
    agent (`fleetheal.agent.client.TrainingReporter.line`).

    A stream that is a regular file (a batch job's output file) the command writes itself: the watch reads
    the file behind it (`_Tail`), at most JUDGED_BYTES_PER_S, so the job is never slowed and its output
    costs the launcher nothing past what is judged. Any other stream (a pipe, a terminal) is copied through
    a pipe of the launcher's (`_pump`)."""

    def __init__(self, job: str, run: Any) -> None:
        from fleetheal.agent.client import TrainingReporter

        self.reporter = TrainingReporter(job=job, rank=0)
        #: The launcher's restart count, read when a line is sent.
        self.run = run
        #: Slurm's restart count of this run of the job (unset before its first requeue): with `run`, which
        #: run printed a line (`fleetheal.agent.training.run_label`).
        count = os.environ.get("SLURM_RESTART_COUNT", "0")
        self.requeues = int(count) if count.isascii() and count.isdigit() else None
        self.skipped = 0
        self.sent = 0
        #: (stream, read, gap): `gap` says what was skipped of the stream just before the read (`_skip`).
        self._queue: queue.Queue[tuple[int, bytes, bool | None]] = queue.Queue(WATCH_QUEUE)
        #: Per stream, output skipped since the last read handed to the judge: None (none), else whether it
        #: ended inside a line.
        self._gap: dict[int, bool | None] = {1: None, 2: None}
        #: Reads handed to the judge, and reads it is done with (judged, or passed over when the rules cannot load).
        self._reads = threading.Condition()
        self._queued = 0
        self._done = 0
        self._pumps: list[threading.Thread] = []
        now = time.monotonic()
        self._sends = TokenBucket(LINES_PER_S, now)
        self._next_try = now
        self._judged = TokenBucket(JUDGED_PER_S, now)
        #: Bytes a second handed to the judge; both streams share it.
        self._budget = TokenBucket(JUDGED_BYTES_PER_S, now)
        self._budget_lock = threading.Lock()
        #: Lines with a rule's keyword not judged: over JUDGED_PER_S.
        self.skipped_lines = 0
        #: The streams (1, 2) the command writes itself: regular files, read back by `_Tail`s.
        self._tails: dict[int, _Tail] = {}
        seen: dict[tuple[int, int], _Tail] = {}
        for fd in (1, 2):
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                tail = seen.get((st.st_dev, st.st_ino))
                if tail is None:
                    tail = seen[(st.st_dev, st.st_ino)] = _Tail(self, fd)
            except OSError:  # closed, or not readable by this user: copied through
                continue
            self._tails[fd] = tail
        threading.Thread(target=self._judge, name="fleetheal-launch-judge", daemon=True).start()
        for tail in seen.values():
            threading.Thread(target=tail.run, name=f"fleetheal-launch-tail-{tail.stream}", daemon=True).start()

    def streams(self) -> tuple[int | None, int | None]:
        """The command's stdout and stderr: the launcher's own (None: inherited) where it is a file read back,
        else a pipe to copy through."""
        return tuple(None if fd in self._tails else subprocess.PIPE for fd in (1, 2))  # type: ignore[return-value]

    def follow(self, child: subprocess.Popen[bytes]) -> None:
        """Start copying a newly started child's pipes (its files are read back all along)."""
        self._pumps = [p for p in self._pumps if p.is_alive()]
        for out, fd in ((child.stdout, 1), (child.stderr, 2)):
            if out is not None:
                with contextlib.suppress(OSError, AttributeError):  # a smaller pipe still works
                    fcntl.fcntl(out.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
                pump = threading.Thread(target=self._pump, args=(out, fd), daemon=True)
                pump.start()
                self._pumps.append(pump)

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until the command's output is copied and judged. The copy has a bound (`timeout`): a daemon the
        command left may hold its pipes open. What was handed to the judge by then, the command's last lines
        among it, is judged at the judge's pace, within LAST_LINES_S: on a loaded node the rules may still be
        loading and the judge may have reads of a flood to go through, and the last lines, a crash's, are the
        ones that matter (a drain that gave up with the copy's deadline lost them on a loaded CI machine)."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        for tail in set(self._tails.values()):
            with contextlib.suppress(OSError):
                tail.poll(final=True)  # its last lines, whatever the budget: a crash's come after the flood
        with self._reads:
            handed = self._queued
            if not self._reads.wait_for(lambda: self._done >= handed, LAST_LINES_S):
                _say(f"{handed - self._done} reads of the command's output not judged within {LAST_LINES_S:g} s")

    def _pump(self, out: IO[bytes], dst: int) -> None:
        writable = True
        unjudged = b""  # the last read, when it was skipped over the budget
        while chunk := _read(out.fileno()):
            view = memoryview(chunk)
            while writable and view:  # the job's own output first, whole
                try:
                    view = view[os.write(dst, view) :]
                except InterruptedError:
                    continue
                except OSError:
                    writable = False  # our own stdout is gone: keep reading, so the job is never blocked
            gap = self._gap[dst]
            if self._spend(len(chunk)) and self._put(dst, chunk):
                unjudged = b""
            else:  # over the budget, or the judge behind with a full queue
                self._skip(dst, len(chunk), mid_line=not chunk.endswith(b"\n"))
                unjudged, gap_before = chunk, gap
            if len(chunk) < READ_BYTES // 4:
                # A job printing steadily: let a few milliseconds of its output gather in the pipe (which holds
                # PIPE_BYTES), so that it is copied in a few large reads a second, not thousands of small ones.
                time.sleep(COALESCE_S)
        if unjudged:  # the command's last lines (a crash's after a flood): judged whatever the budget
            self.skipped -= len(unjudged)
            self._gap[dst] = gap_before
            self._spend(len(unjudged), force=True)
            self._put(dst, unjudged, wait_s=LAST_LINES_S)
        with contextlib.suppress(OSError):
            out.close()  # through its file object, which would otherwise close the number again, reused by then

    def _spend(self, n: int, force: bool = False) -> bool:
        """Take `n` bytes from the judge's budget (True), or nothing when it is spent (False); `force`
        takes them whatever is left."""
        now = time.monotonic()
        with self._budget_lock:
            if not force and not self._budget.has(now):
                return False
            self._budget.spend(now, n)
            return True

    def _put(self, stream: int, chunk: bytes, wait_s: float = 0.0) -> bool:
        """Hand a read to the judge, with the gap before it (True), or not when the queue is full (False: the
        caller skips it). `wait_s`: how long to wait for room (the command's last lines)."""
        try:
            self._queue.put((stream, chunk, self._gap[stream]), block=wait_s > 0, timeout=wait_s or None)
        except queue.Full:
            return False
        with self._reads:
            self._queued += 1
        self._gap[stream] = None
        return True

    def _skip(self, stream: int, n: int, mid_line: bool) -> None:
        """`n` bytes of `stream` are not judged (counted): the line they cut is dropped, and the next read handed
        to the judge is read from its first newline on when they ended inside a line (`LineCutter.lost`)."""
        self.skipped += n
        self._gap[stream] = mid_line

    def _judge(self) -> None:
        try:
            from fleetheal.logparse import APPLICATION, LineCutter, load_parser  # here: the command starts first

            parser = load_parser(log=APPLICATION)
        except Exception as exc:  # the rules cannot load: the job runs on, unwatched
            _say(f"job output not watched: cannot load the log rules: {exc}")
            while True:
                self._queue.get()
                self._read_done()
        cutters = {1: LineCutter(), 2: LineCutter()}
        while True:
            stream, chunk, gap = self._queue.get()
            try:
                if gap is not None:  # output not seen before this read
                    cutters[stream].lost(mid_line=gap)
                self._lines(parser, cutters[stream].feed(chunk.decode("utf-8", errors="replace")))
            finally:
                self._read_done()

    def _read_done(self) -> None:
        with self._reads:
            self._done += 1
            self._reads.notify_all()

    def _lines(self, parser: LogParser, whole: str) -> None:
        """Judge whole lines of the command's output, at most JUDGED_PER_S of those a rule may match."""
        from fleetheal.logparse import judged_lines  # loaded by then (`_judge`)

        candidates = list(judged_lines(whole, parser.may_match))
        for i, line in enumerate(candidates):
            if not self._judged.take(time.monotonic()):
                self.skipped_lines += len(candidates) - i
                return
            if any(e.known for e in parser.parse_line(line)):
                self._send(line)

    def _send(self, line: str) -> None:
        now = time.monotonic()
        # A line not sent costs no budget; one the agent did not take puts the next try SEND_BACKOFF_S away.
        if now < self._next_try or not self._sends.has(now):
            return
        if self.reporter.line(line, self.run(), self.requeues):
            self._sends.take(now)
            self.sent += 1
        else:
            self._next_try = time.monotonic() + SEND_BACKOFF_S


class _Tail:
    """Reads back a file the command writes (the launcher's own stdout or stderr, inherited): from where it
    ended when the launcher started, every TAIL_S, within the watch's byte budget. Output written faster is
    skipped (counted), never held: the command writes the file itself. Opened through /proc/self/fd, the
    launcher's own open file, never a path."""

    def __init__(self, watch: OutputWatch, stream: int) -> None:
        self.watch = watch
        self.stream = stream
        self.fd = os.open(f"/proc/self/fd/{stream}", os.O_RDONLY | os.O_CLOEXEC)
        self.pos = os.fstat(self.fd).st_size
        #: Where the last read handed to the judge ended: what lies between it and `pos` was skipped.
        self.judged = self.pos
        self._lock = threading.Lock()

    def run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.poll()
            time.sleep(TAIL_S)

    def poll(self, final: bool = False) -> None:
        """Hand what the file gained to the judge; `final`: the command ended, its last READ_BYTES are judged
        whatever the budget."""
        with self._lock:
            size = os.fstat(self.fd).st_size
            if size < self.pos:  # truncated: from its new end
                self.pos = self.judged = size
                self.watch._skip(self.stream, 0, self._mid_line(size))
            if final and self.pos > (start := max(self.judged, size - READ_BYTES)):
                # Skipped over the budget, maybe just after the command ended, by the last ordinary poll: the
                # last lines (a crash's) are read again, from where the judge left off if that is near.
                self.watch.skipped -= self.pos - start
                self.watch._gap[self.stream] = None if start == self.judged else self._mid_line(start)
                self.pos = start
            while self.pos < size:
                if final and size - self.pos > READ_BYTES:
                    self._skip(size - READ_BYTES)  # the last lines first
                    continue
                n = min(size - self.pos, READ_BYTES)
                if not self.watch._spend(n, force=final):
                    self._skip(size)
                    return
                chunk = os.pread(self.fd, n, self.pos)
                if not chunk:
                    return
                self.pos += len(chunk)
                if self.watch._put(self.stream, chunk, wait_s=LAST_LINES_S if final else 0.0):
                    self.judged = self.pos
                else:  # the judge is behind: skipped like output over the budget
                    self.watch._skip(self.stream, len(chunk), self._mid_line(self.pos))

    def _skip(self, to: int) -> None:
        self.watch._skip(self.stream, to - self.pos, self._mid_line(to))
        self.pos = to

    def _mid_line(self, offset: int) -> bool:
        """Whether the file's byte before `offset` is inside a line (not a newline)."""
        return offset > 0 and os.pread(self.fd, 1, offset - 1) != b"\n"


def _read(fd: int) -> bytes:
    while True:
        try:
            return os.read(fd, READ_BYTES)
        except InterruptedError:
            continue
        except OSError:
            return b""


def is_batch_script(ppid: int | None = None) -> bool:
    """True when this process is the batch step's script (its parent is slurmstepd)."""
    try:
        return Path(f"/proc/{ppid or os.getppid()}/comm").read_text().strip() == "slurmstepd"
    except OSError:
        return False


class Launcher:
    def __init__(
        self, cmd: list[str], *, stop_timeout: float, job: str | None, nodes: int | None = None, watch: bool = True
    ) -> None:
        self.cmd = cmd
        self.stop_timeout = stop_timeout
        self.job = job
        self.nodes = nodes
        self.shrink = ""
        self.allocation: dict[str, str] = {}
        self.child: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.handled: set[str] = set()
        self._sent_at_start = 0
        self._told_at_start = ""
        self.pending_restart = False
        self.incident = ""
        self.watch = OutputWatch(job, lambda: self.restarts) if watch and job else None

    # --- the job's comment ---------------------------------------------------------------------------

    def tag_job(self) -> bool:
        if self.job is None:
            _say("not in a Slurm job (no SLURM_JOB_ID): running the command once, no restart in place")
            return False
        if not is_batch_script():
            _say(
                "not the batch script itself (its parent is not slurmstepd): run it as "
                "`exec fleetheal launch -- ...`; running the command without restart in place"
            )
            return False
        comment = job_comment(_SLURM, self.job)
        if comment is None:
            _say(f"cannot read job {self.job}'s comment (squeue failed): no restart in place")
            return False
        words = comment.split()
        for known in (_ORDER.search(comment), _INCIDENT.search(comment)):
            if known:
                self.handled.add(known.group(1))  # an incident of an earlier run of this job, handled by it
        wanted = [TAG]
        if self.nodes is not None:
            allocated = int(os.environ.get("SLURM_JOB_NUM_NODES") or 0)
            if allocated and self.nodes > allocated:
                _say(f"--nodes {self.nodes} is more than the job's {allocated} nodes: no spare nodes")
                self.nodes = None
            else:
                wanted.append(f"{NODES_WORD}{self.nodes}")
        if any(w not in words for w in wanted):
            new = " ".join([*[w for w in words if w != TAG and not w.startswith(NODES_WORD)], *wanted])
            out = _SLURM.completed("scontrol", "update", f"jobid={self.job}", f"comment={new}")
            if out.returncode != 0:
                _say(f"cannot mark job {self.job} ({out.stderr.strip()}): no restart in place")
                return False
        return True

    # --- signals -------------------------------------------------------------------------------------

    def _on_restart(self, signum: int, frame: FrameType | None) -> None:
        self.pending_restart = True

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signum)

    def _wanted(self, *, quiet: bool = False, comment: str | None = None) -> bool:
        """Restart for an incident not handled yet, or for a SIGUSR2 with no incident (the owner's).
        `quiet`: asked because the command failed, not because of an order: no incident, no restart.
        `comment`: the job's comment as just read (default: read it now)."""
        if comment is None:
            comment = job_comment(_SLURM, self.job) if self.job else ""
        match = _ORDER.search(comment or "")
        if match is None:
            self.incident = ""
            self.shrink = ""
            return not quiet
        if match.group(1) in self.handled:
            if not quiet:
                _say(f"restart for incident {match.group(1)} was done already: ignored")
            return False
        self.incident = match.group(1)
        self.handled.add(self.incident)
        self.shrink = word_value(comment or "", SHRINK_WORD) or ""
        return True

    def _wait_shrink(self) -> None:
        """Wait until the node the order names has left the allocation, then take the allocation's
        node list and count into the command's environment."""
        if not (self.shrink and self.job):
            return
        deadline = time.monotonic() + SHRINK_WAIT_S
        # Listed for that node while it is still allocated to the job; an error (squeue down) is no answer.
        while one_job(_SLURM, self.job, "%i", "--nodelist", self.shrink) != "":
            if time.monotonic() > deadline:
                _say(f"{self.shrink} is still in the allocation after {SHRINK_WAIT_S:g} s: starting on it")
                break
            time.sleep(0.1)
        allocation = job_allocation(_SLURM, self.job)
        if allocation is not None:
            count, nodelist = allocation
            self.allocation = {
                "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NODELIST": nodelist,
                "SLURM_JOB_NUM_NODES": count,
                "SLURM_NNODES": count,
            }

    # --- the child -----------------------------------------------------------------------------------

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ, FLEETHEAL_LAUNCH_RESTARTS=str(self.restarts))
        if self.nodes is not None:
            env[NODES_ENV] = str(self.nodes)  # the nodes the command is to use; the rest are spares
        if self.allocation:
            env.update(self.allocation)
            for name in _RESIZED_ENV:
                env.pop(name, None)
        if self.incident:
            env["FLEETHEAL_INCIDENT"] = self.incident
        out, err = self.watch.streams() if self.watch is not None else (None, None)
        if self.watch is not None and self.job:
            # What this run's failure is measured against: flagged lines sent, the incident its comment names.
            self._sent_at_start = self.watch.sent
            told = _INCIDENT.search(job_comment(_SLURM, self.job) or "")
            self._told_at_start = told.group(1) if told else ""
        child = subprocess.Popen(self.cmd, env=env, start_new_session=True, stdout=out, stderr=err)
        if self.watch is not None:
            self.watch.follow(child)
        return child

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            _say(f"command still running {self.stop_timeout:g} s after SIGTERM: SIGKILL")
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        # What is left of its group (a rank that ignored SIGTERM) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    def run(self, restartable: bool) -> int:
        if restartable:
            signal.signal(RESTART_SIGNAL, self._on_restart)
        for signum in _FORWARDED:
            signal.signal(signum, self._forward)
        try:
            self.child = self._start()
        except OSError as exc:
            _say(f"cannot start {self.cmd[0]}: {exc}")
            return 127
        while True:
            code = self.child.poll()
            # A shrink kills the step's tasks on the node it removes, so the command may fail before the
            # order arrives; the incident is in the comment before either.
            failed_by_order = restartable and code not in (None, 0) and self._wanted(quiet=True)
            if self.pending_restart or failed_by_order:
                self.pending_restart = False
                if failed_by_order or self._wanted():
                    self._restart()
                continue
            if code is not None:
                if self.watch is not None:
                    self.watch.drain()
                if restartable and code != 0 and self._await_order():
                    self._restart()
                    continue
                return code if code >= 0 else 128 - code
            time.sleep(0.05)

    def _restart(self) -> None:
        """Carry out the order `_wanted` accepted: stop CMD, wait for the shrink it names, start CMD again."""
        t0 = time.monotonic()
        self._stop_child()
        self._wait_shrink()
        self.restarts += 1
        why = f" for incident {self.incident}" if self.incident else ""
        if self.shrink:
            why += f", {self.shrink} shrunk away (now {self.allocation.get('SLURM_JOB_NODELIST', '?')})"
        self.child = self._start()
        took = time.monotonic() - t0
        _say(f"restart {self.restarts}{why}: command stopped and started again in {took:.2f} s")

    def _await_order(self) -> bool:
        """CMD failed. When it printed a line the rules flag in this run, fleetheal is deciding what to do:
        wait up to ORDER_WAIT_S for its order (True: an order came, `_wanted` took it), or for its refusal
        (a new incident in the comment without an order), and give up after that."""
        if self.watch is None or self.watch.sent == self._sent_at_start or not self.job:
            return False
        _say(f"command failed after printing a fault line: waiting up to {ORDER_WAIT_S:g} s for fleetheal's order")
        deadline = time.monotonic() + ORDER_WAIT_S
        while time.monotonic() < deadline:
            comment = job_comment(_SLURM, self.job) or ""  # one read: an order is written in one update
            if self.pending_restart:  # the order's signal (or the owner's SIGUSR2)
                self.pending_restart = False
                if self._wanted(comment=comment):
                    return True
            elif self._wanted(quiet=True, comment=comment):  # the order, before its signal
                return True
            told = _INCIDENT.search(comment)
            if told and told.group(1) not in self.handled and told.group(1) != self._told_at_start:
                _say(f"fleetheal does not restart it (incident {told.group(1)}, see the job's comment)")
                return False
            time.sleep(0.2)
        _say(f"no order from fleetheal within {ORDER_WAIT_S:g} s")
        return False


def launch(cmd: list[str], *, stop_timeout: float = 60.0, nodes: int | None = None, watch: bool = True) -> int:
    job = os.environ.get("SLURM_JOB_ID")
    launcher = Launcher(cmd, stop_timeout=stop_timeout, job=job, nodes=nodes, watch=watch)
    return launcher.run(launcher.tag_job())


def register(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training command so that fleetheal can restart it in place, inside its allocation",
        description="Run CMD; on fleetheal's restart order (SIGUSR2 to the batch step) stop it and run it "
        "again in the same allocation. Every other signal is passed on to CMD.",
        epilog="example (last line of the sbatch script): exec fleetheal launch -- srun python train.py",
    )
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds from SIGTERM to SIGKILL on a restart")
    p.add_argument(
        "--nodes",
        type=int,
        help="nodes the command needs; the rest of the allocation are spares, and a failed node is shrunk "
        "away from the job (no requeue) while enough remain",
    )
    p.add_argument(
        "--no-watch",
        dest="watch",
        action="store_false",
        help="do not look at the command's output for faults (it is then passed on untouched, without pipes)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetheal.errors import UsageError

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("launch needs a command: fleetheal launch -- CMD [ARGS...]")
    if args.stop_timeout <= 0:
        raise UsageError("--stop-timeout must be > 0")
    if args.nodes is not None and args.nodes < 1:
        raise UsageError("--nodes must be >= 1")
    return launch(cmd, stop_timeout=args.stop_timeout, nodes=args.nodes, watch=args.watch)
