"""What the rest of the agent asks of its node, answered for a single node.

Owns: the agent's side of `ports.AgentPort`, through which `Recovery`, `HealthWatch` and the
`ControlPlane` reach workers (ids, placement, liveness, kills, status), with its one-node answers
(the coordinator and follower agents of a multi-node job override them), and acting on what
the health watch found (kills, rebuilds).
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ftrun.adapters.procs import signal_group
from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.journal import Journal
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.agent.snapshots import SnapshotKeeper
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.watch import Finding, HealthWatch, Kill, Rebuild
from ftrun.core.errors import FtrunError
from ftrun.core.events import Event, EventSink
from ftrun.core.policy import Decision, Liveness
from ftrun.core.spec import RunSpec


class NodeHooks:
    spec: RunSpec
    run_id: str
    restarts: int
    recovery: Recovery | None
    health: HealthWatch
    slots: ProgressSlots
    journal: Journal
    starter: WorkerStarter
    snapshots: SnapshotKeeper
    _workers: list[Worker]
    _next_id: int
    _killed: set[tuple[int, int]]  # (attempt, worker id) the health watch had killed
    emit: EventSink

    def spawn_worker(self, worker_id: int, rank: int, local_rank: int,
                     spare: bool = False) -> Worker:
        raise NotImplementedError

    def worker_by_id(self, worker_id: int) -> Worker | None:
        return next((w for w in self._workers if w.worker_id == worker_id), None)

    def allocate_id(self, node: int) -> int:
        """A worker id not used yet in this attempt."""
        self._next_id += 1
        return self._next_id - 1

    def peek_id(self, node: int) -> int:  # what allocate_id(node) returns next
        return self._next_id

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        """Start a worker of the current attempt on its node (here: this one)."""
        self.spawn_worker(worker_id, rank, self.health.pick_local_rank(local_rank), spare)

    def live_nodes(self) -> list[int]:
        return [0]

    def committed_step(self, worker_id: int) -> int:
        return self.slots.committed_step(worker_id)

    def initial_members(self) -> tuple[int, ...]:
        return tuple(range(self.spec.nproc))

    def all_workers(self) -> list[Worker | RemoteWorker]:
        return list(self._workers)

    def _remote_exits(self) -> list[RemoteWorker]:
        return []

    def _tick(self) -> Decision | None:
        membership = self.recovery.membership if self.recovery is not None else None
        self.act(self.health.tick(membership, time.time()))
        self.snapshots.drain()
        return None

    def act(self, findings: list[Finding]) -> None:
        """Do what the health watch found: kill a member once per attempt (on whichever node
        it runs), rebuild a stuck communicator and have the watch follow it up."""
        for f in findings:
            if isinstance(f, Kill):
                key = (self.restarts, f.worker)
                if key in self._killed or not self.kill_worker(f.worker):
                    continue
                self._killed.add(key)
                self.journal.drill_injected(f.worker, f.why, time.time())
                if f.notice:
                    self.emit(Event.NOTICE, {"text": f.notice})
            elif (isinstance(f, Rebuild) and self.recovery is not None
                  and self.recovery.rebuild(f.reason)):
                self.health.rebuilt(self.recovery.membership.generation, f.stuck_at,
                                    time.time())

    def suspect(self) -> None:
        """A worker saw a peer's connection break (multi-node: check the nodes now)."""

    def remote_liveness(self) -> list[Liveness]:
        return []

    def kill_worker(self, worker_id: int) -> bool:
        w = self.worker_by_id(worker_id)
        if w is None or not w.alive:
            return False
        signal_group(w.spawned.pid, signal.SIGKILL)
        return True

    def resumable(self) -> tuple[int, int]:
        return self.snapshots.resumable()

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        raise FtrunError("--kind net-down cuts one node of a multi-node job off the others; "
                         "this job runs on one node", hint="rehearse a node's partition in "
                         "a job of several nodes (README: Many nodes)")

    def uses_api(self) -> bool:
        return self.recovery is not None and self.recovery.uses_api

    def control_name(self) -> str:
        if self.spec.nnodes_max > 1:  # several agents of one job may share a host
            return f"{self.run_id[:16]}.{os.getpid()}"
        return self.run_id if self.run_id != "none" else f"none-{os.getpid()}"

    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        forked = [w.spawned.pid for w in list(self._workers)
                  if w.alive and w.spawned.via == "zygote"]
        return {**doc, "zygote": self.starter.describe(forked),
                "snapshot": self.snapshots.describe(time.time())}

