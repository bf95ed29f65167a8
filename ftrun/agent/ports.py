"""The narrow port through which the agent's helpers reach the node they run on.

Owns: `AgentPort`, the members an agent (single-node, coordinator or follower) offers to
`Recovery`, `HealthWatch` and the `ControlPlane`. The helpers type against this port, never
against the agent, so each can be built and tested with a fake; they get the journal and the
progress slots explicitly, and they return findings that the agent acts on.
Must not import: the agent, its helpers, torch, typer, rich.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.core.events import Event
from ftrun.core.policy import Liveness
from ftrun.core.spec import RunSpec


class AgentPort(Protocol):
    spec: RunSpec
    run_id: str
    restarts: int

    def emit(self, kind: Event, fields: Mapping[str, object]) -> None: ...

    def wake(self) -> None:
        """Interrupt the main loop from another thread."""

    # workers: ids, placement, liveness
    def allocate_id(self, node: int) -> int: ...
    def peek_id(self, node: int) -> int: ...
    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None: ...
    def live_nodes(self) -> list[int]: ...
    def initial_members(self) -> tuple[int, ...]: ...
    def all_workers(self) -> list[Worker | RemoteWorker]: ...
    def workers_snapshot(self) -> list[Worker]: ...
    def live_members(self) -> list[Worker]: ...
    def worker_by_id(self, worker_id: int) -> Worker | None: ...
    def committed_step(self, worker_id: int) -> int: ...
    def kill_worker(self, worker_id: int) -> bool:
        """SIGKILL a live worker of this job, on whichever node it runs; False: not alive."""
    def remote_liveness(self) -> list[Liveness]: ...
    def resumable(self) -> tuple[int, int]:
        """(newest snapshot step or -1, whole-group restarts that already resumed from it)"""
    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        """A net-down drill on `node` (control thread), or a one-line FtrunError."""

    # what a worker said, and what the job shows
    def suspect(self) -> None: ...
    def uses_api(self) -> bool: ...
    def control_name(self) -> str: ...
    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]: ...
