"""Planned leaves: who takes a leaving member's rank, and how a drain moves from request to end.

Owns: `DrainState` with its allowed transitions, `DrainRequest`, `Handover` (one leaver and
what takes its rank), `DrainPlan` and `plan_drain`, the pure decision of a drain: ready
spares first, then starting ones (never one on a node that leaves), then a new worker where
the leaver's node stays and `--on-fault replace` would replace it, else the job shrinks where
a fault would let it (`--on-fault shrink`, or a leaving node, as a lost node does) and
`--min-nproc` allows; when every member leaves and nothing can take a rank, the job has
nowhere to go (requeue). Every answer carries the reason `ftrun drain`, the event log and
`ftrun status` show.
Must not import: anything but the standard library and `ftrun.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.core.options import OnFault
from ftrun.core.policy import Snapshot
from ftrun.core.states import TextEnum


class DrainState(TextEnum):
    WAITING = "waiting"  # a replacement is starting: the leaver trains on meanwhile
    PUBLISHED = "published"  # the swap's generation is out: it lands at a step boundary
    DONE = "done"  # every leaver is out, its rank served elsewhere (or the job shrank)
    REFUSED = "refused"  # nothing can take a rank: the leavers stay
    REQUEUE = "requeue"  # nowhere to go: the job snapshots and ends for its scheduler


DRAIN_EDGES: dict[DrainState, frozenset[DrainState]] = {
    DrainState.WAITING: frozenset({DrainState.PUBLISHED, DrainState.REFUSED,
                                   DrainState.REQUEUE}),
    DrainState.PUBLISHED: frozenset({DrainState.DONE, DrainState.REFUSED,
                                     DrainState.REQUEUE}),
    DrainState.DONE: frozenset(),
    DrainState.REFUSED: frozenset(),
    DrainState.REQUEUE: frozenset(),
}


def check_drain_move(now: DrainState, to: DrainState) -> None:
    if to not in DRAIN_EDGES[now]:
        raise AssertionError(f"a drain cannot go from {now} to {to}")


@dataclass(frozen=True)
class DrainRequest:
    """What leaves, why, and by when."""

    what: str  # "rank 1", "node 2 (SIGTERM)", "gpu 0 (degraded: ...)"
    leavers: tuple[int, ...]
    deadline: float  # wall clock: the drain window's end
    node_leaves: bool = False  # a notice: the node goes away
    node: int | None = None  # the leaving node, if one does
    token: str = ""  # `ftrun drain`'s: it follows the drain in `ftrun status`


@dataclass(frozen=True)
class Handover:
    """One leaving member and what takes its rank: a spare (ready or starting), a new worker
    started on the leaver's node (`new`), or nothing (the job shrinks by one)."""

    leaver: int
    taker: int | None = None
    new: bool = False


@dataclass(frozen=True)
class DrainPlan:
    handovers: tuple[Handover, ...]
    reason: str
    state: DrainState = DrainState.WAITING  # WAITING: go on; REFUSED or REQUEUE: the end

    @property
    def shrinks(self) -> int:
        return sum(h.taker is None and not h.new for h in self.handovers)


def plan_drain(s: Snapshot, leavers: tuple[int, ...], what: str, *, node_leaves: bool,
               reserved: frozenset[int] = frozenset(),
               leaving_spares: frozenset[int] = frozenset()) -> DrainPlan:
    """The handovers of `leavers` (live members; `what` names the request in the reason).
    `node_leaves`: their node is going away (a notice): nothing new starts there, and like a
    lost node's the job may shrink. `reserved`: spares another drain counts on;
    `leaving_spares`: spares on a leaving node."""
    unknown = [w for w in leavers if w not in s.members]
    if unknown:
        return DrainPlan((), f"{what}: worker {unknown[0]} is not a member of the job",
                         DrainState.REFUSED)
    pool = [w for w in (*s.spares, *s.starting_spares)
            if w not in reserved and w not in leaving_spares]
    replace_new = s.on_fault is OnFault.REPLACE and not node_leaves
    handovers = []
    for leaver in sorted(leavers, key=s.members.index):
        if pool:
            handovers.append(Handover(leaver, pool.pop(0)))
        else:
            handovers.append(Handover(leaver, None, new=replace_new))
    plan = DrainPlan(tuple(handovers), "")
    left = len(s.members) - plan.shrinks
    if plan.shrinks and left == 0:
        return DrainPlan(plan.handovers, f"{what}: every member leaves and no spare is left "
                         "to take a rank: nowhere to go", DrainState.REQUEUE)
    may_shrink = s.on_fault is OnFault.SHRINK or node_leaves
    if plan.shrinks and (not may_shrink or left < s.min_nproc):
        why = (f"{left} left would be below --min-nproc {s.min_nproc}" if may_shrink
               else "no spare, and --on-fault shrink is not set")
        state = DrainState.REQUEUE if node_leaves else DrainState.REFUSED
        return DrainPlan(plan.handovers, f"{what}: nothing can take {plan.shrinks} "
                         f"rank{'s' if plan.shrinks != 1 else ''} ({why})", state)
    return DrainPlan(plan.handovers, f"{what}: {describe(plan.handovers, s)}")


def describe(handovers: tuple[Handover, ...], s: Snapshot) -> str:
    """`worker 1 (rank 1) hands over to spare worker 4; worker 2 (rank 2) leaves, the job
    shrinks to 3`."""
    parts = []
    for h in handovers:
        head = f"worker {h.leaver} (rank {s.members.index(h.leaver)})"
        if h.taker is not None:
            kind = "spare worker" if h.taker in s.spares else "starting spare worker"
            parts.append(f"{head} hands over to {kind} {h.taker}")
        elif h.new:
            parts.append(f"{head} hands over to a new worker")
        else:
            parts.append(f"{head} leaves")
    shrinks = sum(h.taker is None and not h.new for h in handovers)
    tail = f"; the job shrinks to {len(s.members) - shrinks}" if shrinks else ""
    return "; ".join(parts) + tail


def new_members(members: tuple[int, ...], takers: dict[int, int | None]) -> tuple[int, ...]:
    """The swap's generation: each leaver's taker in its rank, leavers without one dropped."""
    out: list[int] = []
    for m in members:
        taker = takers.get(m, m)
        if taker is not None:
            out.append(taker)
    return tuple(out)
