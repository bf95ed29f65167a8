"""Whole nodes lost: their workers leave together, in one generation.

Owns: `NodeLoss` (a node as the coordinator found it lost) and `NodeLosses`, which decides
every node lost in one pass of the coordinator's loop at once: one decision over all their
members, one fault record per node. Decided one by one, each node cost O(members) (the live
members, the snapshot, the decision, the highest committed step): at 32,768 members ~30 ms
a node, 80 s for the 2,385 nodes a stalled simulator lost at 4,096 nodes (docs/scale.md).
Must not import: torch, typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftrun.agent.generations import Generations
from ftrun.agent.replica_groups import ReplicaGroups
from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.agent.spares import Spares
from ftrun.core.events import EventSink, FaultFields, emit_as
from ftrun.core.faultkinds import FaultAction
from ftrun.core.membership import Membership
from ftrun.core.policy import Decision, FaultDecision, Snapshot, decide_node_loss, stop_decision
from ftrun.core.spec import RunSpec

NAMED_NODES_MAX = 3  # a decision over more lost nodes names this many, then counts the rest


@dataclass(frozen=True)
class NodeLoss:
    node: int
    label: str  # "node 3 (host)"
    workers: tuple[Worker | RemoteWorker, ...]  # every worker it ran, members or not
    last_seen: float  # wall clock of its last sign of life: the fault's best estimate


class NodeLosses:
    def __init__(self, spec: RunSpec, emit: EventSink, membership: Membership, spares: Spares,
                 groups: ReplicaGroups, gens: Generations, count_faults: Callable[[int], None],
                 snapshot: Callable[..., Snapshot], highest_committed: Callable[[], int]) -> None:
        """`count_faults` before `snapshot`: the decision weighs the budget with them."""
        self.spec, self.emit, self.membership = spec, emit, membership
        self.spares, self.groups, self.gens = spares, groups, gens
        self.count_faults, self.snapshot = count_faults, snapshot
        self.highest_committed = highest_committed

    def decide(self, losses: Sequence[NodeLoss], nodes_left: int,
               nodes_waiting: int) -> Decision | None:
        """Every node of `losses` lost at once (`nodes_left`: the job's nodes after them,
        `nodes_waiting` of them not admitted yet): a Decision if the run cannot go on
        in-process. Each node with members is a fault."""
        ids = {w.worker_id for loss in losses for w in loss.workers}
        live = self.membership.live()
        rank_of = {m: i for i, m in enumerate(live)}
        self.membership.leave(ids - rank_of.keys())  # their spares and joiners
        for loss in losses:
            self.spares.forget_node(loss.node)
        firsts = [(loss, *member) for loss in losses
                  if (member := _first_member(loss, rank_of)) is not None]
        if not firsts:
            return None
        lost_members = tuple(m for m in live if m in ids)
        self.count_faults(len(firsts))
        snap = self.snapshot(nodes_left=nodes_left, nodes_waiting=nodes_waiting)
        label = _label([loss.label for loss, _, _ in firsts])
        d: FaultDecision = self.groups.decide_node_loss(snap, label, lost_members) \
            if self.groups.spanning else decide_node_loss(snap, label, lost_members)
        now = time.time()
        committed = self.highest_committed()
        for i, (loss, rank, first) in enumerate(firsts):  # one record per node, one decision
            emit_as(self.emit, FaultFields(first, rank, d.action, d.reason, f"{loss.label} lost",
                                           detected_at=now, committed_before=committed,
                                           node=loss.node,
                                           decided_with=firsts[0][0].node if i else None))
        fault_at = min(min(loss.last_seen for loss, _, _ in firsts), now)
        if self.groups.spanning and d.action is FaultAction.SHRINK:
            self.groups.act_on_node_loss(d, fault_at)
            return None
        if d.action in (FaultAction.SHRINK, FaultAction.REPLACE):
            # spares that take a rank leave the pool for good: the lost nodes' devices are
            # gone, so there is none to start a new spare on
            self.gens.publish(d.members, d.reason, True, fault_at, d.joiners)
            if self.spec.shard_size > 1:  # its groups too
                self.groups.taken_out(fault_at)
            return None
        return stop_decision(d, None)


def _first_member(loss: NodeLoss, rank_of: dict[int, int]) -> tuple[int, int] | None:
    """(rank, worker id) of the node's member ranked first; None: it held no member."""
    return min(((rank_of[w.worker_id], w.worker_id) for w in loss.workers
                if w.worker_id in rank_of), default=None)


def _label(labels: Sequence[str]) -> str:
    """'node 3 (h)'; 'node 3 (h), node 4 (h)'; 'node 3 (h), ... and 2,382 more nodes'."""
    named = ", ".join(labels[:NAMED_NODES_MAX])
    more = len(labels) - NAMED_NODES_MAX
    return named if more <= 0 else f"{named} and {more:,} more nodes"
