"""The narrow ports through which the agent's helpers reach the node they run on.

Owns: one port per kind of helper, each with only the members that helper uses:
`WatchPort` (the health watch), `RecoveryPort` (in-process recovery and replica groups),
`ControlPort` (the control plane), and `AgentPort`, all three together, which the agent
offers. The helpers type against their port, never against the agent, so each can be built
and tested with a fake; they get the journal and the progress slots explicitly, and they
return findings that the agent acts on.
Must not import: the agent, its helpers, torch, typer, rich.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.core.drains import DrainRequest
from ftrun.core.events import Event
from ftrun.core.policy import Liveness
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import Generation
from ftrun.protocol.status import Status


class Notifying(Protocol):
    spec: RunSpec

    def emit(self, kind: Event, fields: Mapping[str, object]) -> None: ...

    def wake(self) -> None:
        """Interrupt the main loop from another thread."""


class WatchPort(Notifying, Protocol):
    """What the health watch reads: this node's workers, the other nodes' liveness."""

    def workers_snapshot(self) -> list[Worker]: ...
    def live_members(self) -> list[Worker]: ...
    def remote_liveness(self) -> list[Liveness]: ...


class RecoveryPort(Notifying, Protocol):
    """What in-process recovery does to the job: ids, placement on any node, kills."""

    @property
    def restarts(self) -> int:
        """Whole-group restarts so far (the attempt's number)."""

    def allocate_id(self, node: int) -> int: ...
    def peek_id(self, node: int) -> int: ...
    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None: ...
    def live_nodes(self) -> list[int]: ...
    def relay_inboxes(self) -> dict[int, str]: ...
    def initial_members(self) -> tuple[int, ...]: ...
    def all_workers(self) -> list[Worker | RemoteWorker]: ...
    def highest_committed(self, worker_ids: Sequence[int]) -> int:
        """The highest step any of `worker_ids` committed, on whichever node (-1: none)."""
    def kill_worker(self, worker_id: int) -> bool:
        """SIGKILL a live worker of this job, on whichever node it runs; False: not alive."""
    def resumable(self) -> tuple[int, int]:
        """(newest snapshot step or -1, whole-group restarts that already resumed from it)"""
    def suspect(self) -> None:
        """A worker saw a peer's connection break (several nodes: check them now)."""
    def fence_generation(self, gen: Generation) -> None:
        """Before `gen` is published: the control plane takes it under this agent's
        leadership, or raises (deposed: no worker may see it)."""


class ControlPort(Notifying, Protocol):
    """What `ftrun status`, drills and the metrics endpoint read or ask of the node."""

    @property
    def run_id(self) -> str: ...
    @property
    def restarts(self) -> int:
        """Whole-group restarts so far (the attempt's number)."""

    def workers_snapshot(self) -> list[Worker]: ...
    def live_members(self) -> list[Worker]: ...
    def worker_by_id(self, worker_id: int) -> Worker | None: ...
    def uses_api(self) -> bool: ...
    def control_name(self) -> str: ...
    def decorate_status(self, status: Status) -> Status: ...
    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        """A net-down drill on `node` (control thread), or a one-line FtrunError."""

    def start_drain(self, request: DrainRequest) -> None:
        """A checked planned leave, started from the main loop."""


class AgentPort(WatchPort, RecoveryPort, ControlPort, Protocol):
    """Every port at once: what an agent offers its helpers."""
