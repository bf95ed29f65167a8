"""The coordinator's directory of the workers on the job's other nodes.

Owns: `JobDirectory`, the coordinating role's answer to `agent.cluster.OtherNodes`: the ids
issued on another node, a worker placed there (a spawn order to its agent), the nodes of the
running attempt, the attempt's first members, the remote workers as their nodes report them,
their committed steps and liveness (from their nodes' heartbeats), and killing one. An agent
alone, or a follower, answers with `agent.cluster.NoOtherNodes`.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

from collections.abc import Iterable

from ftrun.agent.jobview import Node
from ftrun.agent.roster import RemoteWorker
from ftrun.cluster.jobnodes import NodeTable
from ftrun.cluster.messages import Kill, Spawn
from ftrun.cluster.remotes import RemoteWorkers
from ftrun.core.policy import Liveness
from ftrun.protocol.rendezvous import Generation, node_of


class JobDirectory:
    def __init__(self, nodes: dict[int, Node], workers: RemoteWorkers, table: NodeTable) -> None:
        """`nodes`, `workers`, `table`: the coordinator's, shared (it adds and drops nodes)."""
        self._nodes = nodes
        self._workers = workers
        self._table = table
        self._members: tuple[int, ...] = ()

    @property
    def members(self) -> tuple[int, ...]:
        """The attempt's first members: a node entering later is measured against them."""
        return self._members

    def started(self, members: tuple[int, ...]) -> None:
        """The attempt's first members, in rank order (every node started)."""
        self._members = members

    def ranked_as(self, gen: Generation) -> None:
        """A takeover: the running generation's members are the attempt's, each remote
        worker ranked as `gen` ranks it (-1: a spare)."""
        self._members = gen.members
        for w in self._workers.by_id.values():
            w.ranked(gen.rank_of(w.worker_id))

    # ------------------------------------------------------------ agent.cluster.OtherNodes
    def allocate_id(self, node: int) -> int:
        return self._workers.allocate(node)

    def peek_id(self, node: int) -> int:
        return self._workers.peek(node)

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        node = node_of(worker_id)
        self._workers.place(worker_id, rank, local_rank, node)
        self._table.send(self._nodes[node], Spawn(worker=worker_id, rank=rank,
                                                  local_rank=local_rank, spare=spare))

    def other_nodes(self) -> list[int]:
        return [n.index for n in self._table.alive() if n.in_attempt]

    def relay_inboxes(self) -> dict[int, str]:
        return {n.index: n.relay_inbox for n in self._table.alive()
                if n.in_attempt and n.relay_inbox}

    def initial_members(self) -> tuple[int, ...] | None:
        return self._members

    def remote_workers(self) -> list[RemoteWorker]:
        return list(self._workers.by_id.values())

    def highest_committed(self, worker_ids: Iterable[int]) -> int:
        return self._table.highest_committed(worker_ids)

    def kill_remote(self, worker_id: int) -> bool:
        w = self._workers.by_id.get(worker_id)
        if w is None or not w.alive or not self._nodes[w.node].alive:
            return False
        self._table.send(self._nodes[w.node], Kill(worker=worker_id))
        return True

    def remote_liveness(self) -> list[Liveness]:
        return self._table.remote_liveness()
