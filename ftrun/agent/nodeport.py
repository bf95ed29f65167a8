"""The port the agent's helpers reach their node through (`ports.AgentPort`), and where each
worker of the job runs.

Owns: routing a question about a worker or a node to this node's `NodeWorkers` or, for
another node, to the `Cluster` (ids, placement, committed steps, kills, liveness), the
members of the current generation in rank order, and what `ftrun status` adds about this
node. The agent hands its helpers (recovery, health watch, control plane) a `NodePort`, not
itself; the unit tests' fake node builds the same one, so the routing exists once.
The agent's cluster, recovery and attempt are read through callables: a takeover changes
the first, an attempt the others (a follower learns its run id), and the port never holds
a stale one.
Must not import: the agent (`node`), torch, typer, rich.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ftrun.agent.cluster import Cluster, OtherNodes
from ftrun.agent.roster import Attempt, RemoteWorker, Worker
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.workers import NodeWorkers
from ftrun.core.drains import DrainRequest
from ftrun.core.events import Event, EventSink
from ftrun.core.policy import Liveness
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, Generation, node_of
from ftrun.protocol.status import Status

if TYPE_CHECKING:
    from ftrun.agent.recovery import Recovery


class NodePort:
    def __init__(self, spec: RunSpec, wake: Callable[[], None], sink: EventSink,
                 cluster: Callable[[], Cluster], recovery: Callable[[], Recovery | None],
                 attempt: Callable[[], Attempt]) -> None:
        """Built before the services and workers, which are built with it: `attach` them."""
        self.spec = spec
        self._wake = wake
        self._sink = sink  # the journal's once attached
        self._cluster = cluster
        self._recovery = recovery
        self._attempt = attempt
        self.workers: NodeWorkers | None = None
        self.services: RunServices | None = None
        self.starter: WorkerStarter | None = None

    def attach(self, workers: NodeWorkers, services: RunServices,
               starter: WorkerStarter | None = None) -> None:
        self.workers, self.services, self.starter = workers, services, starter
        self._sink = services.journal.emit

    @property
    def restarts(self) -> int:
        return self._attempt().restarts

    @property
    def run_id(self) -> str:  # a follower learns its coordinator's
        return self._attempt().run_id

    def emit(self, kind: Event, fields: Mapping[str, object]) -> None:
        self._sink(kind, fields)

    def wake(self) -> None:
        """Interrupt the agent's event loop from another thread."""
        self._wake()

    @property
    def _workers(self) -> NodeWorkers:
        assert self.workers is not None, "attach() first"
        return self.workers

    @property
    def _services(self) -> RunServices:
        assert self.services is not None, "attach() first"
        return self.services

    @property
    def _others(self) -> OtherNodes:
        return self._cluster().others

    def _here(self, worker_id: int) -> bool:
        return node_of(worker_id) == self._cluster().index

    def allocate_id(self, node: int) -> int:
        here = node == self._cluster().index
        return self._workers.allocate_id() if here else self._others.allocate_id(node)

    def peek_id(self, node: int) -> int:
        """What `allocate_id(node)` returns next."""
        here = node == self._cluster().index
        return self._workers.next_id if here else self._others.peek_id(node)

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        """Start a worker of the current attempt on its node."""
        if self._here(worker_id):
            self._workers.spawn(worker_id, rank,
                                self._services.health.pick_local_rank(local_rank), spare)
        else:
            self._others.place(worker_id, rank, local_rank, spare)

    def live_nodes(self) -> list[int]:
        cluster = self._cluster()
        return [cluster.index, *cluster.others.other_nodes()]

    def relay_inboxes(self) -> dict[int, str]:
        return self._cluster().others.relay_inboxes()

    def initial_members(self) -> tuple[int, ...]:
        return self._others.initial_members() or tuple(range(self.spec.nproc))

    def all_workers(self) -> list[Worker | RemoteWorker]:
        return [*self._workers.all, *self._others.remote_workers()]

    def workers_snapshot(self) -> list[Worker]:
        return self._workers.alive()

    def worker_by_id(self, worker_id: int) -> Worker | None:
        return self._workers.by_id(worker_id)

    def live_members(self) -> list[Worker]:
        """This node's workers of the current generation in rank order (all live workers
        without in-process recovery)."""
        recovery = self._recovery()
        if recovery is None or not recovery.uses_api:
            return sorted(self._workers.alive(), key=lambda w: w.rank)
        by_id = {w.worker_id: w for w in self._workers.all}
        return [by_id[m] for m in recovery.membership.members
                if m in by_id and by_id[m].alive]

    def highest_committed(self, worker_ids: Sequence[int]) -> int:
        """One pass for this node's workers' slots, one lookup each in the other nodes'."""
        first = self._cluster().index * WORKER_ID_STRIDE  # this node's ids: [first, end)
        end, slots = first + WORKER_ID_STRIDE, self._services.slots
        # a range test, not `node_of` per id: 32,768 calls were ~3 ms of a fault's decision
        mine = max((slots.committed_step(w) for w in worker_ids if first <= w < end),
                   default=-1)
        return max(mine, self._others.highest_committed(worker_ids))

    def kill_worker(self, worker_id: int) -> bool:
        """SIGKILL a live worker of this job, on whichever node it runs; False: not alive."""
        if self._workers.by_id(worker_id) is not None:
            return self._workers.kill(worker_id)
        return self._others.kill_remote(worker_id)

    def remote_liveness(self) -> list[Liveness]:
        return self._others.remote_liveness()

    def resumable(self) -> tuple[int, int]:
        return self._services.snapshots.resumable()

    def suspect(self) -> None:
        """A worker saw a peer's connection break (several nodes: check them now)."""
        self._cluster().suspect()

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        return self._cluster().net_down(node, duration)

    def fence_generation(self, gen: Generation) -> None:
        self._cluster().fence_generation(gen)

    def uses_api(self) -> bool:
        recovery = self._recovery()
        return self._cluster().uses_api(recovery is not None and recovery.uses_api)

    def start_drain(self, request: DrainRequest) -> None:
        """A checked planned leave (the control plane's `ftrun drain`)."""
        recovery = self._recovery()
        if recovery is not None:
            recovery.drains.start(request)

    def control_name(self) -> str:
        if self.spec.nnodes_max > 1:  # several agents of one job may share a host
            return f"{self.run_id[:16]}.{os.getpid()}"
        return self.run_id if self.run_id != "none" else f"none-{os.getpid()}"

    def decorate_status(self, status: Status) -> Status:
        zygote = None
        if self.starter is not None:  # the unit tests' fake node starts no process
            zygote = self.starter.describe([w.spawned.pid for w in self._workers.alive()
                                            if w.spawned.via == "zygote"])
        status = replace(status, zygote=zygote,
                         snapshot=self._services.snapshots.describe(time.time()))
        return self._cluster().decorate_status(status)
