"""Pure decisions: given what the agent observed, what to do next and why.

Owns every recovery decision: whole-group restarts (`decide_group`), and, from one frozen
`Snapshot` of the membership and the budgets, a lost member (`decide_fault`, and
`decide_late_fault` after training), a lost node (`decide_node_loss`), a communicator failure
(`decide_comm_failure`), a rebuild (`decide_rebuild`) and whether to start another joiner or
spare (`decide_respawn`). The detectors that feed them (lost nodes, hangs, stragglers) live in
`ftrun.core.detectors`; their names are importable from here too. No I/O, no clocks read
here: callers pass `now` where time matters, and every decision carries a human-readable
reason that `ftrun status` and the event log show as is.
Must not import: anything but the standard library, `ftrun.core.exits`, `ftrun.core.states`
and `ftrun.core.detectors`.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

# the detectors' names, where the agent and the tests have always imported them from
from ftrun.core.detectors import HANG_MIN_S as HANG_MIN_S
from ftrun.core.detectors import HANG_STEPS as HANG_STEPS
from ftrun.core.detectors import HANG_WARMUP_S as HANG_WARMUP_S
from ftrun.core.detectors import Hang as Hang
from ftrun.core.detectors import Liveness as Liveness
from ftrun.core.detectors import find_hang as find_hang
from ftrun.core.detectors import find_lost_nodes as find_lost_nodes
from ftrun.core.detectors import find_straggler as find_straggler
from ftrun.core.detectors import hang_timeout as hang_timeout
from ftrun.core.detectors import phase_text as phase_text
from ftrun.core.detectors import replace_after_rebuild as replace_after_rebuild
from ftrun.core.exits import describe_exit
from ftrun.core.faultkinds import FaultAction as FaultAction
from ftrun.core.options import OnFault


class Action(str, enum.Enum):
    WAIT = "wait"  # nothing to do yet
    SUCCEED = "succeed"  # every worker exited 0
    RESTART_GROUP = "restart-group"  # torchrun semantics: stop all, start all again
    FAIL = "fail"  # stop all and report
    REQUEUE = "requeue"  # a notice with nowhere to go: every member left after a snapshot


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    culprit: int | None = None  # the rank that caused it, when there is one


def decide_group(exits: Mapping[int, int | None], first_failure: int | None,
                 restarts_used: int, max_restarts: int) -> Decision:
    """Whole-group semantics for scripts that do not use the ftrun worker API.

    `exits` maps rank -> return code (None while running); `first_failure` is the rank whose
    failure the agent saw first, if any.
    """
    if first_failure is not None:
        code = exits[first_failure]
        what = f"rank {first_failure} exited with {describe_exit(code if code is not None else 1)}"
        if restarts_used < max_restarts:
            return Decision(Action.RESTART_GROUP,
                            f"{what}; restarting all workers ({restarts_used + 1}/{max_restarts})",
                            first_failure)
        if max_restarts:
            why = f"{what}; all {max_restarts} restarts used"
        else:
            why = f"{what}; no restarts allowed (--max-restarts 0)"
        return Decision(Action.FAIL, why, first_failure)
    if exits and all(code == 0 for code in exits.values()):
        return Decision(Action.SUCCEED, f"all {len(exits)} workers exited 0")
    return Decision(Action.WAIT, "workers running")


@dataclass(frozen=True)
class FaultDecision:
    action: FaultAction
    reason: str
    members: tuple[int, ...] = ()  # the next generation's members, rank order
    joiners: tuple[int, ...] = ()  # members that must heal from a peer
    spare_used: int | None = None
    regrow: bool = True  # SHRINK: start a replacement to grow back later
    evicted: tuple[int, ...] = ()  # live members stopped with the lost one (its replica group)


@dataclass(frozen=True)
class Snapshot:
    """What the agent knows when it decides. `faults` counts the one being decided."""

    members: tuple[int, ...]  # live members (finished ones excluded), rank order
    spares: tuple[int, ...] = ()  # ready spares; for a member fault, its node's first
    unhealed: frozenset[int] = frozenset()  # joiners without committed state: no source
    faults: int = 0
    max_faults: int = 0
    restarts_left: int = 0
    on_fault: OnFault = OnFault.REPLACE
    min_nproc: int = 1
    nodes_left: int = 1  # the job's nodes after a node loss, those waiting to join included
    nodes_waiting: int = 0  # ...of which this many wait to be admitted (they hold no rank)
    min_nodes: int = 1
    starting_spares: tuple[int, ...] = ()  # not ready yet, oldest first (a member fault: its
    # node's first); still ahead of a new process, so used when no ready one is left
    snapshot_step: int = -1  # the newest step a total loss can resume from (-1: no snapshot)
    snapshot_resumes: int = 0  # whole-group restarts that already resumed from that step

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_fault", OnFault(self.on_fault))  # a plain string too

    @property
    def over_budget(self) -> bool:
        return self.faults > self.max_faults


@dataclass(frozen=True)
class Respawn:
    allowed: bool
    reason: str


CRASH_LOOP_LIMIT = 3  # replacements in a row failing before their first commit: stop replacing


def _nth(n: int) -> str:
    return f"{n}{'st' if n == 1 else 'nd' if n == 2 else 'rd' if n == 3 else 'th'}"


def _s(n: int) -> str:
    return "s" if n != 1 else ""


def decide_fault(s: Snapshot, lost: int, why: str, new_worker_id: int,
                 crash_loop: int = 0) -> FaultDecision:
    """A member of the current generation is gone. Pure: the agent does what this says.
    `crash_loop`: how many replacements in a row for this rank (this one included) failed
    before their first commit."""
    rank = s.members.index(lost)
    survivors = s.members[:rank] + s.members[rank + 1:]  # slices: 32,768 members, a fault
    head = f"worker {lost} (rank {rank}) {why}"
    if s.over_budget:
        return _give_up(f"{head}; fault budget exhausted ({s.max_faults}, --max-faults)", s)
    if all(m in s.unhealed for m in survivors):  # stops at the first that can heal others
        return _total_loss(head, s)
    if crash_loop >= CRASH_LOOP_LIMIT:
        return _crash_loop(head, crash_loop, rank, survivors, s.min_nproc)
    pool = s.spares + s.starting_spares
    if s.on_fault is OnFault.REPLACE or pool:  # shrink with a spare: no need to shrink
        spare = pool[0] if pool else None
        joiner = new_worker_id if spare is None else spare
        how = f"new worker {joiner}" if spare is None else f"{_spare_kind(s, joiner)} {joiner}"
        new_members = survivors[:rank] + (joiner,) + survivors[rank:]
        return FaultDecision(FaultAction.REPLACE, f"{head}; {how} takes rank {rank}",
                             new_members, (joiner,), spare)
    if len(survivors) < s.min_nproc:
        return _give_up(f"{head}; {len(survivors)} left is below --min-nproc {s.min_nproc}", s)
    return FaultDecision(FaultAction.SHRINK,
                         f"{head}; continuing with {len(survivors)}, replacement to follow",
                         survivors)


def decide_late_fault(s: Snapshot, lost: int, why: str, new_worker_id: int,
                      crash_loop: int = 0) -> FaultDecision:
    """A member is gone after training ended (after its last step: in its post-training code,
    a per-rank save, an evaluation). A replacement heals to the final state and runs the rest
    of the script, as `decide_fault` would replace it; where that would shrink instead, the
    rank's post-training work is lost: the others end their scripts and the job fails."""
    why = f"{why} after its last step"
    d = decide_fault(s, lost, why, new_worker_id, crash_loop)
    if d.action is not FaultAction.SHRINK:
        return d
    cause = (f"the {_nth(crash_loop)} replacement in a row to fail (a crash loop)"
             if crash_loop >= CRASH_LOOP_LIMIT else
             "no spare, and --on-fault shrink does not replace it")
    return FaultDecision(FaultAction.FAIL_AT_END, f"worker {lost} (rank {s.members.index(lost)})"
                         f" {why}; {cause}: its post-training work is lost, the job fails once "
                         f"the others' scripts end", d.members, regrow=False)


def _spare_kind(s: Snapshot, wid: int) -> str:
    return "spare worker" if wid in s.spares else "starting spare worker"


def _crash_loop(head: str, count: int, rank: int, survivors: tuple[int, ...],
                min_nproc: int) -> FaultDecision:
    """The rank's replacements keep dying before they commit: a bad GPU, a broken
    environment, a deterministic crash at start-up. Starting more would loop forever."""
    loop = (f"{head}: the {_nth(count)} replacement in a row for rank {rank} to fail before "
            f"its first commit (a crash loop)")
    if len(survivors) >= min_nproc:
        return FaultDecision(FaultAction.SHRINK, f"{loop}; continuing with {len(survivors)}, "
                             f"no more replacements for it", survivors, regrow=False)
    return FaultDecision(FaultAction.FAIL, f"{loop}; {len(survivors)} left is below "
                         f"--min-nproc {min_nproc}: stopping")


def node_loss_stops(head: str, s: Snapshot) -> FaultDecision | None:
    """A node loss that ends the job before anything else is weighed: the fault budget spent,
    or fewer nodes left than --nnodes' minimum (None: neither)."""
    if s.over_budget:
        return _give_up(f"{head}; fault budget exhausted ({s.max_faults}, --max-faults)", s)
    if s.nodes_left < s.min_nodes:
        return _give_up(f"{head}; {s.nodes_left} node{_s(s.nodes_left)} left is below "
                        f"--nnodes minimum {s.min_nodes}", s)
    return None


def decide_node_loss(s: Snapshot, node: str, lost: tuple[int, ...]) -> FaultDecision:
    """A whole node is gone (agent dead or unreachable): its workers leave together, in one
    generation. Spares on the other nodes take their ranks, ready ones first, then starting
    ones; without enough of them the job goes on smaller until a node joins again."""
    gone_set = frozenset(lost)  # many nodes lost at once: a tuple's `in` made this O(N * lost)
    survivors = tuple(m for m in s.members if m not in gone_set)
    gone = len(s.members) - len(survivors)
    head = f"{node} lost with {gone} member{_s(gone)}"
    if (stop := node_loss_stops(head, s)) is not None:
        return stop
    if all(m in s.unhealed for m in survivors):
        return _total_loss(head, s)
    pool, new, joiners = list(s.spares + s.starting_spares), [], []
    for m in s.members:
        if m not in gone_set:
            new.append(m)
        elif pool:  # a spare takes the lost member's rank
            joiners.append(pool.pop(0))
            new.append(joiners[-1])
    running = s.nodes_left - s.nodes_waiting
    where = f"on {running} node{_s(running)}" + (
        f" ({s.nodes_waiting} more waiting to join)" if s.nodes_waiting else "")
    if joiners and len(joiners) == gone:
        named = ", ".join(f"{j}{'' if j in s.spares else ' (starting)'}" for j in joiners)
        return FaultDecision(FaultAction.REPLACE, f"{head}; spare workers "
                             f"{named} take their ranks {where}",
                             tuple(new), tuple(joiners))
    used = f" ({len(joiners)} spare{_s(len(joiners))} used)" if joiners else ""
    return FaultDecision(FaultAction.SHRINK, f"{head}; continuing with {len(new)} workers "
                         f"{where}{used}", tuple(new), tuple(joiners))


def decide_comm_failure(s: Snapshot, worker: int, error: str) -> FaultDecision:
    """A worker's collective failed: same members, a new communicator. Over the fault budget
    the job stops (FAIL even with restarts left, unlike `decide_fault`)."""
    reason = f"worker {worker} reported a communicator failure: {error}"
    if s.over_budget:
        return FaultDecision(FaultAction.FAIL, f"{reason}; fault budget exhausted "
                             f"({s.max_faults}, --max-faults)")
    return FaultDecision(FaultAction.REBUILD, reason, s.members)


def decide_rebuild(s: Snapshot, reason: str) -> FaultDecision:
    """No member is to blame but the group is stuck: same members, a new communicator; over
    the fault budget, NONE: nothing changes."""
    if s.over_budget:
        return FaultDecision(FaultAction.NONE, f"{reason}; fault budget exhausted "
                             f"({s.max_faults}): not rebuilding")
    return FaultDecision(FaultAction.REBUILD, reason, s.members)


def decide_respawn(s: Snapshot, what: str, kind: str, node: int, in_a_row: int,
                   node_alive: bool) -> Respawn:
    """Start another joiner or spare on `node` after `what`, unless the budget is spent, the
    node is gone, or its last CRASH_LOOP_LIMIT ones (`in_a_row`, this one included) all died
    before committing a step."""
    if s.over_budget or not node_alive:
        return Respawn(False, f"{what}; not starting another")
    if in_a_row >= CRASH_LOOP_LIMIT:
        return Respawn(False, f"{what}: {in_a_row} {kind} in a row on node {node} failed "
                              f"before their first commit (a crash loop); not starting more")
    return Respawn(True, f"{what}; starting another")


def _total_loss(head: str, s: Snapshot) -> FaultDecision:
    """No live replica is left: every worker restarts, from the newest snapshot if there is
    one (even with no --max-restarts: that is what snapshots are for), unless the restarts
    that resumed from it all died before a newer one was taken (a crash loop)."""
    if s.snapshot_step >= 0 and s.snapshot_resumes < CRASH_LOOP_LIMIT:
        return FaultDecision(FaultAction.RESTART_GROUP, f"{head}; no replica left to heal from: "
                             f"restarting all workers from the snapshot of step "
                             f"{s.snapshot_step}")
    if s.snapshot_step >= 0:
        return _give_up(f"{head}; no replica left to heal from, and the last "
                        f"{s.snapshot_resumes} restarts from the snapshot of step "
                        f"{s.snapshot_step} failed before a newer one", s)
    return _give_up(f"{head}; no replica left to heal from", s)


def _give_up(reason: str, s: Snapshot) -> FaultDecision:
    if s.restarts_left > 0:
        return FaultDecision(FaultAction.RESTART_GROUP, f"{reason}; restarting all workers")
    return FaultDecision(FaultAction.FAIL, reason)


def stop_decision(d: FaultDecision, culprit: int | None) -> Decision:
    """The run cannot go on in-process: torchrun's whole-group restart, or the end."""
    action = Action.RESTART_GROUP if d.action is FaultAction.RESTART_GROUP else Action.FAIL
    return Decision(action, d.reason, culprit)
