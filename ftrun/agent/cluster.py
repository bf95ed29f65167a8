"""What differs between an agent alone, the coordinator of several nodes and a follower.

Owns: `Cluster`, the interface an agent is given for the rest of its job (the other nodes,
and the parts of a run that depend on them), and `Local`, the one-node answer: no other node,
the agent's own attempts. `cluster.coordinating.Coordinating` and `cluster.following.Following`
are the multi-node answers; a new control-plane backend is another implementation of this
interface, never a subclass of the agent.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ftrun.adapters.store import HostedStore
from ftrun.agent.roster import RemoteWorker, RunResult, Worker
from ftrun.core.errors import FtrunError
from ftrun.core.policy import Decision, Liveness
from ftrun.protocol.rendezvous import Generation

StopLocal = Callable[[int, float], "int | None"]  # (signal, grace) -> a signal received


class Cluster(Protocol):
    index: int  # this node's index in the job (worker ids name their node)
    remembered: bool  # `ftrun report --last` shows this agent's run

    # ---------------------------------------------------------------- the run
    def prepare(self) -> None:
        """After the guardian, before the workers: serve or reach what the job shares."""
    def drive(self, attempts: Callable[[], RunResult]) -> RunResult:
        """The run: the agent's own attempts, or what another node commands."""
    def close(self, result: RunResult | None) -> None:
        """The run is over (None: it failed): tell the other nodes, let go of the store."""
    def start_group(self, restarts: int, hosted: HostedStore,
                    start_local: Callable[[], None]) -> None: ...
    def remote_exits(self) -> list[RemoteWorker]: ...
    def idle_wait(self, local: float | None) -> float | None: ...
    def tick(self) -> Decision | None: ...
    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None: ...
    def on_local_exit(self, w: Worker) -> None: ...

    # ---------------------------------------------------------------- the other nodes
    def allocate_id(self, node: int) -> int: ...
    def peek_id(self, node: int) -> int: ...
    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None: ...
    def other_nodes(self) -> list[int]: ...
    def initial_members(self) -> tuple[int, ...] | None:
        """The first generation's members, None: this node's workers."""
    def remote_workers(self) -> list[RemoteWorker]: ...
    def committed_step(self, worker_id: int) -> int: ...
    def kill_remote(self, worker_id: int) -> bool: ...
    def remote_liveness(self) -> list[Liveness]: ...
    def suspect(self) -> None: ...
    def fence_generation(self, gen: Generation) -> None: ...
    def net_down(self, node: int, duration: float) -> dict[str, Any]: ...
    def uses_api(self, local: bool) -> bool:
        """Does the script use the API? `local`: what this node's recovery says."""
    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]: ...


class NoOtherNodes:
    """The answers of an agent that places, counts and kills no worker on another node: one
    alone, or one that follows a coordinator (which does that for the whole job)."""

    def allocate_id(self, node: int) -> int:
        raise KeyError(node)  # only the coordinator starts workers on other nodes

    def peek_id(self, node: int) -> int:
        raise KeyError(node)

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        raise KeyError(worker_id)

    def other_nodes(self) -> list[int]:
        return []

    def initial_members(self) -> tuple[int, ...] | None:
        return None

    def remote_workers(self) -> list[RemoteWorker]:
        return []

    def committed_step(self, worker_id: int) -> int:
        return -1

    def kill_remote(self, worker_id: int) -> bool:
        return False

    def remote_liveness(self) -> list[Liveness]:
        return []

    def suspect(self) -> None:
        pass

    def fence_generation(self, gen: Generation) -> None:
        pass

    def remote_exits(self) -> list[RemoteWorker]:
        return []

    def idle_wait(self, local: float | None) -> float | None:
        return local

    def tick(self) -> Decision | None:
        return None

    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None:
        return stop_local(sig, grace)

    def prepare(self) -> None:
        pass

    def close(self, result: RunResult | None) -> None:
        pass


class Local(NoOtherNodes):
    """A job of one node: nothing but this agent."""

    index = 0
    remembered = True

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

    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc
