"""This node's worker processes of the current attempt: start, see exit, stop.

Owns: `NodeWorkers`, the list of this node's workers and their ids, starting one (a first
member, a replacement, a spare) with the environment the agent gives it, a selector that sees
an exit the moment it happens (pidfd), recording an exit, and stopping them all (graceful,
then forced). What an exit means is the agent's (and its cluster's) to decide.
Must not import: typer, rich, the CLI or the worker library. Torch never.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import time
from collections.abc import Callable, Iterator

from ftrun.adapters.leftovers import end_group
from ftrun.adapters.procs import Guardian, signal_group
from ftrun.adapters.report import WorkerExit
from ftrun.adapters.wakeup import Wakeup
from ftrun.adapters.workerspec import spawn_error, worker_argv
from ftrun.agent.roster import Worker
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.core import timeouts
from ftrun.core.events import EventSink, ExitFields, SpawnedFields, emit_as
from ftrun.core.exits import EXIT_CORRUPT
from ftrun.core.spec import RunSpec
from ftrun.core.states import WorkerState

# (worker id, rank, local rank, spare, error file) -> the worker's whole environment
EnvFor = Callable[[int, int, int, bool, str], dict[str, str]]


class NodeWorkers:
    def __init__(self, spec: RunSpec, base_env: dict[str, str], starter: WorkerStarter,
                 guardian: Guardian, wakeup: Wakeup, services: RunServices, env_for: EnvFor,
                 emit: EventSink) -> None:
        self.spec = spec
        self.base_env = base_env
        self.starter = starter
        self.guardian = guardian
        self.wakeup = wakeup
        self.services = services
        self.env_for = env_for
        self.emit = emit
        self.all: list[Worker] = []
        self.next_id = spec.nproc
        self.restarts = 0  # the attempt the workers belong to (their log files say it)
        self.on_exit: Callable[[Worker], None] = lambda w: None  # a follower reports it
        self._sel: selectors.BaseSelector | None = None  # while the agent supervises

    def report_exits_to(self, on_exit: Callable[[Worker], None]) -> None:
        """Who is told of each exit as it is recorded: the role the node plays (a follower
        reports it to the coordinator)."""
        self.on_exit = on_exit

    def new_attempt(self, restarts: int, first_id: int) -> None:
        """Ids restart with every attempt; the last attempt's workers are forgotten."""
        self.all, self.next_id, self.restarts = [], first_id, restarts

    def allocate_id(self) -> int:
        """A worker id not used yet in this attempt."""
        self.next_id += 1
        return self.next_id - 1

    def by_id(self, worker_id: int) -> Worker | None:
        return next((w for w in self.all if w.worker_id == worker_id), None)

    def alive(self) -> list[Worker]:
        return [w for w in list(self.all) if w.alive]  # the control thread reads it too

    def spawn(self, worker_id: int, rank: int, local_rank: int, spare: bool = False) -> Worker:
        """Start one worker of the current attempt (a first member, a replacement, a spare)."""
        svc = self.services
        streams = svc.logs.streams_for(self.restarts, local_rank, rank=rank,
                                       worker_id=worker_id if worker_id >= self.spec.nproc
                                       else None)
        env = self.env_for(worker_id, rank, local_rank, spare, streams.error_file)
        svc.slots.reset(worker_id)  # no progress of an earlier attempt's worker
        try:
            spawned = self.starter.start(worker_argv(self.spec, self.base_env, local_rank), env,
                                         streams.stdout, streams.stderr)
        except OSError as exc:
            streams.close()
            raise spawn_error(self.spec, exc) from exc
        streams.after_spawn()
        self.guardian.watch(spawned.pid)
        worker = Worker(rank, local_rank, worker_id, spawned, streams)
        self.all.append(worker)
        # ids a coordinator gave this node are used: if this node coordinates later (etcd),
        # its own allocations start past them
        self.next_id = max(self.next_id, worker_id + 1)
        if self._sel is not None and spawned.pidfd is not None:
            self._sel.register(spawned.pidfd, selectors.EVENT_READ, worker)
        emit_as(self.emit, SpawnedFields(worker_id, rank, local_rank, spawned.pid, spawned.via,
                                         spare, self.starter.zygote_pid(spawned)))
        return worker

    @contextlib.contextmanager
    def watching(self) -> Iterator[selectors.BaseSelector]:
        """A selector on the wakeup pipe and every live worker's pidfd; a worker started
        meanwhile joins it."""
        with self.selector() as sel:
            self._sel = sel
            try:
                yield sel
            finally:
                self._sel = None

    def selector(self) -> selectors.DefaultSelector:
        sel = selectors.DefaultSelector()
        sel.register(self.wakeup.reader, selectors.EVENT_READ, None)
        for w in self.all:
            if w.alive and w.spawned.pidfd is not None:
                sel.register(w.spawned.pidfd, selectors.EVENT_READ, w)
        return sel

    def reap_ready(self, sel: selectors.BaseSelector, timeout: float | None) -> list[Worker]:
        """Block until a worker exits, a signal arrives, or `timeout`; return the exited."""
        polling = any(w.alive and w.spawned.pidfd is None for w in self.all)
        wait = 0.05 if polling and (timeout is None or timeout > 0.05) else timeout
        ready: list[Worker] = []  # pidfds in the order the kernel saw the exits
        for key, _ in sel.select(wait):
            if key.data is None:
                self.wakeup.drain()
            else:
                ready.append(key.data)
        ended = []
        for w in [*ready, *(w for w in self.all if w not in ready)]:
            if w.alive and w.spawned.process.poll() is not None:
                if w.spawned.pidfd is not None:
                    sel.unregister(w.spawned.pidfd)  # before close(): the fd number is reused
                self._record_exit(w)
                ended.append(w)
        self.starter.reap_strays([w.spawned.pid for w in self.all if w.alive], self.guardian.pid)
        return ended

    def _record_exit(self, w: Worker) -> None:
        code = w.spawned.process.returncode
        assert code is not None  # poll() saw the exit
        by_launcher = w.state is WorkerState.STOPPING
        drill = self.services.journal.pending_drill(w.worker_id)
        w.ended(WorkerExit(rank=w.rank, local_rank=w.local_rank, pid=w.spawned.pid,
                           returncode=code, detected_at=time.monotonic(), wall_time=time.time(),
                           error_file=w.streams.error_file, killed_by_launcher=by_launcher,
                           sent_by_ftrun=drill or ""))
        if by_launcher:
            w.move(WorkerState.TERMINATED)
        else:
            w.move(WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED)
        w.spawned.close()
        end_group(w.spawned.pid)  # what it left in its group goes too (a resource tracker last)
        self.guardian.forget(w.spawned.pid)
        emit_as(self.emit, ExitFields(w.rank, w.spawned.pid, code, by_launcher))
        if code == EXIT_CORRUPT and not by_launcher:  # outvoted by its replicas (#53)
            self.services.health.suspect(w.local_rank, f"worker {w.worker_id} held corrupt "
                                         "state on it (silent corruption)")
        self.on_exit(w)

    def kill(self, worker_id: int) -> bool:
        w = self.by_id(worker_id)
        if w is None or not w.alive:
            return False
        signal_group(w.spawned.pid, signal.SIGKILL)
        return True

    def stop(self, sig: int, grace: float) -> int | None:
        """Signal every live worker group, wait `grace`, then SIGKILL. Returns a signal the
        agent received meanwhile (a second Ctrl-C skips the grace), or None."""
        received: int | None = None
        for w in self.all:
            if w.alive:
                w.move(WorkerState.STOPPING)
                signal_group(w.spawned.pid, sig)
        deadline = time.monotonic() + grace
        with self.selector() as sel:
            while any(w.alive for w in self.all):
                left = deadline - time.monotonic()
                received = self.wakeup.pop_signal()
                if left <= 0 or received is not None:
                    break
                self.reap_ready(sel, timeout=left)
            if any(w.alive for w in self.all):
                self.kill_all(signal.SIGKILL)
                kill_deadline = time.monotonic() + timeouts.KILL_REAP_S
                while any(w.alive for w in self.all) and time.monotonic() < kill_deadline:
                    self.reap_ready(sel, timeout=kill_deadline - time.monotonic())
        return received

    def kill_all(self, sig: int) -> None:
        for w in self.all:
            if w.alive:
                if w.state is not WorkerState.STOPPING:
                    w.move(WorkerState.STOPPING)
                signal_group(w.spawned.pid, sig)

    def close_streams(self) -> None:
        for w in self.all:
            w.streams.close()

    def exits(self) -> tuple[WorkerExit, ...]:
        return tuple(w.exit for w in self.all if w.exit is not None)
