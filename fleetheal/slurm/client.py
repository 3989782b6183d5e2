"""`Client`: Slurm's commands shared by concurrent callers, for the remediator's steps (a storm's first
responses): one read of the nodes or the jobs serves every caller waiting for it (`Shared`), and the
`scontrol` and `scancel` commands submitted meanwhile go to Slurm as one (`Batched`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fleetheal.slurm import jobs, nodes
from fleetheal.slurm.runner import Runner, SlurmError


class Shared:
    """Concurrent calls share one read: a call waits for the next read to start (which its first waiter
    runs), so a caller always sees at least its own earlier writes, and a storm of N first responses
    costs about two reads, not N. A caller that only needs a read taken after a moment of its own
    (`since`, wall clock: a first response needs one taken after its alert arrived) also takes the last
    read or the one in flight when either started after that moment."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self._fetch = fetch
        self._cond = threading.Condition()
        self._running: Future[Any] | None = None  # the read in flight
        self._claimed = False  # whether a caller is running it
        self._running_since = 0.0  # when (wall clock) the read in flight started
        self._next: Future[Any] | None = None  # the read that callers arriving now wait for
        self._last: tuple[float, Any] | None = None  # (when it started, wall clock; its result)

    def get(self, since: float | None = None) -> tuple[float, Any]:
        """(when the read started, on the monotonic clock; what it read)."""
        with self._cond:
            if since is not None and self._last is not None and self._last[0] >= since:
                return self._last[1]  # type: ignore[no-any-return]
            if since is not None and self._claimed and self._running is not None and self._running_since >= since:
                fut = self._running
                while not fut.done():
                    self._cond.wait()
                return fut.result()  # type: ignore[no-any-return]
            if self._running is None:
                fut = self._running = Future()
            else:
                fut = self._next = self._next or Future()
                while not fut.done() and (self._running is not fut or self._claimed):
                    self._cond.wait()
                if fut.done():
                    return fut.result()  # type: ignore[no-any-return]
            self._claimed = True
            self._running_since = wall = time.time()
        started = time.monotonic()
        try:
            fut.set_result((started, self._fetch()))
        except BaseException as exc:
            fut.set_exception(exc)
        finally:
            with self._cond:
                if not fut.exception():
                    self._last = (wall, fut.result())
                self._running, self._next, self._claimed = self._next, None, False
                self._cond.notify_all()
        return fut.result()  # type: ignore[no-any-return]


class Batched:
    """Concurrent commands go to Slurm together: what is submitted while a batch runs becomes the next
    batch, run by one of its submitters (a caller never runs a batch after the one holding its command).
    `run_batch` takes the items and returns one error (or None) each."""

    def __init__(
        self, run_batch: Callable[[list[Any]], list[Exception | None]], error: type[Exception] = SlurmError
    ) -> None:
        self._run_batch = run_batch
        self._error = error
        self._cond = threading.Condition()
        self._busy = False
        self._pending: list[tuple[Any, Future[None]]] = []

    def submit(self, item: Any) -> None:
        fut: Future[None] = Future()
        with self._cond:
            self._pending.append((item, fut))
            while self._busy and not fut.done():
                self._cond.wait()
            if fut.done():
                return fut.result()
            self._busy = True
            batch, self._pending = self._pending, []
        try:
            try:
                errors = self._run_batch([i for i, _ in batch])
            except Exception as exc:
                errors = [exc] * len(batch)
            for (_, done), error in zip(batch, errors, strict=True):
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
        finally:
            for _, done in batch:  # interrupted: nobody waits forever
                if not done.done():
                    done.set_exception(self._error("interrupted while the command ran"))
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return fut.result()


def scontrol_word(arg: str, error: type[Exception] = SlurmError) -> str:
    """One argument as scontrol's command reader splits a line: quoted when it holds a blank."""
    if '"' in arg or "\n" in arg:
        raise error(f"scontrol argument {arg!r} holds a quote or a newline")
    if " " not in arg and "\t" not in arg:
        return arg
    key, sep, value = arg.partition("=")
    return f'{key}="{value}"' if sep else f'"{arg}"'


def stdin_safe(cmd: Sequence[str]) -> bool:
    """Whether scontrol reading `cmd` from its input stores what argv would: it keeps the quotes around a
    value with a blank (a comment would read '"a b"', and its words would not match), but for a reason."""
    return all((" " not in a and "\t" not in a) or a.lower().startswith("reason=") for a in cmd)


class Client:
    """Slurm's commands through one `Runner`, shared by concurrent callers (the first responder's threads):
    `sinfo()` and `squeue()` share reads (`Shared`), and `scontrol()` and `scancel_signal()` send what is
    submitted at the same time as one command (`scontrol` reading its commands from stdin, one `scancel`
    per signal). Its errors are the runner's `error`."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._sinfo = Shared(lambda: nodes.parse_text(self.run("sinfo", *nodes.NODES_ARGS)))
        self._squeue = Shared(lambda: jobs.document(self.run("squeue", "--json")))
        self._scontrol = Batched(self._scontrol_batch, runner.error)
        self._scancel = Batched(self._scancel_batch, runner.error)

    def run(self, command: str, *args: str, stdin: str | None = None, retries: int | None = None) -> str:
        """`Runner.checked`: the output, or the runner's error after its retries."""
        return self.runner.checked(command, *args, stdin=stdin, retries=retries)

    def sinfo(self) -> nodes.Nodes:
        return self.sinfo_at()[1]

    def sinfo_at(self, since: float | None = None) -> tuple[float, nodes.Nodes]:
        """Every node (`fleetheal.slurm.nodes`) and when (monotonic) the read started; `since`: see `Shared`."""
        return self._sinfo.get(since)

    def squeue(self, since: float | None = None) -> dict[str, Any]:
        return self._squeue.get(since)[1]  # type: ignore[no-any-return]

    def scontrol(self, *args: str) -> None:
        """One scontrol command (`update ...`, `requeue ...`), sent with the others submitted meanwhile.
        Checked before it joins a batch: a newline in a value would be a second command in scontrol's input,
        and a refused command must fail for its caller only."""
        self.scontrol_seq([tuple(args)])

    def scontrol_seq(self, commands: Sequence[Sequence[str]]) -> None:
        """Commands that must run in this order (a requeue, then the update of the pending job), sent in
        one batch: a storm's requeues then wait for one batch of scontrol, not two."""
        cmds = tuple(tuple(c) for c in commands)
        for cmd in cmds:
            for arg in cmd:
                scontrol_word(arg, self.runner.error)
        self._scontrol.submit(cmds)

    def scancel_signal(self, signal: str, job_ids: Sequence[str]) -> None:
        """`scancel --batch --signal=SIGNAL` to `job_ids`, with the other jobs signalled meanwhile."""
        self._scancel.submit((signal, tuple(job_ids)))

    def _scontrol_batch(self, batch: list[tuple[tuple[str, ...], ...]]) -> list[Exception | None]:
        """Each caller's commands in order: the leading ones scontrol can read from its input go to one
        scontrol together; the rest (a value with a blank, which scontrol reading its input would store
        with its quotes, but for a reason) then run on their own, concurrently across callers."""
        heads: list[tuple[tuple[str, ...], ...]] = []
        tails: list[tuple[tuple[str, ...], ...]] = []
        for cmds in batch:
            n = next((i for i, cmd in enumerate(cmds) if not stdin_safe(cmd)), len(cmds))
            heads.append(cmds[:n])
            tails.append(cmds[n:])
        errors = self._scontrol_script(heads)
        todo = [i for i, tail in enumerate(tails) if tail and errors[i] is None]
        if len(todo) == 1:
            errors[todo[0]] = _error_of(self._scontrol_again, tails[todo[0]])
        elif todo:
            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                for i, error in zip(
                    todo, pool.map(lambda i: _error_of(self._scontrol_again, tails[i]), todo), strict=True
                ):
                    errors[i] = error
        return errors

    def _scontrol_script(self, heads: list[tuple[tuple[str, ...], ...]]) -> list[Exception | None]:
        lines = [cmd for head in heads for cmd in head]
        if len(lines) <= 1:
            error = _error_of(self.run, "scontrol", *lines[0]) if lines else None
            return [error if head else None for head in heads]
        script = "".join(" ".join(scontrol_word(a, self.runner.error) for a in cmd) + "\n" for cmd in lines)
        if _error_of(self.run, "scontrol", stdin=script + "quit\n", retries=0) is None:
            return [None] * len(heads)
        # Which line failed is not told: each caller's commands again on their own, in order. They are
        # idempotent, but for a requeue, which finds its jobs requeued by the batch already ("pending").
        return [_error_of(self._scontrol_again, head) if head else None for head in heads]

    def _scontrol_again(self, cmds: tuple[tuple[str, ...], ...]) -> None:
        for cmd in cmds:
            try:
                self.run("scontrol", *cmd)
            except self.runner.error as exc:
                if cmd[0] != "requeue" or "pending" not in str(exc).lower():
                    raise

    def _scancel_batch(self, items: list[tuple[str, tuple[str, ...]]]) -> list[Exception | None]:
        errors: list[Exception | None] = [None] * len(items)
        for signal in dict.fromkeys(sig for sig, _ in items):
            mine = [i for i, (sig, _) in enumerate(items) if sig == signal]
            ids = list(dict.fromkeys(j for i in mine for j in items[i][1]))
            flag = f"--signal={signal}"
            if _error_of(self.run, "scancel", "--batch", flag, *ids, retries=0) is not None:
                for i in mine:  # which job failed is not told: each caller's jobs on their own
                    errors[i] = _error_of(self.run, "scancel", "--batch", flag, *items[i][1])
        return errors


def _error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Exception | None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None
