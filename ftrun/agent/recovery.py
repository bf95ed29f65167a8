"""The agent's side of in-process recovery: generations, spares, joiners, worker requests.

Owns: the attempt's `Membership` (who is what, the generation), publishing generation records,
the worker requests the agent's reader delivers (hello, comm_failed, suspect, recovered), doing
what `policy` decides on a member's fault, a node's loss or a stuck communicator (replace with a
spare or a new process, shrink then grow, rebuild), and keeping the spare pool full.
Must not import: typer, rich, the CLI, the worker library, the agent (it reaches the node
through `ports.RecoveryPort`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ftrun.agent.corruption import Corruptions, rolled_back
from ftrun.agent.drains import Drains
from ftrun.agent.generations import Generations, Respawns
from ftrun.agent.inbox import Inbox
from ftrun.agent.node_losses import NodeLoss, NodeLosses
from ftrun.agent.ports import RecoveryPort
from ftrun.agent.redo import EnterLater
from ftrun.agent.replica_groups import ReplicaGroups
from ftrun.agent.reports import event_of
from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.agent.script_ends import ScriptEnds
from ftrun.agent.spares import Spares, near
from ftrun.core import timeouts
from ftrun.core.events import FaultFields, TrainedFields, emit_as, notice
from ftrun.core.exits import EXIT_CORRUPT, describe_exit
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import (
    Action,
    Decision,
    FaultAction,
    Snapshot,
    decide_comm_failure,
    decide_fault,
    decide_late_fault,
    decide_rebuild,
    stop_decision,
)
from ftrun.protocol.rendezvous import (
    CommFailed,
    Corruption,
    Generation,
    Healed,
    Hello,
    Recovered,
    Request,
    Resumed,
    Stage,
    StateSize,
    Suspect,
    node_of,
    publish,
)
from ftrun.protocol.snapshots import EXIT_CANNOT_RESUME

AnyWorker = Worker | RemoteWorker
R = WorkerRole


class Recovery:
    def __init__(self, port: RecoveryPort, store: Any, adopted: Membership | None = None,
                 store_at: str = "") -> None:
        """`adopted`: a running attempt's membership, taken over on the store at `store_at`."""
        self.port = port
        self.spec = port.spec
        self.store = store
        self.membership = adopted or Membership(port.initial_members())
        self.faults = 0
        self.inbox = Inbox(port.wake, lambda text: notice(port.emit, text))
        self._known: set[int] = set()  # workers this job started, as last looked up
        self._reported: set[int] = set()  # generations whose recovery was announced
        self.ends = ScriptEnds()  # past training: scripts ended, post-training work owed
        self.gens = Generations(port, store, self.membership, self.ends, store_at)
        self.respawns = Respawns(port, self._snapshot)
        self.groups = ReplicaGroups(self.spec, port, store, self.membership, self.ends,
                                    self.gens, self.respawns)
        self.later = EnterLater(self.spec, self.gens, self.membership)  # --redo lost
        self.spares = Spares(self.spec, self.gens, self.respawns, self.groups, self.later,
                             self.membership)
        self.drains = Drains(port, self.gens, self.membership, self._snapshot)
        self.corruptions = Corruptions(self.port.emit)
        self.node_losses = NodeLosses(self.spec, port.emit, self.membership, self.spares,
                                      self.groups, self.gens, self._count_faults,
                                      self._snapshot, self._highest_committed)
        self._trained_told = False  # a member left its training loop: the journal was told
        if adopted is None:
            first = Generation(0, self.membership.members, "start", published_at=time.time())
            port.fence_generation(first)
            publish(store, first, self.gens.relays())

    def detach(self) -> None:
        """The attempt is over: its store goes; nothing is published any more."""
        self.store = None
        self.gens.detach()
        self.groups.detach()

    @property
    def uses_api(self) -> bool:
        return self.membership.uses_api

    def deliver(self, raw: str | bytes) -> None:  # the request reader's thread
        self.inbox.deliver(raw)

    def _snapshot(self, **extra: Any) -> Snapshot:
        step, resumes = self.port.resumable()
        return self.membership.snapshot(
            snapshot_step=step, snapshot_resumes=resumes,
            faults=self.faults, max_faults=self.spec.max_faults,
            restarts_left=self.spec.max_restarts - self.port.restarts,
            on_fault=self.spec.on_fault, min_nproc=self.spec.min_nproc,
            min_nodes=self.spec.nnodes_min, **extra)

    # ------------------------------------------------------------ worker exits
    def owns(self, w: AnyWorker) -> bool:
        """Once one worker said hello the script uses the API: every exit is an in-process
        fault, a replacement's that died before its own hello included."""
        return self.uses_api or not self.membership.is_member(w.worker_id)

    def on_exit(self, w: AnyWorker) -> Decision | None:
        """A worker that uses the ftrun API ended. None: handled, training goes on."""
        assert w.exit is not None
        wid, code, role = w.worker_id, w.exit.returncode, self.membership.role(w.worker_id)
        node = node_of(wid)
        taker = self.drains.owns(wid)
        self.drains.exited(wid, code)  # a leaver out, or a drain's taker lost: plans again
        if taker:  # started or kept to take a leaver's rank: the drain follows it up
            self.membership.leave([wid])
            self.faults += code != 0
            return None
        if role in (R.JOINING, R.READY):  # died before joining
            self.membership.leave([wid])
            self.faults += 1
            what = f"joining worker {wid} exited with {describe_exit(code)} before joining"
            if self.respawns.allowed(("join", node), what, "replacements"):
                self.gens.spawn(node, w.local_rank, R.JOINING)
            elif self.ends.training_over(self.membership.members):
                self.ends.no_group_coming()
                self._release_if_ended()
            self._grow_if_ready(node)
            return None
        if role in (R.SPARE, R.STARTING_SPARE):
            self.membership.leave([wid])
            self.faults += code != 0
            self.spares.exited(wid, node, w.local_rank, code)
            return None
        if not self.membership.is_member(wid):
            return None  # replaced or evicted earlier; its end is expected
        if code == EXIT_CANNOT_RESUME:  # its snapshot does not fit; nor would a replacement's
            return Decision(Action.FAIL, f"worker {wid} could not resume from a snapshot", w.rank)
        if code != 0 and not self.ends.ended(wid):
            self._take_queued()  # a stage it told just before it died decides the fault
        if code == 0 or self.ends.ended(wid):
            if code != 0:  # its script had ended: its work is done, it cannot heal anyone
                notice(self.port.emit, f"worker {wid} exited with "
                                       f"{describe_exit(code)} after its script ended")
            self.membership.move(wid, R.FINISHED)
            self._release_if_ended()
            return None
        self.faults += 1
        told = self.corruptions.on_exit(wid) if code == EXIT_CORRUPT else None
        why, corrupt = told or (f"exited with {describe_exit(code)}", None)
        return self._on_member_fault(w, why, corrupt)

    def _take_queued(self) -> None:
        """Requests already queued that decide a fault (a stage, a corruption a worker told
        before it left): the rest waits for the main loop's turn."""
        self.catch_up()
        for req in self.inbox.take((Stage, Corruption)):
            self._act_on(req)

    def _on_stage(self, req: Stage) -> None:
        if req.stage == "trained" and not self._trained_told:  # the journal's end of training
            self._trained_told = True
            emit_as(self.port.emit, TrainedFields(req.step, req.worker))
        refused = self.ends.on_stage(req)
        if refused:
            notice(self.port.emit, refused)
        self._release_if_ended()

    def _release_if_ended(self) -> None:
        ms = self.membership
        self.ends.release_if_ended(self.store, ms.generation, ms.members, ms.finished)

    def end_decision(self) -> Decision:
        """Every member finished: the run's verdict (a rank lost after its last step and
        never replaced fails it)."""
        d = self.ends.verdict()
        if d.action is Action.FAIL:
            notice(self.port.emit, d.reason)
        return d

    def _on_member_fault(self, w: AnyWorker, why: str,
                         corrupt: Corruption | None) -> Decision | None:
        assert w.exit is not None
        live = self.membership.live()
        node = node_of(w.worker_id)
        new_id = self.port.peek_id(node)  # allocated only if a new worker is started
        snap = self._snapshot()
        loop = self.respawns.rank_loop(live.index(w.worker_id),
                                       self.membership.role(w.worker_id) is R.HEALING)
        snap = replace(snap, spares=near(snap.spares, node),
                       starting_spares=near(snap.starting_spares, node))
        fault_at = w.exit.wall_time
        late = self.ends.training_over(self.membership.members)
        if self.spec.shard_size > 1:
            d = self.groups.decide(snap, w.worker_id,
                                   f"{why} after its last step" if late else why, loop)
        elif late:
            d = decide_late_fault(snap, w.worker_id, why, new_id, crash_loop=loop)
            self.ends.after_late_fault(w.worker_id, live.index(w.worker_id), why, d)
        else:
            d = self.later.reword(decide_fault(snap, w.worker_id, why, new_id, crash_loop=loop))
        fault = FaultFields(w.worker_id, live.index(w.worker_id), d.action, d.reason, why,
                            detected_at=w.exit.wall_time,
                            committed_before=self._highest_committed())
        emit_as(self.port.emit, fault if corrupt is None else rolled_back(fault, corrupt))
        if self.spec.shard_size > 1 and d.action is FaultAction.SHRINK:
            self.groups.act_on_fault(d, w.worker_id, fault_at)
            if late:
                self.groups.lost_late(d, w.worker_id, live, why)
            return None
        if d.action is FaultAction.REPLACE and self.later.on and not late:
            return self.later.replace(d, fault_at, (node, w.local_rank), self.spares.refill,
                                      self.spares.join_later)
        if d.action is FaultAction.REPLACE:
            # published first: the survivors re-form while the replacement starts
            self.gens.publish(d.members, d.reason, True, fault_at, d.joiners)
            if d.spare_used is not None:  # ready or still starting: the pool is one short
                self.spares.refill((node, w.local_rank))  # the lost device: a spare
            else:
                self.gens.spawn(node, w.local_rank, rank=d.members.index(d.joiners[0]))
            return None
        if d.action in (FaultAction.SHRINK, FaultAction.FAIL_AT_END):
            self.gens.publish(d.members, d.reason, True, fault_at)
            self._release_if_ended()
            if d.regrow:
                self.spares.join_later((node, w.local_rank))
            return None
        return stop_decision(d, w.rank)

    def _count_faults(self, n: int) -> None:
        self.faults += n

    def _highest_committed(self) -> int:
        """The highest step committed before a fault (the journal's lost work counts from it)."""
        return self.port.highest_committed(self.membership.members)

    def rebuild(self, reason: str) -> bool:
        """The group is stuck, no member to blame: a new communicator (False: over budget)."""
        self.faults += 1
        d = decide_rebuild(self._snapshot(), reason)
        if d.action is FaultAction.NONE:
            notice(self.port.emit, d.reason)
            return False
        emit_as(self.port.emit, FaultFields(-1, -1, d.action, d.reason, "comm",
                                            detected_at=time.time(),
                                            committed_before=self._highest_committed()))
        self.gens.publish(d.members, d.reason, True, time.time())
        return True

    # ------------------------------------------------------------ growing back
    def add_joiners(self, wids: list[int]) -> None:
        """A node joined a running job: its workers enter together once each said hello."""
        for wid in wids:
            self.membership.move(wid, R.JOINING)
        self.groups.node_entered()  # groups spanning nodes: their stopped ranks meet it

    def add_spares(self, wids: list[int]) -> None:
        """A node joined a job already at its size: its workers wait as spares once ready."""
        for wid in wids:
            self.membership.move(wid, R.STARTING_SPARE)

    def _grow_if_ready(self, node: int) -> None:
        if self.groups.spanning:  # a group spanning nodes enters whole, whatever the node
            return self.groups.grow_ready()
        if any(node_of(w) == node for w in self.membership.with_role(R.JOINING)):
            return  # the rest of its node is still starting
        batch = tuple(w for w in self.membership.with_role(R.READY) if node_of(w) == node)
        if batch:
            self.gens.grow(batch)

    def on_node_lost(self, node: int, label: str, lost: list[AnyWorker], nodes_left: int,
                     last_seen: float, nodes_waiting: int = 0) -> Decision | None:
        """Every worker of `node` is gone at once: one decision, one generation.
        `nodes_left`: the job's nodes after it, `nodes_waiting` of them not admitted yet."""
        return self.on_nodes_lost([NodeLoss(node, label, tuple(lost), last_seen)], nodes_left,
                                  nodes_waiting)

    def on_nodes_lost(self, losses: Sequence[NodeLoss], nodes_left: int,
                      nodes_waiting: int = 0) -> Decision | None:
        """Every node lost in one pass, decided together (`node_losses.NodeLosses`)."""
        return self.node_losses.decide(losses, nodes_left, nodes_waiting)

    def done(self) -> bool:
        return self.membership.done()

    # ------------------------------------------------------------ requests
    def handle_requests(self) -> Decision | None:
        """Act on what workers asked; a Decision when the run cannot go on in-process."""
        while (req := self.inbox.next(self._started)) is not None:
            decision = self._act_on(req)
            if decision is not None:
                return decision
        self.drains.tick(time.time())
        return self.drains.decision()  # a requeue, once every member left

    def _started(self, worker_id: int) -> bool:  # per request: acting on one can start spares
        if worker_id not in self._known:  # looked up again only for one not seen yet: every
            self._known = {w.worker_id for w in self.port.all_workers()}  # request scanning
        return worker_id in self._known  # them all cost O(N²) (8,192 hellos: seconds)

    def _act_on(self, req: Request) -> Decision | None:
        match req:
            case Hello():
                self._on_hello(req)
            case CommFailed() if req.generation == self.membership.generation and \
                    self.membership.is_member(req.worker):  # else stale: fenced by number
                return self._on_comm_failed(req)
            case Suspect():
                self.port.suspect()
            case Resumed() | Healed() | StateSize():
                emit_as(self.port.emit, event_of(req))
            case Recovered():
                self._committed_first(req.worker)
                if req.generation not in self._reported:
                    self._reported.add(req.generation)  # the first member to commit
                    emit_as(self.port.emit, event_of(req))
                    self.groups.back_in_service(req)
                    self.later.committed()
                    self.drains.recovered(req)
                    if not self.ends.training_over(self.membership.members):
                        self.spares.after_first_commit()  # past training: they'd serve nothing
            case Stage():
                self._on_stage(req)
            case Corruption():
                self.faults += self.corruptions.on_request(req, self.membership.live())
        return None

    def _on_hello(self, req: Hello) -> None:
        ms, wid = self.membership, req.worker
        if not ms.uses_api:  # the script uses the API: now spares are worth starting
            for node in self.port.live_nodes():
                self.spares.start_pool(node)
        ms.said_hello(wid)
        drains = self.drains.owns(wid)  # a drain's taker: ready, it enters with the swap
        if req.spare and ms.role(wid) is R.STARTING_SPARE:  # one called in while starting is
            ms.move(wid, R.SPARE)  # HEALING by now: its hello changes nothing
            if not drains:
                self.later.hello(wid)
        if ms.role(wid) is R.JOINING:
            ms.move(wid, R.READY)
            if not drains:
                self._grow_if_ready(node_of(wid))
        if drains:
            self.drains.hello(wid)

    def _on_comm_failed(self, req: CommFailed) -> Decision | None:
        live = self.membership.live()
        self.faults += 1
        d = decide_comm_failure(self._snapshot(), req.worker, req.error)
        emit_as(self.port.emit, FaultFields(
            req.worker, live.index(req.worker) if req.worker in live else -1, d.action,
            d.reason, "comm", detected_at=time.time(),
            committed_before=self._highest_committed()))
        if d.action is not FaultAction.REBUILD:
            return stop_decision(d, None)
        self.gens.publish(d.members, d.reason, True, time.time())
        return None

    def _committed_first(self, wid: int) -> None:
        """A joiner holds committed state now: the crash-loop counts behind it start over."""
        if self.membership.role(wid) is not R.HEALING:
            return
        self.membership.move(wid, R.MEMBER)
        members = self.membership.members
        self.respawns.committed(node_of(wid), members.index(wid) if wid in members else None)

    def catch_up(self, timeout_s: float = timeouts.REQUEST_CATCH_UP_S) -> None:
        self.inbox.catch_up(self.store, timeout_s)

