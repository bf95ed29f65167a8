"""Fakes with real semantics for the agent's unit tests without processes: an in-memory store
with TCPStore's semantics, worker processes that are records, and the agent as its cluster and
helpers see it (`FakeNode`, typed as `NodeHost` and `AgentPort`: test_layering runs mypy on the
test files that use it, so a member the protocols gain is a member this fake must have).

Nothing here forks, signals or listens: a fake worker's pid lies past the kernel's largest
(`PID_MAX_LIMIT`), so what the real code still signals or reads of it finds no such process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import IO, Any, TypeVar

from ftrun.adapters.logs import WorkerStreams
from ftrun.adapters.procs import Guardian, Spawned
from ftrun.adapters.store import HostedStore
from ftrun.adapters.wakeup import Wakeup
from ftrun.agent.cluster import Cluster, Local
from ftrun.agent.ports import AgentPort
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RemoteWorker, RunResult, Worker
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.watch import Finding
from ftrun.agent.workers import NodeWorkers
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import AGENT_QUEUE, Outbox, command_queue
from ftrun.cluster.messages import (
    Command,
    Report,
    parse_command,
    parse_report,
)
from ftrun.core.events import Event, EventSink
from ftrun.core.exits import signal_name
from ftrun.core.policy import Liveness
from ftrun.core.spec import RunSpec
from ftrun.core.states import WorkerState
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, encode, gen_key, node_of

FAKE_PID = 4_194_305  # past PID_MAX_LIMIT (2**22): no process has it, no group either
M = TypeVar("M")
_ZERO: dict[object, object] = {str: "", int: 0, float: 0.0, bool: False}


def message(cls: type[M], **given: Any) -> M:
    """A message (or any flat record) with the `given` fields and every other one at its
    type's zero value ("", 0, False): a field added for another feature leaves what a test
    says, and what it expects to read, as they were."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    assert set(given) <= set(names), set(given) - set(names)
    return cls(**{n: given[n] if n in given else _ZERO[hints[n]] for n in names})


# ------------------------------------------------------------------ the store
class StoreTimeout(RuntimeError):
    """What c10d raises when a blocking call expires (its text is how callers tell)."""


class _Data:
    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.cond = threading.Condition()


def _raw(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class MemoryStore:
    """One client connection to an in-memory TCPStore: keys hold their last value, `add`
    counts, a queue pops in push order; `get`, `multi_get` and a blocking `queue_pop` wait
    for their key or item until this client's timeout, then raise as c10d does. `client()`
    is another connection to the same store, with a timeout of its own."""

    def __init__(self, data: _Data | None = None, timeout_s: float = 5.0) -> None:
        self._data = data or _Data()
        self._timeout_s = timeout_s

    def client(self) -> MemoryStore:
        return MemoryStore(self._data, self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:  # under the lock
        if not self._data.cond.wait_for(ready, self._timeout_s):
            raise StoreTimeout(f"wait timeout after {self._timeout_s * 1000:.0f}ms, {what}")

    def set(self, key: str, value: str | bytes) -> None:
        with self._data.cond:
            self._data.keys[key] = _raw(value)
            self._data.cond.notify_all()

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._data.cond:
            self._wait(lambda: all(k in self._data.keys for k in keys), f"keys={list(keys)}")
            return [self._data.keys[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        with self._data.cond:
            value = int(self._data.keys.get(key, b"0")) + amount
            self._data.keys[key] = str(value).encode()
            self._data.cond.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._data.cond:
            return all(k in self._data.keys for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._data.cond:
            found = self._data.keys.pop(key, None) is not None
            return self._data.queues.pop(key, None) is not None or found

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._data.cond:
            self._data.queues.setdefault(key, deque()).append(_raw(value))
            self._data.cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._data.cond:
            if block:
                self._wait(lambda: bool(self._data.queues.get(key)), f"queue={key}")
            elif not self._data.queues.get(key):
                raise StoreTimeout(f"queue {key} is empty")  # not a timeout in c10d either
            return self._data.queues[key].popleft()

    def queue_len(self, key: str) -> int:
        with self._data.cond:
            return len(self._data.queues.get(key, ()))

    def drain(self, key: str) -> list[bytes]:
        """Everything queued under `key`, taken (what its reader would pop next)."""
        with self._data.cond:
            items = list(self._data.queues.get(key, ()))
            self._data.queues.pop(key, None)
            return items


def generation(store: MemoryStore) -> Generation:
    """The newest generation published to `store`."""
    return Generation.from_json(store.get(gen_key(int(store.get(LATEST_KEY)))))


def commands(store: MemoryStore, node: int) -> list[Command]:
    """The commands sent to `node` since the last look, as that node would parse them."""
    out = [parse_command(raw) for raw in store.drain(command_queue(node))]
    assert not [c for c in out if isinstance(c, str)], out
    return [c for c in out if not isinstance(c, str)]


def reports(store: MemoryStore) -> list[Report]:
    """The reports the followers sent since the last look, as the coordinator parses them."""
    out = [parse_report(raw) for raw in store.drain(AGENT_QUEUE)]
    assert not [r for r in out if isinstance(r, str)], out
    return [r for r in out if not isinstance(r, str)]


class MemoryHosted(HostedStore):
    """The coordinator's rendezvous store, served in memory: no socket, no torch."""

    def __init__(self, store: MemoryStore) -> None:  # no bind: nothing listens
        self._sock = None
        self.host, self.port = "127.0.0.1", 29400
        self.store = None
        self._memory = store

    def serve(self, timeout_s: float = 0.0) -> Any:
        if self.store is None:
            self.store = self._memory.client()
        return self.store

    def close(self) -> None:
        self.store = None


class StoreOutbox(Outbox):
    """A follower's outbox without its thread: each report is pushed at once, in order, onto
    the coordinator's queue, as the outbox's thread pushes it."""

    def __init__(self, store: MemoryStore) -> None:  # no thread, no connection
        self._store = store

    def put(self, msg: Command | Report) -> None:
        self._store.queue_push(AGENT_QUEUE, encode(msg))

    def close(self, flush_s: float) -> None:
        pass


# ------------------------------------------------------------------ processes
class NoGuardian(Guardian):
    """The guardian's bookkeeping without its process (nothing here needs killing)."""

    def __init__(self) -> None:  # no fork
        self.pid, self._write_fd = 0, -1
        self.watched: set[int] = set()

    def watch(self, pgid: int) -> None:
        self.watched.add(pgid)

    def forget(self, pgid: int) -> None:
        self.watched.discard(pgid)

    def remove_on_death(self, path: str) -> None:
        pass

    def close(self) -> None:
        pass


class FakeChild:
    """A worker process as `Popen` shows it: running until it is given a return code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def fake_worker(worker_id: int, rank: int, local_rank: int) -> Worker:
    """A running worker record, its process a `FakeChild`."""
    return Worker(rank, local_rank, worker_id,
                  Spawned(FakeChild(FAKE_PID + worker_id), None, time.monotonic()),
                  WorkerStreams(stdout=None, stderr=None, error_file="", log_dir=None))


class FakeStarter(WorkerStarter):
    """Starts no process: every worker is a `FakeChild` with a pid no process has."""

    def __init__(self, spec: RunSpec, emit: EventSink) -> None:
        super().__init__(spec, emit)
        self.next_pid = FAKE_PID
        self.argv: list[list[str]] = []

    def start(self, argv: Sequence[str], env: Mapping[str, str],
              stdout: int | IO[bytes] | None, stderr: int | IO[bytes] | None) -> Spawned:
        self.argv.append(list(argv))
        self.next_pid += 1
        return Spawned(FakeChild(self.next_pid - 1), None, time.monotonic())


class FakeWorkers(NodeWorkers):
    """This node's workers as the agent keeps them (the real spawn, logs, slots and exit
    records), over fake processes: a signal ends a process at once with that signal, and the
    exit is seen at the next `reap()`, as the agent's event loop would see it."""

    def __init__(self, spec: RunSpec, services: RunServices, wakeup: Wakeup,
                 emit: EventSink) -> None:
        self.fake_guardian = NoGuardian()
        super().__init__(spec, {}, FakeStarter(spec, emit), self.fake_guardian, wakeup,
                         services, lambda *args: {}, emit)
        self.signals: list[tuple[int, int]] = []  # (worker id, signal), in order

    def _signal(self, w: Worker, sig: int) -> None:
        self.signals.append((w.worker_id, sig))
        child = w.spawned.process
        assert isinstance(child, FakeChild)
        if child.returncode is None:
            child.returncode = -sig

    def end(self, worker_id: int, code: int) -> Worker:
        """The worker's process ends by itself with `code`; its exit is reaped."""
        w = self.by_id(worker_id)
        assert w is not None and w.alive
        child = w.spawned.process
        assert isinstance(child, FakeChild)
        child.returncode = code
        self.reap()
        return w

    def reap(self) -> list[Worker]:
        ended = [w for w in self.all if w.alive and w.spawned.process.poll() is not None]
        for w in ended:
            self._record_exit(w)
        return ended

    def kill(self, worker_id: int) -> bool:
        w = self.by_id(worker_id)
        if w is None or not w.alive:
            return False
        self._signal(w, 9)
        return True

    def stop(self, sig: int, grace: float) -> int | None:
        for w in self.all:
            if w.alive:
                w.move(WorkerState.STOPPING)
                self._signal(w, sig)
        self.reap()
        return None

    def kill_all(self, sig: int) -> None:
        for w in self.all:
            if w.alive:
                if w.state is not WorkerState.STOPPING:
                    w.move(WorkerState.STOPPING)
                self._signal(w, sig)


# ------------------------------------------------------------------ the agent
class FakeNode:
    """The agent as its cluster (`NodeHost`) and its helpers (`AgentPort`) reach it: real
    services and worker records, the same routing as `agent.node.Agent` (this node's workers
    here, the others through the cluster), and a record of what it was told."""

    def __init__(self, spec: RunSpec, run_id: str = "units") -> None:
        self.spec = spec
        self.run_id = run_id
        self.restarts = 0
        self.recovery: Recovery | None = None
        self.master_addr, self.worker_port, self.relay_addr = "", 0, ""
        self.world_size, self.group_rank, self.group_world_size = spec.nproc, 0, 1
        self.events: list[tuple[Event, dict[str, Any]]] = []
        self.findings: list[Finding] = []
        self._woken = threading.Condition()
        self.wakes = 0
        self.wakeup = Wakeup()
        self.cluster: Cluster = Local()
        self.emit: EventSink = self._record  # the journal's once the services exist
        self.services = RunServices(spec, run_id, self._record, self, NoGuardian())
        self.emit = self.services.journal.emit
        # the protocol's type for what the cluster reads, the fake's for what a test does
        self.fake_workers = FakeWorkers(spec, self.services, self.wakeup, self.emit)
        self.workers: NodeWorkers = self.fake_workers

    def attach(self, cluster: Cluster) -> None:
        """As the agent does once its cluster is made: exits go to the cluster."""
        self.cluster = cluster
        self.workers.on_exit = cluster.on_local_exit

    def close(self) -> None:
        self.fake_workers.close_streams()
        self.services.close()
        self.wakeup.close()

    def _record(self, kind: Event, fields: Mapping[str, object]) -> None:
        self.events.append((kind, dict(fields)))

    def notices(self) -> list[str]:
        return [str(f["text"]) for k, f in self.events if k is Event.NOTICE]

    def of_kind(self, kind: Event) -> list[dict[str, Any]]:
        return [f for k, f in self.events if k is kind]

    # ------------------------------------------------------------ NodeHost
    def wake(self) -> None:  # any thread
        with self._woken:
            self.wakes += 1
            self._woken.notify_all()

    def wait_wakes(self, count: int, timeout_s: float = 10.0) -> None:
        """Until `count` wakes came (a reader thread delivered that many messages)."""
        with self._woken:
            assert self._woken.wait_for(lambda: self.wakes >= count, timeout_s), self.wakes

    def act(self, findings: list[Finding]) -> None:
        self.findings += findings

    def take_over(self, cluster: Cluster, adopt: Callable[[HostedStore], Recovery]
                  ) -> RunResult:
        raise AssertionError("no coordinator is lost in these tests")

    def signal_result(self, sig: int, restarts: int) -> RunResult:
        return RunResult(1, f"received {signal_name(sig)}; workers stopped",
                         exits=self.workers.exits(), restarts_used=restarts,
                         signal_received=signal_name(sig))

    # ------------------------------------------------------------ AgentPort
    def _here(self, worker_id: int) -> bool:
        return node_of(worker_id) == self.cluster.index

    def allocate_id(self, node: int) -> int:
        if node == self.cluster.index:
            return self.workers.allocate_id()
        return self.cluster.allocate_id(node)

    def peek_id(self, node: int) -> int:
        return self.workers.next_id if node == self.cluster.index else self.cluster.peek_id(node)

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        if self._here(worker_id):
            self.workers.spawn(worker_id, rank,
                               self.services.health.pick_local_rank(local_rank), spare)
        else:
            self.cluster.place(worker_id, rank, local_rank, spare)

    def live_nodes(self) -> list[int]:
        return [self.cluster.index, *self.cluster.other_nodes()]

    def initial_members(self) -> tuple[int, ...]:
        return self.cluster.initial_members() or tuple(range(self.spec.nproc))

    def all_workers(self) -> list[Worker | RemoteWorker]:
        return [*self.workers.all, *self.cluster.remote_workers()]

    def workers_snapshot(self) -> list[Worker]:
        return self.workers.alive()

    def worker_by_id(self, worker_id: int) -> Worker | None:
        return self.workers.by_id(worker_id)

    def live_members(self) -> list[Worker]:
        if self.recovery is None or not self.recovery.uses_api:
            return sorted(self.workers.alive(), key=lambda w: w.rank)
        by_id = {w.worker_id: w for w in self.workers.alive()}
        return [by_id[m] for m in self.recovery.membership.members if m in by_id]

    def committed_step(self, worker_id: int) -> int:
        if self._here(worker_id):
            return self.services.slots.committed_step(worker_id)
        return self.cluster.committed_step(worker_id)

    def kill_worker(self, worker_id: int) -> bool:
        if self.workers.by_id(worker_id) is not None:
            return self.workers.kill(worker_id)
        return self.cluster.kill_remote(worker_id)

    def remote_liveness(self) -> list[Liveness]:
        return self.cluster.remote_liveness()

    def resumable(self) -> tuple[int, int]:
        return self.services.snapshots.resumable()

    def suspect(self) -> None:
        self.cluster.suspect()

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        return self.cluster.net_down(node, duration)

    def uses_api(self) -> bool:
        return self.cluster.uses_api(self.recovery is not None and self.recovery.uses_api)

    def control_name(self) -> str:
        return self.run_id

    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.cluster.decorate_status(doc)


def _typed(node: FakeNode) -> tuple[NodeHost, AgentPort]:
    return node, node  # mypy checks here that the fake fits both protocols
