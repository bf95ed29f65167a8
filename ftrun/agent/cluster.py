"""What differs between an agent alone, the coordinator of several nodes and a follower.

Owns: `Cluster`, the interface an agent is given for the rest of its job while it plays a
role (alone, coordinating, following): `Supervises`, its hooks in the supervise loop, and
`OtherNodes`, its directory of the other nodes' workers; `Handover`, what a role's run ends
with when the next role plays on (the agent's loop swaps them); `Local`, the one-node role; and
`NoOtherNodes` and `SupervisesNoOtherNode`, the answers of an agent that watches no other node
(a follower's too). `cluster.coordinating.Coordinating` and `cluster.following.Following` are
the multi-node roles; a new control-plane backend is another implementation of this
interface, never a subclass of the agent.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ftrun.adapters.store import HostedStore
from ftrun.agent.roster import RemoteWorker, RunResult, Worker
from ftrun.core.errors import FtrunError
from ftrun.core.policy import Decision, Liveness
from ftrun.core.states import NodeRole
from ftrun.protocol.rendezvous import Generation
from ftrun.protocol.status import Status

if TYPE_CHECKING:
    from ftrun.agent.recovery import Recovery

StopLocal = Callable[[int, float], "int | None"]  # (signal, grace) -> a signal received
Adopt = Callable[[HostedStore], "Recovery"]  # the recovery of an attempt already running


@dataclass(frozen=True)
class Handover:
    """What a role's `drive` returns when this node plays another part from now on: `to`
    coordinates (the coordinator is gone: `adopt` gives the recovery of the attempt that runs,
    whose workers, this node's and the other nodes', go on), or follows another coordinator
    (this one's leadership ended). The agent's loop at the top makes the change."""

    to: Cluster
    adopt: Adopt | None = None


class OtherNodes(Protocol):
    """The directory of the workers on the job's other nodes (`cluster.directory` on the
    coordinator; `NoOtherNodes` elsewhere)."""

    def allocate_id(self, node: int) -> int: ...
    def peek_id(self, node: int) -> int: ...
    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None: ...
    def other_nodes(self) -> list[int]: ...
    def relay_inboxes(self) -> dict[int, str]:
        """Each other node's relay inbox, where it has one (`protocol.fanout.relay_plan`)."""
    def initial_members(self) -> tuple[int, ...] | None:
        """The first generation's members, None: this node's workers."""
    def remote_workers(self) -> list[RemoteWorker]: ...
    def highest_committed(self, worker_ids: Iterable[int]) -> int:
        """The highest step these workers committed, as their nodes last said (-1: none;
        this node's own workers are not theirs to say)."""
    def kill_remote(self, worker_id: int) -> bool: ...
    def remote_liveness(self) -> list[Liveness]: ...


class Supervises(Protocol):
    """What the agent's supervise loop (and its recovery) asks of the rest of the job."""

    def start_group(self, restarts: int, hosted: HostedStore,
                    start_local: Callable[[], None]) -> None: ...
    def remote_exits(self) -> list[RemoteWorker]: ...
    def idle_wait(self, local: float | None) -> float | None: ...
    def tick(self, periodic: bool = True) -> Decision | None: ...
    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None: ...
    def on_local_exit(self, w: Worker) -> None: ...
    def suspect(self) -> None: ...
    def fence_generation(self, gen: Generation) -> None: ...


class Cluster(Supervises, Protocol):
    """A role: the rest of the job as this node's agent sees it while it plays the role."""

    index: int  # this node's index in the job (worker ids name their node)
    remembered: bool  # `ftrun report --last` shows this agent's run
    role: NodeRole  # which part, of those `core.states.NodeRole` allows to follow each other

    @property
    def others(self) -> OtherNodes:
        """The workers on the job's other nodes."""

    def prepare(self) -> None:
        """After the guardian, before the workers: serve or reach what the job shares."""
    def drive(self, attempts: Callable[[], RunResult]) -> RunResult | Handover:
        """The run: the agent's own attempts, or what another node commands; or the role
        that plays on (the agent's loop makes the change)."""
    def close(self, result: RunResult | None) -> None:
        """The run is over (None: it failed): tell the other nodes, let go of the store."""
    def net_down(self, node: int, duration: float) -> dict[str, Any]: ...
    def uses_api(self, local: bool) -> bool:
        """Does the script use the API? `local`: what this node's recovery says."""
    def decorate_status(self, status: Status) -> Status:
        """This node's status as the job shows it (a coordinator adds the other nodes)."""


class NoOtherNodes:
    """The directory of an agent that places, counts and kills no worker on another node:
    one alone, or one that follows a coordinator (which does that for the whole job)."""

    def allocate_id(self, node: int) -> int:
        raise KeyError(node)  # only the coordinator starts workers on other nodes

    def peek_id(self, node: int) -> int:
        raise KeyError(node)

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        raise KeyError(worker_id)

    def other_nodes(self) -> list[int]:
        return []

    def relay_inboxes(self) -> dict[int, str]:
        return {}

    def initial_members(self) -> tuple[int, ...] | None:
        return None

    def remote_workers(self) -> list[RemoteWorker]:
        return []

    def highest_committed(self, worker_ids: Iterable[int]) -> int:
        return -1

    def kill_remote(self, worker_id: int) -> bool:
        return False

    def remote_liveness(self) -> list[Liveness]:
        return []


class SupervisesNoOtherNode:
    """The supervise loop's answers of an agent that watches no other node: one alone, or
    one that follows a coordinator (which watches the whole job)."""

    others: OtherNodes = NoOtherNodes()

    def suspect(self) -> None:
        pass

    def fence_generation(self, gen: Generation) -> None:
        pass

    def remote_exits(self) -> list[RemoteWorker]:
        return []

    def idle_wait(self, local: float | None) -> float | None:
        return local

    def tick(self, periodic: bool = True) -> Decision | None:
        return None

    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None:
        return stop_local(sig, grace)

    def prepare(self) -> None:
        pass

    def close(self, result: RunResult | None) -> None:
        pass


class Local(SupervisesNoOtherNode):
    """A job of one node: nothing but this agent."""

    index = 0
    remembered = True
    role = NodeRole.ALONE

    def drive(self, attempts: Callable[[], RunResult]) -> RunResult:
        return attempts()

    def start_group(self, restarts: int, hosted: HostedStore,
                    start_local: Callable[[], None]) -> None:
        start_local()

    def on_local_exit(self, w: Worker) -> None:
        pass

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        raise FtrunError("--kind net-down cuts one node of a multi-node job off the others; "
                         "this job runs on one node", hint="rehearse a node's partition in "
                         "a job of several nodes (docs/many-nodes.md)")

    def uses_api(self, local: bool) -> bool:
        return local

    def decorate_status(self, status: Status) -> Status:
        return status
