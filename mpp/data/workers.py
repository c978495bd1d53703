"""Supervision of DataLoader workers: where each one is, and what a dead one was doing.

Each worker writes its pid, the shard it reads and the sample it decodes into shared memory
(Whereabouts, through its Trail). When a worker dies (the out-of-memory killer, a crash in a
decoder, a stop signal sent to the whole process group), the main process reads that memory
and raises an error naming the shard and sample, or RunStopped for a stopped run.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import NamedTuple, TypeVar

from mpp.errors import STOP_SIGNALS, RunStopped, raised_in_worker, stop_signal
from mpp.secrets import redact

T = TypeVar("T")

# Shared by both sides: the memory the main process creates and the workers write into.


class Position(NamedTuple):
    """Where one DataLoader worker was: pid 0 if it never wrote; `stopped_by` the stopping signal
    (SIGTERM, SIGINT, SIGHUP) it received, 0 if none."""

    worker: int
    pid: int
    shard: str
    sample: str
    stopped_by: int = 0

    def describe(self) -> str:
        where = f"reading shard {self.shard}" if self.shard else "before it opened a shard"
        doing = f", decoding sample {self.sample}" if self.sample else ""
        return f"worker {self.worker} (pid {self.pid}) {where}{doing}"


class Whereabouts:
    """Each DataLoader worker's pid, the shard it reads and the sample it decodes, in shared memory.

    The main process creates it before the workers start (forked workers inherit it, spawned
    ones receive it as they start), so it can still be read after a worker is killed by a
    signal (the OOM killer, a crash in a decoder). Each worker writes only its own slot.
    """

    SLOT = 4096  # bytes per worker: room for long signed URLs

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.memory = multiprocessing.RawArray(ctypes.c_char, workers * self.SLOT)

    def write(self, worker: int, shard: str, sample: str, stopped_by: int = 0) -> None:
        # Cut by bytes so the fields fit one slot; a character cut in half reads as U+FFFD.
        fields = [
            str(os.getpid()).encode(),
            shard.encode("utf-8", "replace")[:2560],
            sample.encode("utf-8", "replace")[:1500],
            str(stopped_by).encode(),
        ]
        data = b"\0".join(fields) + b"\0"
        start = worker * self.SLOT
        self.memory[start : start + len(data)] = data  # type: ignore[call-overload]  # a c_char array takes bytes

    def read(self) -> list[Position]:
        positions = []
        for worker in range(self.workers):
            slot: bytes = self.memory[worker * self.SLOT : (worker + 1) * self.SLOT]  # type: ignore[assignment]
            pid, shard, sample, stopped_by = (slot.split(b"\0") + [b"", b"", b""])[:4]
            positions.append(
                Position(
                    worker,
                    int(pid) if pid.isdigit() else 0,
                    shard.decode("utf-8", "replace"),
                    sample.decode("utf-8", "replace"),
                    int(stopped_by) if stopped_by.isdigit() else 0,
                )
            )
        return positions


# In a worker: its writer into that memory.


class Trail:
    """One worker's writer into Whereabouts (a no-op without workers: a death there ends the process)."""

    def __init__(self, whereabouts: Whereabouts | None, worker: int) -> None:
        self.whereabouts, self.worker = whereabouts, worker
        self.shard = self.sample = ""

    def reading(self, url: str) -> None:
        self.shard = url
        if self.whereabouts is not None:
            self.whereabouts.write(self.worker, self.shard, self.sample)

    def decoding(self, key: str, url: str) -> None:
        self.sample = key if url == self.shard else f"{key} of shard {url}"
        if self.whereabouts is not None:
            self.whereabouts.write(self.worker, self.shard, self.sample)

    def record_stop_signals(self) -> None:
        """In a worker: note a stopping signal in Whereabouts, then die of it as before. torch's words
        for the death ("exited unexpectedly", where it noticed while waiting for a batch) do not
        always say the signal, and a stopped run is not a crash nor the out-of-memory killer."""
        whereabouts = self.whereabouts
        if whereabouts is None:
            return

        def stopped(signum: int, frame: object) -> None:
            whereabouts.write(self.worker, self.shard, self.sample, stopped_by=signum)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, stopped)


# In the main process: the batches, and an error naming where a dead worker was.


def supervised(start: Callable[[], Iterator[T]], whereabouts: Whereabouts | None) -> Iterator[T]:
    """`start()` (which starts the workers) and its batches; a worker that dies is named by its
    Whereabouts, both where the loader waits for a batch and in torch's SIGCHLD handler."""
    if whereabouts is None:
        return start()
    _watched.add(whereabouts)
    batches = start()
    _watch_worker_deaths()  # after the workers start: torch installs its SIGCHLD handler then
    return _naming_deaths(batches, whereabouts)


class WorkerDiedError(RuntimeError):
    """A DataLoader worker was killed or exited; the message names the shard it was reading."""


def _naming_deaths(batches: Iterator[T], whereabouts: Whereabouts) -> Iterator[T]:
    """The batches; an error met while waiting for one, where a worker has died, names its shard.

    Besides torch's own error, a worker killed just after it queued a batch makes fetching that
    batch fail with an OSError (its tensors are passed through a socket of the dead worker).
    """
    try:
        yield from batches
    except (WorkerDiedError, RunStopped):
        raise
    except (RuntimeError, OSError) as error:
        if raised_in_worker(error):  # the worker's own error, passed on by torch: not a death
            raise
        positions = whereabouts.read()
        dead = _torch_death_pids(error) or _exited({p.pid for p in positions if p.pid})
        if not dead:
            raise
        raise _died(error, positions, dead) from error
    finally:
        _watched.discard(whereabouts)


# The positions of the workers of every loader being iterated, for the SIGCHLD handler below.
_watched: weakref.WeakSet[Whereabouts] = weakref.WeakSet()


def _watch_worker_deaths() -> None:
    """Wrap the SIGCHLD handler torch installs, so that the error for a dead worker names its shard.

    torch raises that error from the handler, in the main thread wherever it is when the signal
    comes: in a training step as often as in the loader, where _naming_deaths cannot see it.
    Signal handlers can only be set from the main thread; elsewhere _naming_deaths remains.
    """
    if not hasattr(signal, "SIGCHLD") or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous) or getattr(previous, "names_dead_workers", False):
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        try:
            previous(signum, frame)
        except RuntimeError as error:
            dead = _torch_death_pids(error)
            if not dead:
                raise
            raise _died(error, [p for w in list(_watched) for p in w.read()], dead) from error

    handler.names_dead_workers = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGCHLD, handler)


def _torch_death_pids(error: BaseException) -> set[int]:
    """The pids in torch's "DataLoader worker (pid N) is killed by signal" / "(pid(s) N, M) exited" errors."""
    match = re.match(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\)", str(error))
    return {int(pid) for pid in match.group(1).split(",")} if match else set()


def _exited(pids: Iterable[int]) -> set[int]:
    """Those of this process's child pids that have exited, without reaping them (torch does that)."""
    if not hasattr(os, "waitid"):
        return set()
    gone = set()
    for pid in pids:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                gone.add(pid)
        except ChildProcessError:  # reaped already
            gone.add(pid)
    return gone


def _died(error: BaseException, positions: list[Position], dead: set[int]) -> WorkerDiedError | RunStopped:
    """The error naming where each dead worker was; torch's words for how it died are kept. A worker
    stopped by SIGTERM, SIGINT or SIGHUP was not killed for memory: the run was asked to stop."""
    cause: BaseException | None = error
    seen = set()
    while cause is not None and id(cause) not in seen:  # the handler's error, below torch's "exited"
        if isinstance(cause, WorkerDiedError):  # a fresh error: raising `cause` from `error` would loop the chain
            return WorkerDiedError(str(cause))
        if isinstance(cause, RunStopped):
            return RunStopped(str(cause), cause.signum)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    known = {p.pid: p.describe() for p in positions}
    where = "; ".join(known.get(pid, f"pid {pid}, which had not opened a shard") for pid in sorted(dead))
    signals = [p.stopped_by for p in positions if p.pid in dead and p.stopped_by]
    signum = stop_signal(str(error)) or (signals[0] if signals else None)
    if signum is not None:  # sent to the whole process group: a scheduler's stop, `kill`, Ctrl-C
        return RunStopped(
            redact(
                f"the run was stopped by {signal.Signals(signum).name}, which also stopped its DataLoader workers "
                f"({where}); resume with --ckpt_path last"
            ),
            signum,
        )
    return WorkerDiedError(
        redact(
            f"a DataLoader worker died: {where}. {type(error).__name__}: {str(error).rstrip()} If it was killed "
            "(often by the out-of-memory killer), use fewer workers or a smaller shuffle_buffer; if it crashed, "
            "try that sample on its own."
        )
    )
