"""What the rest of the agent asks of its node, answered for a single node.

Owns: the hooks through which `FaultTolerance`, `HealthWatch` and the `Observer` reach workers
(ids, placement, liveness, kills, status) and their one-node answers; the coordinator and
follower agents of a multi-node job override them.
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

from ftrun.policy import Decision, Liveness
from ftrun.procs import signal_group
from ftrun.roster import RemoteWorker, Worker

if TYPE_CHECKING:
    from ftrun.health import HealthWatch
    from ftrun.observe import Observer
    from ftrun.recovery import FaultTolerance
    from ftrun.spec import RunSpec


class NodeHooks:
    spec: RunSpec
    run_id: str
    ft: FaultTolerance | None
    health: HealthWatch
    observer: Observer
    _workers: list[Worker]
    _next_id: int

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
        return self.observer.progress(worker_id).step

    def initial_members(self) -> tuple[int, ...]:
        return tuple(range(self.spec.nproc))

    def all_workers(self) -> list[Worker | RemoteWorker]:
        return list(self._workers)

    def _remote_exits(self) -> list[RemoteWorker]:
        return []

    def _tick(self) -> Decision | None:
        self.health.tick()
        return None

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

    def uses_api(self) -> bool:
        return self.ft is not None and bool(self.ft.hello)

    def control_name(self) -> str:
        if self.spec.nnodes_max > 1:  # several agents of one job may share a host
            return f"{self.run_id[:16]}.{os.getpid()}"
        return self.run_id if self.run_id != "none" else f"none-{os.getpid()}"

    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc

