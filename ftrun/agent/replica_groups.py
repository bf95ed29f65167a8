"""The agent's side of replica groups (--shard-size): a fault that takes a whole group out,
hot spare groups, and the groups' return.

Owns: `ReplicaGroups`, held by `Recovery`: what it does when `core.replica_groups` decides on
a member of a sharded job (publish without the lost group, stop the rest of it, and after the
others' first commit call a ready spare group in or start a fresh group), starting spare
groups (S workers whose group is named in the store, under `spare_group_key`, before they
need it, so they shard their model while they wait) and replacing one whose member died, and
the back-in-service notice; with groups that span nodes, a lost node (its groups out, their
ranks on other nodes stopped and started again after the others' first commit), which ready
workers enter together as whole groups, and when a joining node waits. Past training (a
group lost in its post-training code) no commit will come to call the replacement in: it
enters as soon as it is ready, owing the lost group's post-training work (`ScriptEnds`). It
publishes and starts workers through the `Generations` and `Respawns` it is handed, the same
ones `Recovery` uses.
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

from typing import Any

from ftrun.agent.generations import Generations, Respawns
from ftrun.agent.ports import RecoveryPort
from ftrun.agent.script_ends import ScriptEnds
from ftrun.core.events import notice
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import FaultDecision, Snapshot
from ftrun.core.replica_groups import (
    decide_group_fault,
    decide_group_node_loss,
    entering_groups,
)
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import Recovered, node_of, spare_group_key

R = WorkerRole


class ReplicaGroups:
    """Replica-group behaviour of in-process recovery (used when spec.shard_size > 1)."""

    def __init__(self, spec: RunSpec, port: RecoveryPort, store: Any, membership: Membership,
                 ends: ScriptEnds, gens: Generations, respawns: Respawns) -> None:
        self.spec = spec
        self.port = port
        self.store = store  # None once the attempt is over
        self.membership = membership
        self.ends = ends
        self.gens = gens
        self.respawns = respawns
        self.out_since: float | None = None  # the fault that took a replica group out
        self.spares: list[tuple[int, ...]] = []  # spare groups started, oldest first
        # (node, devices) owed a spare group after a recovery: the lost group's devices
        self._refills: list[tuple[int, list[int]]] = []
        self._calling_in: list[tuple[int, ...]] = []  # spare groups to enter after a commit
        # (node, local rank) of a lost group's members, restarted after the others' commit
        self.joiners_to_start: list[tuple[int, int]] = []
        # groups that span nodes: (node, local rank) of ranks stopped with a lost node's
        # groups, started again once a node enters for the lost ranks
        self.partners: list[tuple[int, int]] = []
        self._committed = True  # the live groups committed since the last node loss

    @property
    def spanning(self) -> bool:
        """A group spans nodes (--shard-size a multiple of the workers per node)."""
        return self.spec.groups_span_nodes

    # ------------------------------------------------------------ a member lost
    def decide(self, snap: Snapshot, lost: int, why: str, loop: int
                            ) -> FaultDecision:
        return decide_group_fault(snap, lost, why, self.spec.shard_size, loop,
                                  self._ready_spare_group(node_of(lost)))

    def act_on_fault(self, d: FaultDecision, lost: int, fault_at: float) -> None:
        """SHRINK: publish without the lost group, stop its other ranks; after the others'
        first commit, call a spare group in or start a fresh one (`after_first_commit`)."""
        self.gens.publish(d.members, d.reason, True, fault_at)
        self.taken_out(fault_at)
        group = next((g for g in self.spares if g[0] == d.spare_used), ())
        if group:
            self.spares.remove(group)
            self._calling_in.append(group)
            self._refills.append((node_of(lost), self._devices_of((lost, *d.evicted))))
        elif d.regrow:  # a replica group comes back whole
            self.joiners_to_start += [self._place_of(m) for m in (lost, *d.evicted)]
        for m in d.evicted:  # its group cannot step without it: stop them now
            self.port.kill_worker(m)

    def decide_node_loss(self, snap: Snapshot, label: str, lost: tuple[int, ...]
                         ) -> FaultDecision:
        return decide_group_node_loss(snap, label, lost, self.spec.shard_size)

    def act_on_node_loss(self, d: FaultDecision, fault_at: float) -> None:
        """SHRINK: publish without the lost node's groups and stop their ranks on the other
        nodes; those ranks start again once a node enters for the lost ones (`node_entered`),
        and enter with its workers as whole groups (`grow_ready`)."""
        self.gens.publish(d.members, d.reason, True, fault_at)
        self.taken_out(fault_at)
        self._committed = False
        if d.regrow:
            self.partners += [self._place_of(m) for m in d.evicted]
        for m in d.evicted:
            self.port.kill_worker(m)

    def taken_out(self, fault_at: float) -> None:
        """A fault took a replica group out: the first since they were all whole starts the
        time to whole again."""
        if self.out_since is None:
            self.out_since = fault_at

    def forget_node(self, node: int) -> None:
        """A lost node's devices are gone: no group's rank starts there any more."""
        self.joiners_to_start = [r for r in self.joiners_to_start if r[0] != node]

    def detach(self) -> None:
        """The attempt is over: its store goes."""
        self.store = None

    def node_entered(self) -> None:
        """A node entered the running job: the stopped ranks start again to meet its workers
        (after the live groups' first commit, if it has not come yet); started earlier they
        would wait for it past their first generation's timeout."""
        partners, self.partners = self.partners, []
        if not self._committed:
            self.joiners_to_start += partners
            return
        for node, local_rank in partners:
            if node in self.port.live_nodes():
                self.gens.spawn(node, local_rank, R.JOINING)

    def grow_ready(self) -> None:
        """Groups that span nodes: ready workers enter once they make whole groups."""
        batch = entering_groups(self.membership.with_role(R.READY),
                                len(self.membership.with_role(R.JOINING)), self.spec.shard_size)
        if batch:
            self.gens.grow(batch)

    def node_waits(self, first_size: int) -> str | None:
        """Groups that span nodes have no spare workers: a node joining the running job
        waits while the members, the workers starting and those owed a start already make
        the first world size (`first_size`); None: it may enter."""
        ms = self.membership
        coming = len(ms.members) + len(ms.with_role(R.JOINING, R.READY)) + len(
            self.joiners_to_start) + len(self.partners)
        if not self.spanning or coming < first_size:
            return None
        return "the replica groups are whole (they span nodes); it enters when a node is lost"

    def lost_late(self, d: FaultDecision, lost: int, live: tuple[int, ...],
                         why: str) -> None:
        """A group lost after its last step: no commit will come, so its replacement (a
        ready spare group, or a fresh one) enters as soon as it is ready."""
        group = [(m, live.index(m)) for m in (lost, *d.evicted)]
        what = f"replica group of worker {lost}, which {why} after its last step"
        regrow = bool(self._calling_in) or bool(self.joiners_to_start)
        self.ends.after_late_group_fault(group, what, regrow)
        while self._calling_in:
            spares = self._calling_in.pop(0)
            if self._all_ready(spares):
                self.gens.grow(spares)
        while self.joiners_to_start:
            node, local_rank = self.joiners_to_start.pop(0)
            self.gens.spawn(node, local_rank, R.JOINING)

    def after_first_commit(self) -> None:
        """The groups left went on: spare groups called in now enter at a step boundary
        (those that died meanwhile are dropped), new spare groups start."""
        while self._calling_in:
            group = self._calling_in.pop(0)
            if self._all_ready(group):
                self.gens.grow(group)
        self._refill()
        self._committed = True
        live = self.port.live_nodes()
        self.joiners_to_start = [p for p in self.joiners_to_start if p[0] in live]

    def take_joiners_to_start(self) -> list[tuple[int, int]]:
        """The ranks of groups coming back whole, (node, local rank), to start now; they are
        the starter's from here on."""
        joiners, self.joiners_to_start = self.joiners_to_start, []
        return joiners

    def _ready_spare_group(self, node: int) -> tuple[int, ...]:
        """The oldest spare group whose every member is ready, on `node` first."""
        ready = [g for g in self.spares if self._all_ready(g)]
        ready.sort(key=lambda g: node_of(g[0]) != node)
        return ready[0] if ready else ()

    def _all_ready(self, group: tuple[int, ...]) -> bool:
        return all(self.membership.role(w) is R.SPARE for w in group)

    def _place_of(self, worker_id: int) -> tuple[int, int]:
        """(node, local rank) of a worker this job started."""
        for w in self.port.all_workers():
            if w.worker_id == worker_id:
                return node_of(worker_id), w.local_rank
        raise KeyError(worker_id)

    # ------------------------------------------------------------ spare groups
    def start_spare_group(self, node: int, index: int,
                          devices: list[int] | None = None) -> None:
        """`shard_size` spares whose group is written to the store before any of them
        reads it (their devices follow the node's workers: nproc + index * size + k, or
        `devices`: those a lost or dead group left free)."""
        size = self.spec.shard_size
        ids = [self.port.allocate_id(node) for _ in range(size)]
        for wid in ids:
            self.store.set(spare_group_key(wid), ",".join(map(str, ids)))
        for k, wid in enumerate(ids):
            device = devices[k] if devices else self.spec.nproc + index * size + k
            self.port.place(wid, rank=-1, local_rank=device, spare=True)
            self.membership.move(wid, R.STARTING_SPARE)
        self.spares.append(tuple(ids))

    def on_spare_exit(self, wid: int, what: str) -> None:
        """A spare of a group ended: the group is no use without it. Its other members are
        stopped and, unless spares keep dying (a crash loop), a new group is started."""
        group = next((g for g in self.spares if wid in g), ())
        if not group:
            return
        self.spares.remove(group)
        others = [m for m in group if m != wid]
        self.membership.leave(others)
        for m in others:
            self.port.kill_worker(m)
        node = node_of(wid)
        if self.respawns.allowed(("spare", node), what, "spare groups"):
            self.start_spare_group(node, 0, self._devices_of(group))

    def _devices_of(self, group: tuple[int, ...]) -> list[int]:
        return sorted(self._place_of(m)[1] for m in group)

    def _refill(self) -> None:
        while self._refills:
            node, devices = self._refills.pop(0)
            if node in self.port.live_nodes():
                self.start_spare_group(node, 0, devices)

    # ------------------------------------------------------------ the groups' return
    def back_in_service(self, req: Recovered) -> None:
        """Replica groups out since a fault are all back: the job's first commit at full
        strength, timed from that fault."""
        full = len(self.membership.live()) >= len(self.port.initial_members())
        if self.out_since is None or not full or req.fault_at:
            return
        ms = (req.first_commit - self.out_since) * 1000
        notice(self.port.emit, f"replica groups back in service: generation "
                               f"{req.generation} committed step {req.step} at "
                               f"full size, {ms:.0f} ms after the fault")
        self.out_since = None
