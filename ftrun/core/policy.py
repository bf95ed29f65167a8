"""Pure decisions: given what the agent observed, what to do next and why.

Owns every recovery decision: whole-group restarts (`decide_group`), and, from one frozen
`Snapshot` of the membership and the budgets, a lost member (`decide_fault`), a lost node
(`decide_node_loss`), a communicator failure (`decide_comm_failure`), a rebuild
(`decide_rebuild`) and whether to start another joiner or spare (`decide_respawn`). Also the
detectors that feed them: lost nodes, hangs, stragglers. No I/O, no clocks read here: callers
pass `now` where time matters, and every decision carries a human-readable reason that
`ftrun status` and the event log show as is.
Must not import: anything but the standard library, `ftrun.core.exits` and `ftrun.core.states`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.core.exits import describe_exit
from ftrun.core.states import PAUSED_PHASES, Phase


class Action(str, enum.Enum):
    WAIT = "wait"  # nothing to do yet
    SUCCEED = "succeed"  # every worker exited 0
    RESTART_GROUP = "restart-group"  # torchrun semantics: stop all, start all again
    FAIL = "fail"  # stop all and report


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


class FaultAction(str, enum.Enum):
    REPLACE = "replace"  # same world size: a spare or a new process takes the lost rank
    SHRINK = "shrink"  # go on without it now; grow back when a replacement is ready
    REBUILD = "rebuild"  # same members, a new communicator
    RESTART_GROUP = "restart-group"  # in-process recovery impossible: torchrun semantics
    FAIL = "fail"
    FAIL_AT_END = "fail-at-end"  # lost after training, not replaced: its post-training work
    # is lost; the others end their scripts, then the job fails
    NONE = "none"  # refused: nothing changes, the reason says why


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
    on_fault: str = "replace"
    min_nproc: int = 1
    nodes_left: int = 1
    min_nodes: int = 1
    starting_spares: tuple[int, ...] = ()  # not ready yet, oldest first (a member fault: its
    # node's first); still ahead of a new process, so used when no ready one is left
    snapshot_step: int = -1  # the newest step a total loss can resume from (-1: no snapshot)
    snapshot_resumes: int = 0  # whole-group restarts that already resumed from that step

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
    survivors = tuple(m for m in s.members if m != lost)
    rank = s.members.index(lost)
    head = f"worker {lost} (rank {rank}) {why}"
    if s.over_budget:
        return _give_up(f"{head}; fault budget exhausted ({s.max_faults}, --max-faults)", s)
    if not [m for m in survivors if m not in s.unhealed]:
        return _total_loss(head, s)
    if crash_loop >= CRASH_LOOP_LIMIT:
        return _crash_loop(head, crash_loop, rank, survivors, s.min_nproc)
    pool = s.spares + s.starting_spares
    if s.on_fault == "replace" or pool:  # shrink with a spare: no need to shrink
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


def decide_node_loss(s: Snapshot, node: str, lost: tuple[int, ...]) -> FaultDecision:
    """A whole node is gone (agent dead or unreachable): its workers leave together, in one
    generation. Spares on the other nodes take their ranks, ready ones first, then starting
    ones; without enough of them the job goes on smaller until a node joins again."""
    survivors = tuple(m for m in s.members if m not in lost)
    gone = len(s.members) - len(survivors)
    head = f"{node} lost with {gone} member{_s(gone)}"
    if s.over_budget:
        return _give_up(f"{head}; fault budget exhausted ({s.max_faults}, --max-faults)", s)
    if s.nodes_left < s.min_nodes:
        return _give_up(f"{head}; {s.nodes_left} node{_s(s.nodes_left)} left is below "
                        f"--nnodes minimum {s.min_nodes}", s)
    if not [m for m in survivors if m not in s.unhealed]:
        return _total_loss(head, s)
    pool, new, joiners = list(s.spares + s.starting_spares), [], []
    for m in s.members:
        if m not in lost:
            new.append(m)
        elif pool:  # a spare takes the lost member's rank
            joiners.append(pool.pop(0))
            new.append(joiners[-1])
    where = f"on {s.nodes_left} node{_s(s.nodes_left)}"
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


def find_lost_nodes(ages: Mapping[int, float], lost_after_s: float,
                    unanswered: frozenset[int] = frozenset(), ping_s: float = 0.0
                    ) -> list[tuple[int, str]]:
    """Nodes whose heartbeat has not moved for `lost_after_s` (ages in seconds, per node),
    or that let a ping go unanswered and have not beaten for `ping_s` either."""
    lost = []
    for node, age in sorted(ages.items()):
        if age >= lost_after_s:
            lost.append((node, f"no heartbeat for {age:.1f} s"))
        elif node in unanswered and age >= ping_s:
            lost.append((node, f"no answer to a ping and no heartbeat for {age:.1f} s"))
    return lost


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


HANG_STEPS = 10  # the default hang timeout: this many p95 step times...
HANG_MIN_S = 10.0  # ...and never less than this
HANG_WARMUP_S = 300.0  # until step times are measured (first-step compile, warm-up): as long
# as one collective may take (timeouts.COLLECTIVE_S), so the detector is never the stricter


@dataclass(frozen=True)
class Liveness:
    """What the agent knows of one member's progress (its progress slot, and /proc for
    whether it is stopped). CPU use is not here: it never decides."""

    worker: int
    rank: int
    step: int  # the step it works on (= steps it committed)
    idle_s: float  # since its slot last advanced (it entered its current phase)
    waiting_s: float | None  # how long it has waited in its current collective, if in one
    stopped: bool  # the process is stopped (SIGSTOP, a debugger)
    compute_s: float  # EMA of step start -> its first collective
    step_s: float  # EMA of commit -> commit
    generation: int = -1  # the generation its progress belongs to
    phase: Phase = Phase.STEP
    collective: int = 0  # collectives entered in this step (the one it waits in, if it does)
    label: str = ""  # the long phase's name
    step_p95_s: float = 0.0  # p95 of its recent step times; 0: not measured yet


@dataclass(frozen=True)
class Hang:
    worker: int | None  # None: no one is to blame, the communicator itself is stuck
    reason: str


def phase_text(phase: str, step: int, collective: int, label: str = "") -> str:
    """Where a worker is, in words (`ftrun status` and hang reasons)."""
    return {Phase.STEP: f"in step {step}'s own code",
            Phase.COLLECTIVE: f"in collective {collective} of step {step}",
            Phase.OPTIMIZER: f"in step {step}'s optimizer",
            Phase.USER: f"in user code before step {step}",
            Phase.LONG: f"in long phase {label!r}",
            Phase.RECOVERING: "recovering"}.get(phase, "starting")  # type: ignore[call-overload]


def hang_timeout(members: list[Liveness], override_s: float | None) -> float:
    """--hang-timeout exactly as given; else HANG_STEPS times the slowest member's p95 step
    time, never below HANG_MIN_S; HANG_WARMUP_S until step times are measured."""
    if override_s:
        return override_s
    p95 = max((m.step_p95_s for m in members), default=0.0)
    return max(HANG_MIN_S, HANG_STEPS * p95) if p95 > 0 else HANG_WARMUP_S


def find_hang(members: list[Liveness], timeout_s: float, world_size: int | None = None
              ) -> Hang | None:
    """Progress decides, not CPU. A member is hung when its slot has not advanced for the
    timeout while a peer has waited that long for it in a collective it has not reached (or
    when it is stopped; or, alone in its generation, when it made no progress at all). When
    every member has waited that long in one collective, the communicator is stuck. Members
    in a long phase or recovering are never blamed."""
    judged = [m for m in members if m.phase not in PAUSED_PHASES]  # their own timeouts
    for m in judged:
        if m.stopped and m.idle_s > timeout_s:
            return Hang(m.worker, f"rank {m.rank} is stopped and made no progress for "
                                  f"{m.idle_s:.1f}s")
    if (world_size or len(members)) == 1:
        lone = [m for m in judged if m.idle_s > timeout_s]
        return Hang(lone[0].worker, f"rank {lone[0].rank} made no progress for "
                                    f"{lone[0].idle_s:.1f}s ({_where(lone[0])}), with no peer "
                                    f"to wait for") if lone else None
    waiting = [m for m in members if m.waiting_s is not None and m.waiting_s > timeout_s]
    if not waiting:
        return None
    hang = _blocker(judged, waiting, timeout_s)
    if hang is None and len(waiting) == len(members):
        hang = _stuck_collective(waiting)
    return hang


def _where(m: Liveness) -> str:
    return phase_text(m.phase, m.step, m.collective, m.label)


def _blocker(judged: list[Liveness], waiting: list[Liveness], timeout_s: float) -> Hang | None:
    """The member longest without progress that has not reached a collective in which a peer
    has waited for the timeout (collective n of step s comes after everything before it)."""
    for m in sorted(judged, key=lambda m: -m.idle_s):
        if m.waiting_s is not None or m.idle_s <= timeout_s:
            continue
        owed = [p for p in waiting if (p.step, p.collective) > (m.step, m.collective)]
        if owed:
            p = max(owed, key=lambda p: p.waiting_s or 0.0)
            return Hang(m.worker, f"rank {m.rank} made no progress for {m.idle_s:.1f}s "
                                  f"({_where(m)}) while {len(owed)} of its peers wait for it "
                                  f"in collective {p.collective} of step {p.step}")
    return None


def _stuck_collective(waiting: list[Liveness]) -> Hang:
    """Every member waits in a collective: in one and the same, the communicator is stuck;
    otherwise the odd one out entered a collective its peers did not (or skipped theirs)."""
    where = Counter((m.step, m.collective) for m in waiting)
    if len(where) > 1:
        odd = min(waiting, key=lambda m: (where[(m.step, m.collective)], m.step, m.collective))
        return Hang(odd.worker, f"rank {odd.rank} waits in collective {odd.collective} of "
                                f"step {odd.step}, its peers in another (a skipped or extra "
                                f"collective)")
    (step, n), = where
    least = min(m.waiting_s or 0.0 for m in waiting)
    return Hang(None, f"every rank has waited {least:.1f}s in collective {n} of step {step}: "
                      f"rebuilding the communicator")


def replace_after_rebuild(members: list[Liveness], generation: int,
                          kept: frozenset[int] = frozenset()) -> tuple[tuple[int, ...], str]:
    """The communicator was rebuilt into `generation` and the job is still stuck a timeout
    later: the members to replace, and why. Members that never reached the rebuilt generation
    (a training thread that cannot leave the stuck collective, as behind a hung kernel) go.
    If every member reached it and they are stuck again, all go but one replica to heal from:
    the lowest rank not kept in an earlier round (`kept`). If none reached it, all go, and
    the ordinary recovery decides (a whole-group restart, or a stop)."""
    ordered = sorted(members, key=lambda m: m.rank)
    behind = [m for m in ordered if m.generation < generation]
    if behind and len(behind) < len(ordered):
        out, why = behind, "never reached it"
    else:
        candidates = [m for m in ordered if m.worker not in kept]
        keep = candidates[0] if candidates and not behind else None
        out = [m for m in ordered if m is not keep]
        why = (f"is stuck again; rank {keep.rank} stays as the replica to heal from" if keep
               else "is stuck again" if not behind else "was reached by no member")
    ranks = ", ".join(str(m.rank) for m in out)
    return tuple(m.worker for m in out), (f"the communicator rebuilt as generation "
                                          f"{generation} {why}: replacing rank"
                                          f"{'s' if len(out) != 1 else ''} {ranks}")


def find_straggler(members: list[Liveness], factor: float, min_gap_s: float = 0.05
                   ) -> tuple[int, str] | None:
    """A rank whose compute time is `factor` times its peers' median (and noticeably so)."""
    if len(members) < 2 or any(m.compute_s <= 0 for m in members):
        return None
    worst = max(members, key=lambda m: m.compute_s)
    others = sorted(m.compute_s for m in members if m is not worst)
    median = others[len(others) // 2]
    if worst.compute_s > factor * median and worst.compute_s - median > min_gap_s:
        return worst.worker, (f"rank {worst.rank} computes a step in "
                              f"{worst.compute_s * 1000:.0f} ms, its peers in "
                              f"{median * 1000:.0f} ms ({worst.compute_s / median:.1f}x)")
    return None
