"""Fakes with real semantics for the agent's unit tests without processes: worker processes
that are records (under the real `NodeWorkers`), and the agent as its cluster and helpers see
it (`FakeNode`, typed as `NodeHost`: test_layering runs mypy on the test files that use it,
so a member the protocol gains is a member this fake must have). Its helpers' port is the
agent's own `NodePort`: the routing between this node and the others is not copied here.

Nothing here forks, signals or listens: a fake worker's pid lies past the kernel's largest
(`PID_MAX_LIMIT`), so what the real code still signals or reads of it finds no such process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import IO, Any

from ftrun.adapters.logs import WorkerStreams
from ftrun.adapters.procs import Guardian, Spawned
from ftrun.adapters.wakeup import Wakeup
from ftrun.agent.cluster import Cluster, Local
from ftrun.agent.nodeport import NodePort
from ftrun.agent.ports import AgentPort
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import Attempt, Worker
from ftrun.agent.runtime import NodeRuntime
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.watch import Finding
from ftrun.agent.workers import NodeWorkers
from ftrun.cluster.host import NodeHost
from ftrun.core.events import Event, EventSink
from ftrun.core.spec import RunSpec
from ftrun.core.states import WorkerState

FAKE_PID = 4_194_305  # past PID_MAX_LIMIT (2**22): no process has it, no group either
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
class CountingWakeup(Wakeup):
    """The agent's wakeup, counting the wakes from other threads (a test waits for them)."""

    def __init__(self) -> None:
        super().__init__()
        self._woken = threading.Condition()
        self.wakes = 0

    def wake(self) -> None:  # any thread
        super().wake()
        with self._woken:
            self.wakes += 1
            self._woken.notify_all()

    def wait_wakes(self, count: int, timeout_s: float = 10.0) -> None:
        with self._woken:
            assert self._woken.wait_for(lambda: self.wakes >= count, timeout_s), self.wakes


class FakeNode:
    """The agent as its cluster reaches it (`NodeHost`): real services and worker records,
    the agent's own `NodePort` for its helpers, and a record of what it was told."""

    def __init__(self, spec: RunSpec, run_id: str = "units") -> None:
        self.spec = spec
        self.attempt = Attempt(run_id=run_id, world_size=spec.nproc)
        self.recovery: Recovery | None = None
        self.events: list[tuple[Event, dict[str, Any]]] = []
        self.findings: list[Finding] = []
        self.counting = CountingWakeup()
        self.wakeup: Wakeup = self.counting
        self.cluster: Cluster = Local()
        self.emit: EventSink = self._record  # the journal's once the services exist
        # the agent's own port, routing and all: only the node around it is a fake
        self.port = NodePort(spec, self.wake, self._record, lambda: self.cluster,
                             lambda: self.recovery, lambda: self.attempt)
        self.services = RunServices(spec, run_id, self._record, self.port, NoGuardian())
        self.emit = self.services.journal.emit
        # the protocol's type for what the cluster reads, the fake's for what a test does
        self.fake_workers = FakeWorkers(spec, self.services, self.wakeup, self.emit)
        self.workers: NodeWorkers = self.fake_workers
        self.port.attach(self.workers, self.services)  # no zygote to show
        self.starter = WorkerStarter(spec, self._record, self.wakeup)  # never opened
        self.runtime = NodeRuntime(spec, self.wakeup, self.starter, self.workers, self.services,
                                   self.port)

    def attach(self, cluster: Cluster) -> None:
        """As the agent does once its cluster is made: exits go to the cluster."""
        self.cluster = cluster
        self.workers.report_exits_to(cluster.on_local_exit)

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
    def update_attempt(self, **changes: Any) -> None:
        self.attempt = replace(self.attempt, **changes)

    def wake(self) -> None:  # the port's (any thread)
        self.wakeup.wake()

    def wait_wakes(self, count: int, timeout_s: float = 10.0) -> None:
        """Until `count` wakes came (a reader thread delivered that many messages)."""
        self.counting.wait_wakes(count, timeout_s)

    def act(self, findings: list[Finding]) -> None:
        self.findings += findings


def _typed(node: FakeNode) -> tuple[NodeHost, AgentPort]:
    return node, node.port  # mypy checks here that the fake fits the host protocol
