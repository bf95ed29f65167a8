"""The reader processes behind `ft.loader(..., num_workers=N)`: forked readers that read a
loader's next micro-batches ahead and never outlive the training process.

Owns: `Readers` (the processes, their pipes, which work each holds, results taken by key,
a lost reader's work read in the training process instead, a bounded close), what a reader
process runs, the collation of a micro-batch (`read_items`, also used by the loader when it
reads in the training process), and a dataset's exception carried back from a reader with its
traceback (`ReaderTraceback`). What to read ahead, and for which key, is the loader's
(`ftrun.worker.loader`).
Must not import: typer, rich, NVML, psutil, the agent, worker.api, worker.loader. Torch is
imported at use.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.core.timeouts import LOADER_CLOSE_S, LOADER_PARENT_POLL_S, LOADER_RESULT_S

Key = tuple[int, int, int, int, int]  # (step, micro, accum, rank, world_size)

_PR_SET_PDEATHSIG = 1
try:  # resolved in the parent: dlopen in a child forked from a threaded process can deadlock
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def read_items(dataset: Any, indices: Sequence[int]) -> Any:
    from torch.utils.data import default_collate

    return default_collate([dataset[i] for i in indices])


class ReaderTraceback(Exception):
    """A dataset's exception's traceback in its reader process (chained as its cause)."""


def _portable(exc: BaseException) -> tuple[BaseException | None, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return None, text
    return exc, text


def _raise_remote(payload: tuple[BaseException | None, str]) -> None:
    exc, text = payload
    if exc is None:
        exc = RuntimeError(f"a loader reader process failed: {text.strip().splitlines()[-1]}")
    raise exc from ReaderTraceback(text)


class Readers:
    """Reader processes, each answering its tasks in order over its own pipe.

    Forked, as torch's DataLoader does on Linux: a spawned reader would re-import torch (seconds
    on 2 cores) and re-run a script without a __main__ guard. The training process has threads
    (the generation watcher, gloo's) when it forks, so a reader only reads items and collates:
    it touches no lock those threads use (store, process groups, stdio) and runs torch on one
    thread. PR_SET_PDEATHSIG plus a parent check kills readers with the training process.
    """

    def __init__(self, dataset: Any, count: int) -> None:
        self._owner_pid = os.getpid()
        self._procs: list[Any] = []
        self.pids: list[int] = []
        self._conns: list[Connection] = []
        self._live: list[bool] = []
        self._load: list[int] = []
        self._reader_of: dict[int, int] = {}  # task id -> reader, until its answer arrives
        self._by_key: dict[Key, int] = {}  # wanted work -> task id
        self._key_of: dict[int, Key] = {}
        self._done: dict[int, tuple[bool, Any]] = {}
        self._next = 0
        self._closed = False
        ctx = multiprocessing.get_context("fork")
        for i in range(count):
            mine, theirs = ctx.Pipe(duplex=True)
            # each reader closes its copies of all parent ends, so only the parent holds them
            proc = ctx.Process(target=_reader_main, name=f"ftrun-loader-{i}", daemon=True,
                               args=(dataset, theirs, os.getpid(), [*self._conns, mine]))
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self.pids.append(proc.pid or 0)
            self._conns.append(mine)
            self._live.append(True)
            self._load.append(0)

    def alive(self) -> bool:
        return not self._closed and any(self._live)

    def has(self, key: Key) -> bool:
        return key in self._by_key

    def submit(self, key: Key, indices: list[int]) -> None:
        live = [r for r, ok in enumerate(self._live) if ok]
        if not live:
            return
        reader = min(live, key=lambda r: self._load[r])
        tid, self._next = self._next, self._next + 1
        try:  # index lists are small: a full pipe (and so a blocked send) is not a concern
            self._conns[reader].send((tid, indices))
        except OSError:
            self._lost(reader)
            return
        self._load[reader] += 1
        self._reader_of[tid] = reader
        self._by_key[key] = tid
        self._key_of[tid] = key

    def keep(self, wanted: set[Key]) -> int:
        """Forget work not in `wanted` (its answers are dropped on arrival); how much."""
        for reader in range(len(self._procs)):
            self._receive(reader)
        stale = [key for key in self._by_key if key not in wanted]
        for key in stale:
            tid = self._by_key.pop(key)
            del self._key_of[tid]
            self._done.pop(tid, None)
        return len(stale)

    def take(self, key: Key) -> tuple[bool, Any]:
        """(True, batch) once the work for `key` is read; (False, None) if there is none."""
        tid = self._by_key.get(key)
        if tid is None:
            return False, None
        deadline = time.monotonic() + LOADER_RESULT_S
        while tid not in self._done and tid in self._reader_of:
            reader = self._reader_of[tid]
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerApiError(
                    f"ft.loader: a reader process gave no batch within {LOADER_RESULT_S:.0f} s",
                    hint="does dataset[i] hang? num_workers=0 reads in the training process")
            wait([self._conns[reader], self._procs[reader].sentinel], min(left, 1.0))
            self._receive(reader)
        self._by_key.pop(key, None)
        self._key_of.pop(tid, None)
        if tid not in self._done:  # its reader died: the caller reads it
            return False, None
        ok, value = self._done.pop(tid)
        if not ok:
            _raise_remote(value)
        return True, value

    def _receive(self, reader: int) -> None:
        conn = self._conns[reader]
        if not self._live[reader]:
            return
        try:
            while conn.poll():
                tid, ok, value = conn.recv()
                self._load[reader] -= 1
                del self._reader_of[tid]
                if tid in self._key_of:
                    self._done[tid] = (ok, value)
        except (OSError, EOFError):
            self._lost(reader)
            return
        if not self._procs[reader].is_alive():  # dead, though something keeps its pipe open
            self._lost(reader)

    def _lost(self, reader: int) -> None:
        """A reader died (killed, out of memory): its work is read in the training process."""
        self._live[reader] = False
        code = _stop(self._procs[reader], time.monotonic() + LOADER_CLOSE_S)
        print(f"ftrun: loader reader process {self.pids[reader]} exited ({code}); its "
              "batches are read in the training process", file=sys.stderr, flush=True)
        for tid in [t for t, r in self._reader_of.items() if r == reader]:
            del self._reader_of[tid]
            self._by_key.pop(self._key_of.pop(tid, (-1, 0, 0, 0, 0)), None)
        with contextlib.suppress(OSError):
            self._conns[reader].close()

    def close(self) -> None:
        if self._closed or os.getpid() != self._owner_pid:  # never from a forked copy
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            # a reader blocked sending a batch gets EPIPE instead of waiting for a reply
            conn.close()
        deadline = time.monotonic() + LOADER_CLOSE_S
        for proc, live in zip(self._procs, self._live, strict=True):
            if live:  # a lost reader was stopped already
                _stop(proc, deadline)


def _stop(proc: Any, deadline: float) -> int | None:
    """Join a reader until `deadline`, then SIGKILL it; reaped either way. Its exit code."""
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join(LOADER_CLOSE_S)
    code: int | None = proc.exitcode
    if code is not None:
        proc.close()
    return code


def _reader_main(dataset: Any, conn: Connection, parent: int,
                 inherited: list[Connection]) -> None:
    """A reader process: answers (task id, indices) with the collated items, in order."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the training process died before prctl took effect
        return
    for other in inherited:
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch

    torch.set_num_threads(1)  # readers must not compete with training for the cores
    while True:
        try:
            if not conn.poll(LOADER_PARENT_POLL_S):
                if os.getppid() != parent:
                    return
                continue
            task = conn.recv()
        except (OSError, EOFError):
            return
        if task is None:
            return
        tid, indices = task
        try:
            reply = (tid, True, read_items(dataset, indices))
        except Exception as exc:
            reply = (tid, False, _portable(exc))
        try:
            conn.send(reply)
        except OSError:
            return
        except Exception as exc:  # the batch does not pickle
            conn.send((tid, False, _portable(exc)))
