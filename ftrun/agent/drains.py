"""Planned leaves on the agent's side: a drain from its request to its end, make before break.

Owns: `Drains`, the attempt's drains (`ftrun drain`, a preemption notice, a degrading GPU):
each is planned by `core.drains.plan_drain`; what takes a leaver's rank is made ready first
(a ready spare at once, a starting spare or a new worker once it said hello), then one planned
generation swaps them in at a step boundary the members agree on (no collective is abandoned,
no communicator torn down mid-transfer, the step of the swap is not repeated); the leavers,
left out of it, exit at that boundary. A job with nowhere to go publishes a generation without
members whose leavers snapshot first, and ends for its scheduler to requeue it. Deadlines
(the drain window) fall back to a shrink, or to the requeue. Every phase is an event and a
row of `ftrun status`.
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ftrun.agent.generations import Generations
from ftrun.agent.ports import RecoveryPort
from ftrun.core.drains import (
    DrainPlan,
    DrainRequest,
    DrainState,
    Handover,
    check_drain_move,
    new_members,
    plan_drain,
)
from ftrun.core.events import DrainFields, emit_as
from ftrun.core.exits import describe_exit
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import Action, Decision, Snapshot
from ftrun.protocol.rendezvous import Recovered, node_of

R = WorkerRole
READY = (R.SPARE, R.READY)  # a taker that said hello: its swap may be published
WAITED = (R.STARTING_SPARE, R.JOINING)  # a taker still starting


@dataclass
class Drain:
    id: int
    request: DrainRequest
    plan: DrainPlan
    state: DrainState = DrainState.WAITING
    takers: dict[int, int | None] = field(default_factory=dict)  # leaver -> its taker
    phases: dict[str, float] = field(default_factory=dict)  # phase -> wall clock
    generation: int | None = None  # the swap's
    left: set[int] = field(default_factory=set)  # leavers that exited
    stall_ms: float | None = None  # the members' boundary at the swap: rebuilt and healed
    reason: str = ""

    @property
    def over(self) -> bool:
        return self.state in (DrainState.DONE, DrainState.REFUSED, DrainState.REQUEUE)


class Drains:
    def __init__(self, port: RecoveryPort, gens: Generations, membership: Membership,
                 snapshot: Callable[[], Snapshot]) -> None:
        self.port = port
        self.gens = gens
        self.membership = membership
        self.snapshot = snapshot
        self.all: list[Drain] = []
        self._requeue: Drain | None = None  # the job ends for its scheduler once it is out
        self._out: tuple[int, ...] = ()  # the members it waits for: every one of the job

    # ------------------------------------------------------------ a request
    def start(self, req: DrainRequest) -> Drain:
        """Plan the drain and make its takers ready; a refusal ends it at once. A leaving
        node that takes every member with it, other nodes' too (the c10d store goes with it),
        takes the whole job: no spare anywhere can keep it."""
        whole = req.node_leaves and set(self.membership.live()) <= set(req.leavers) and \
            any(node_of(m) != req.node for m in req.leavers)
        leaving = frozenset(w for w in self.membership.with_role(R.SPARE, R.STARTING_SPARE)
                            if whole or (req.node is not None and node_of(w) == req.node))
        plan = plan_drain(self.snapshot(), req.leavers, req.what, node_leaves=req.node_leaves,
                          reserved=self._reserved(), leaving_spares=leaving)
        drain = Drain(len(self.all) + 1, req, plan, phases={"requested": time.time()},
                      reason=plan.reason)
        self.all.append(drain)
        self._emit(drain)
        if plan.state is DrainState.REFUSED:
            self._move(drain, DrainState.REFUSED)
        elif plan.state is DrainState.REQUEUE:
            self._requeue_now(drain)
        else:
            for h in plan.handovers:
                drain.takers[h.leaver] = h.taker if not h.new else self._start_new(h)
            self._advance(drain)
        return drain

    def _reserved(self) -> frozenset[int]:
        return frozenset(t for d in self.all if not d.over for t in d.takers.values()
                         if t is not None)

    def _start_new(self, h: Handover) -> int:
        """A new worker on the leaver's node, on the device the starter picks."""
        local = next((w.local_rank for w in self.port.all_workers()
                      if w.worker_id == h.leaver), 0)
        return self.gens.spawn(node_of(h.leaver), local, R.JOINING)

    def _advance(self, drain: Drain) -> None:
        """Every taker ready: publish the swap (planned: it lands at a step boundary)."""
        if drain.state is not DrainState.WAITING:
            return
        role = self.membership.role
        for taker in list(drain.takers.values()):  # a fault took that spare meanwhile
            if taker is not None and role(taker) not in (*READY, *WAITED):
                self._replan(drain, taker)
                return  # _replan advances again
        if any(t is not None and role(t) not in READY for t in drain.takers.values()):
            return
        drain.phases["ready"] = time.time()
        members = new_members(self.membership.live(), drain.takers)
        joiners = tuple(t for t in drain.takers.values() if t is not None)
        self.gens.publish(members, f"planned: {drain.reason}", False, joiners=joiners)
        drain.generation = self.membership.generation
        drain.phases["published"] = time.time()
        self._move(drain, DrainState.PUBLISHED)

    def _requeue_now(self, drain: Drain) -> None:
        """Nowhere to go: every member leaves at the next step boundary, its node's replica
        taking a snapshot first; the attempt then ends for its scheduler to requeue it."""
        self._out = self.membership.live()
        self.gens.publish((), f"planned: {drain.reason}; snapshot and requeue", False,
                          snapshot_first=True)
        drain.generation = self.membership.generation
        drain.phases["published"] = time.time()
        self._requeue = drain
        self._move(drain, DrainState.REQUEUE)

    # ------------------------------------------------------------ what happens meanwhile
    def owns(self, worker_id: int) -> bool:
        """A worker started or reserved to take a rank: the agent's usual grow leaves it."""
        return any(worker_id in d.takers.values() for d in self.all
                   if d.state is DrainState.WAITING)

    def hello(self, worker_id: int) -> None:
        for drain in self.all:
            if worker_id in drain.takers.values():
                self._advance(drain)

    def exited(self, worker_id: int, code: int = 0) -> None:
        """A leaver left (the swap landed), or a taker died before it entered: the next spare
        is planned for that leaver, or the drain is refused. A leaver that ended before its
        swap (its training over, or a fault) ends the drain: there is nothing to hand over."""
        for drain in self.all:
            if drain.state is DrainState.PUBLISHED and worker_id in drain.takers:
                drain.left.add(worker_id)
                drain.phases.setdefault("left", time.time())
                self._finish_if_done(drain)
            elif drain.state is DrainState.WAITING and worker_id in drain.takers.values():
                self._replan(drain, worker_id)
            elif drain.state is DrainState.WAITING and worker_id in drain.takers:
                why = ("its script ended first" if code == 0 else
                       f"it exited with {describe_exit(code)} first (a fault, recovered as one)")
                self._move(drain, DrainState.REFUSED, f"worker {worker_id} needs no handover: "
                           f"{why}")

    def _replan(self, drain: Drain, dead: int) -> None:
        leaver = next(k for k, v in drain.takers.items() if v == dead)
        plan = plan_drain(self.snapshot(), (leaver,), drain.request.what,
                          node_leaves=drain.request.node_leaves, reserved=self._reserved())
        if plan.state is not DrainState.WAITING:
            self._move(drain, DrainState.REFUSED, f"worker {dead} taking rank of worker "
                       f"{leaver} ended before the swap; {plan.reason}")
            return
        (h,) = plan.handovers
        drain.takers[leaver] = h.taker if not h.new else self._start_new(h)
        self._advance(drain)

    def recovered(self, req: Recovered) -> None:
        """The swap's generation committed: the members' boundary cost it (rebuilt, healed)."""
        for drain in self.all:
            if drain.generation == req.generation and drain.state is DrainState.PUBLISHED:
                drain.phases["first_commit"] = req.first_commit
                drain.stall_ms = round((req.healed - req.noticed) * 1000, 1)
                self._finish_if_done(drain)

    def _finish_if_done(self, drain: Drain) -> None:
        if "first_commit" in drain.phases and drain.left >= set(drain.takers):
            self._move(drain, DrainState.DONE)

    def tick(self, now: float) -> None:
        """A drain whose takers are not ready by its deadline: a notice's node is going away,
        so the job shrinks where it may, else it requeues; `ftrun drain` is refused."""
        for drain in self.all:
            if drain.state is not DrainState.WAITING or now < drain.request.deadline:
                continue
            if not drain.request.node_leaves:
                self._move(drain, DrainState.REFUSED, "its replacement was not ready within "
                           "the drain window (--drain-window)")
                continue
            role = self.membership.role
            drain.takers = {k: (v if v is not None and role(v) in READY else None)
                            for k, v in drain.takers.items()}
            survivors = len(self.membership.live()) - sum(v is None for v in
                                                          drain.takers.values())
            if survivors >= max(1, self.snapshot().min_nproc):
                drain.reason += "; the window ran out: the job shrinks"
                self._advance(drain)
            else:
                drain.reason += "; the window ran out with nowhere to go"
                self._requeue_now(drain)

    def decision(self) -> Decision | None:
        """The attempt ends for its scheduler once every member left (snapshot taken)."""
        drain = self._requeue
        if drain is None:
            return None
        role = self.membership.role
        if any(role(m) not in (R.GONE, R.FINISHED) for m in drain.request.leavers) or \
                any(w.alive for w in self.port.all_workers()
                    if w.worker_id in {*drain.takers, *drain.request.leavers, *self._out}):
            return None
        return Decision(Action.REQUEUE, f"{drain.reason}; snapshot taken, requeue the job")

    # ------------------------------------------------------------ telling
    def _move(self, drain: Drain, to: DrainState, why: str = "") -> None:
        check_drain_move(drain.state, to)
        drain.state = to
        if why:
            drain.reason = f"{drain.reason}; {why}"
        drain.phases[to.value] = time.time()
        self._emit(drain)

    def _emit(self, drain: Drain) -> None:
        start = drain.phases["requested"]
        emit_as(self.port.emit, DrainFields(
            drain.id, drain.request.what, drain.state.value, drain.reason, drain.request.token,
            drain.request.leavers, tuple(t for t in drain.takers.values() if t is not None),
            drain.request.deadline, drain.generation, drain.stall_ms,
            {k: round((v - start) * 1000, 1) for k, v in drain.phases.items()}))
