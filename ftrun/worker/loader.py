"""The data loader behind `ft.loader(...)`: a step's global batch as a pure function of
(seed, step), split by the live membership, read ahead in reader processes.

Owns: the epoch-seeded index order (drop_last), a micro-batch's share for (rank, world size)
cut exactly as `batch_slice` cuts it, collation, and a few forked reader processes that read
the next micro-batches ahead and never outlive the training process.
Nothing here needs checkpointing: a batch depends only on the constructor's arguments, the
step and the membership, so a repeated step or a changed membership just asks again, and a
healed replacement needs nothing but its step. That is also what makes a committed step
consume its global batch exactly once, whatever faults, shrinks and grows came before it.
Must not import: typer, rich, NVML, psutil, the agent, worker.api. Torch is imported at use.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import operator
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.core.timeouts import LOADER_CLOSE_S, LOADER_PARENT_POLL_S, LOADER_RESULT_S

Key = tuple[int, int, int, int, int]  # (step, micro, accum, rank, world_size)
Membership = Callable[[], tuple[int, int, int]]  # live (rank, world_size, generation)

_PR_SET_PDEATHSIG = 1
try:  # resolved in the parent: dlopen in a child forked from a threaded process can deadlock
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def dist_membership() -> tuple[int, int, int]:
    """Outside ftrun: torch.distributed's rank and world size, or a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), 0
    return 0, 1, 0


def share(n: int, rank: int, world_size: int) -> slice:
    """Contiguous shares of n items; the first n % world_size ranks get one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def read_items(dataset: Any, indices: Sequence[int]) -> Any:
    from torch.utils.data import default_collate

    return default_collate([dataset[i] for i in indices])


def _int(name: str, value: Any, low: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise WorkerApiError(f"ft.loader: {name} must be an integer, not {value!r}") from None
    if number < low:
        raise WorkerApiError(f"ft.loader: {name} must be >= {low}, not {number}")
    return number


def _mix(seed: int, epoch: int) -> int:
    """One generator seed per (seed, epoch); neighbouring seeds give unrelated orders."""
    return (seed * 6364136223846793005 + epoch * 1442695040888963407 + 1) % 2**63


class Loader:
    """`batch(step, micro, accum)`: this rank's part of micro-batch `micro` of step `step`."""

    def __init__(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, num_workers: int = 0, membership: Membership | None = None,
                 prefetch: int | None = None) -> None:
        try:
            length = len(dataset)
        except TypeError:
            raise WorkerApiError("ft.loader needs a dataset with len() and [index]",
                                 hint="a map-style dataset, like torch's Dataset") from None
        self.global_batch_size = _int("global_batch_size", global_batch_size, 1)
        if length < self.global_batch_size:
            raise WorkerApiError(
                f"ft.loader: the dataset has {length} items, fewer than one global batch "
                f"of {self.global_batch_size}", hint="use a smaller global_batch_size")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _int("seed", seed, -(2**62))
        self.num_workers = _int("num_workers", num_workers, 0)
        self.prefetch = None if prefetch is None else _int("prefetch", prefetch, 1)
        self.steps_per_epoch = length // self.global_batch_size  # drop_last
        self._length = length
        self._membership = membership or dist_membership
        self._orders: dict[int, Any] = {}
        self.stats = {"read_ahead": 0, "read_here": 0, "discarded": 0}
        self._readers: _Readers | None = None
        if self.num_workers:
            self._readers = _Readers(dataset, self.num_workers)
            # a loader dropped without close() still takes its readers with it
            self._finalizer = weakref.finalize(self, self._readers.close)

    # ------------------------------------------------------------- pure index maps
    def epoch_of(self, step: int) -> int:
        return _int("step", step, 0) // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """The global batch of `step`: a fixed list of dataset indices."""
        epoch, pos = divmod(_int("step", step, 0), self.steps_per_epoch)
        lo, hi = pos * self.global_batch_size, (pos + 1) * self.global_batch_size
        if not self.shuffle:
            return list(range(lo, hi))
        order: list[int] = self._order(epoch)[lo:hi].tolist()
        return order

    def share_of(self, step: int, micro: int, accum: int, rank: int,
                 world_size: int) -> list[int]:
        """Indices rank `rank` of `world_size` reads for micro-batch `micro` of `accum`."""
        accum = _int("accum", accum, 1)
        if self.global_batch_size % accum:
            raise WorkerApiError(
                f"ft.loader: accum={accum} does not divide global_batch_size="
                f"{self.global_batch_size}", hint="pick accum among its divisors")
        micro = _int("micro", micro, 0)
        if micro >= accum:
            raise WorkerApiError(f"ft.loader: micro={micro} is out of range for accum={accum}",
                                 hint="micro runs from 0 to accum - 1")
        size = self.global_batch_size // accum
        if not 0 <= rank < world_size:
            raise WorkerApiError(f"ft.loader: membership gave rank {rank} of {world_size}")
        if size < world_size:
            raise WorkerApiError(
                f"ft.loader: a micro-batch of {size} items leaves some of {world_size} ranks "
                "with none", hint="use global_batch_size >= accum * world_size")
        mine = share(size, rank, world_size)
        start = micro * size
        return self.indices(step)[start + mine.start:start + mine.stop]

    def _order(self, epoch: int) -> Any:
        order = self._orders.get(epoch)
        if order is None:
            import torch

            gen = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self._length, generator=gen)
            if len(self._orders) >= 2:  # this epoch and the one read ahead into
                del self._orders[max(self._orders, key=lambda e: abs(e - epoch))]
            self._orders[epoch] = order
        return order

    # ------------------------------------------------------------------ reading
    def batch(self, step: int, micro: int = 0, accum: int = 1) -> Any:
        """This rank's part of micro-batch `micro` (of `accum`) of step `step`, collated."""
        rank, world_size, _generation = self._membership()
        key: Key = (step, micro, accum, rank, world_size)
        indices = self.share_of(*key)
        readers = self._readers
        if readers is None or not readers.alive():
            self.stats["read_here"] += 1
            return read_items(self.dataset, indices)
        upcoming = self._upcoming(key)
        # a generation change that keeps (rank, world_size) changes no share: only the
        # key decides what is still good
        self.stats["discarded"] += readers.keep(set(upcoming[1]) | {key})
        for ahead in upcoming[0]:
            if not readers.has(ahead):
                readers.submit(ahead, self.share_of(*ahead))
        found, value = readers.take(key)
        if found:
            self.stats["read_ahead"] += 1
            return value
        self.stats["read_here"] += 1
        return read_items(self.dataset, indices)

    def _upcoming(self, key: Key) -> tuple[list[Key], list[Key]]:
        """(micro-batches to read ahead, read-ahead work still worth keeping). Kept: up to a
        step more than is read ahead, so a step repeated after a failure keeps the next one's."""
        step, micro, accum, rank, world_size = key
        depth = self.prefetch or max(accum, self.num_workers)
        here = step * accum + micro
        keys = [(p // accum, p % accum, accum, rank, world_size)
                for p in range(here + 1, here + depth + accum + 1)]
        return keys[:depth], keys

    # ---------------------------------------------------------------- lifecycle
    def worker_pids(self) -> list[int]:
        return list(self._readers.pids) if self._readers is not None else []

    def close(self) -> None:
        """Stop the reader processes (bounded: LOADER_CLOSE_S, then SIGKILL). Idempotent."""
        if self._readers is not None:
            self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Not needed for resuming (a batch is pure in the step); registering the loader
        makes a healed replica check that it reads the same data as its peers."""
        return {"seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "dataset_len": self._length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, mine in self.state_dict().items():
            if state.get(name) != mine:
                raise WorkerApiError(
                    f"ft.loader: {name} is {mine} here but {state.get(name)} on the replica "
                    "this one heals from", hint="build the loader alike on every rank")


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


class _Readers:
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
