"""Pure decisions: given what the agent observed, what to do next and why.

Owns: `Action`, `Decision` and the decision functions. No I/O, no clocks read here: callers
pass `now` where time matters, and every decision carries a human-readable reason that
`ftrun status` and the event log show as is.
Must not import: anything but the standard library and `ftrun.exits`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.exits import describe_exit


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
    RESTART_GROUP = "restart-group"  # in-process recovery impossible: torchrun semantics
    FAIL = "fail"


@dataclass(frozen=True)
class FaultDecision:
    action: FaultAction
    reason: str
    members: tuple[int, ...] = ()  # the next generation's members, rank order
    joiners: tuple[int, ...] = ()  # members that must heal from a peer
    spare_used: int | None = None
    regrow: bool = True  # SHRINK: start a replacement to grow back later


CRASH_LOOP_LIMIT = 3  # replacements in a row failing before their first commit: stop replacing


def _nth(n: int) -> str:
    return f"{n}{'st' if n == 1 else 'nd' if n == 2 else 'rd' if n == 3 else 'th'}"


def decide_fault(lost: int, why: str, members: tuple[int, ...], on_fault: str, min_nproc: int,
                 spares: tuple[int, ...], new_worker_id: int, faults: int, max_faults: int,
                 restarts_left: int, unhealed: frozenset[int] = frozenset(),
                 crash_loop: int = 0) -> FaultDecision:
    """A member of the current generation is gone. Pure: the agent does what this says.
    `unhealed` are joiners that hold no committed state yet: they cannot be a healing source.
    `crash_loop`: how many replacements in a row for this rank (this one included) failed
    before their first commit."""
    survivors = tuple(m for m in members if m != lost)
    head = f"worker {lost} (rank {members.index(lost)}) {why}"
    if faults > max_faults:
        return _give_up(f"{head}; fault budget exhausted ({max_faults}, --max-faults)",
                        restarts_left)
    if not [m for m in survivors if m not in unhealed]:
        return _give_up(f"{head}; no replica left to heal from", restarts_left)
    if crash_loop >= CRASH_LOOP_LIMIT:
        return _crash_loop(head, crash_loop, members.index(lost), survivors, min_nproc)
    if on_fault == "replace" or spares:  # shrink with a ready spare: no need to shrink
        joiner = spares[0] if spares else new_worker_id
        how = f"spare worker {joiner}" if spares else f"new worker {joiner}"
        rank = members.index(lost)
        new_members = survivors[:rank] + (joiner,) + survivors[rank:]
        return FaultDecision(FaultAction.REPLACE, f"{head}; {how} takes rank {rank}",
                             new_members, (joiner,), spares[0] if spares else None)
    if len(survivors) < min_nproc:
        return _give_up(f"{head}; {len(survivors)} left is below --min-nproc {min_nproc}",
                        restarts_left)
    return FaultDecision(FaultAction.SHRINK,
                         f"{head}; continuing with {len(survivors)}, replacement to follow",
                         survivors)


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


def decide_node_loss(node: str, lost: tuple[int, ...], members: tuple[int, ...],
                     nodes_left: int, min_nodes: int, faults: int, max_faults: int,
                     restarts_left: int, unhealed: frozenset[int] = frozenset(),
                     spares: tuple[int, ...] = ()) -> FaultDecision:
    """A whole node is gone (agent dead or unreachable): its workers leave together, in one
    generation. Ready spares on the other nodes take their ranks; without enough of them the
    job goes on smaller until a node joins again."""
    survivors = tuple(m for m in members if m not in lost)
    gone = len(members) - len(survivors)
    head = f"{node} lost with {gone} member{'s' if gone != 1 else ''}"
    if faults > max_faults:
        return _give_up(f"{head}; fault budget exhausted ({max_faults}, --max-faults)",
                        restarts_left)
    if nodes_left < min_nodes:
        return _give_up(f"{head}; {nodes_left} node{'s' if nodes_left != 1 else ''} left is "
                        f"below --nnodes minimum {min_nodes}", restarts_left)
    if not [m for m in survivors if m not in unhealed]:
        return _give_up(f"{head}; no replica left to heal from", restarts_left)
    pool, new, joiners = list(spares), [], []
    for m in members:
        if m not in lost:
            new.append(m)
        elif pool:  # a spare takes the lost member's rank
            joiners.append(pool.pop(0))
            new.append(joiners[-1])
    where = f"on {nodes_left} node{'s' if nodes_left != 1 else ''}"
    if joiners and len(joiners) == gone:
        return FaultDecision(FaultAction.REPLACE, f"{head}; spare workers "
                             f"{', '.join(map(str, joiners))} take their ranks {where}",
                             tuple(new), tuple(joiners))
    used = f" ({len(joiners)} spare{'s' if len(joiners) != 1 else ''} used)" if joiners else ""
    return FaultDecision(FaultAction.SHRINK, f"{head}; continuing with {len(new)} workers "
                         f"{where}{used}", tuple(new), tuple(joiners))


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


def _give_up(reason: str, restarts_left: int) -> FaultDecision:
    if restarts_left > 0:
        return FaultDecision(FaultAction.RESTART_GROUP, f"{reason}; restarting all workers")
    return FaultDecision(FaultAction.FAIL, reason)


@dataclass(frozen=True)
class Liveness:
    """What the agent knows of one member's progress (from its progress slot and /proc)."""

    worker: int
    rank: int
    step: int
    idle_s: float  # since its last sign of progress (a step started or committed)
    in_commit_s: float | None  # how long it has waited in the commit's all-reduce, if it is
    stopped: bool  # the process is stopped (SIGSTOP, a debugger)
    compute_s: float  # EMA of step start -> commit
    step_s: float  # EMA of commit -> commit
    cpu_idle_s: float = 0.0  # since its CPU time last advanced (a busy rank is not hung)
    generation: int = -1  # the generation its progress belongs to


@dataclass(frozen=True)
class Hang:
    worker: int | None  # None: no one is to blame, the communicator itself is stuck
    reason: str


def hang_timeout(members: list[Liveness], floor_s: float, override_s: float | None) -> float:
    """--hang-timeout, else ten typical steps, never below the floor."""
    if override_s:
        return override_s
    steps = sorted(m.step_s for m in members if m.step_s > 0)
    return max(floor_s, 10 * steps[len(steps) // 2]) if steps else floor_s


def find_hang(members: list[Liveness], timeout_s: float) -> Hang | None:
    """A frozen member (its peers wait in the all-reduce while it makes no progress outside
    it), or, when every member waits in the same all-reduce, the communicator."""
    stalled = [m for m in members if m.idle_s > timeout_s]
    if not stalled:
        return None
    for m in stalled:
        if m.stopped:
            return Hang(m.worker, f"rank {m.rank} is stopped and made no progress for "
                                  f"{m.idle_s:.1f}s")
    waiting = [m for m in members if m.in_commit_s is not None]
    # outside the all-reduce, idle (no CPU: a checkpoint save or a compile is not a hang),
    # while a peer has waited for it longer than the timeout
    outside = [m for m in stalled if m.in_commit_s is None and m.cpu_idle_s > timeout_s]
    if outside and max((m.in_commit_s or 0.0) for m in waiting or [outside[0]]) > timeout_s:
        m = max(outside, key=lambda m: m.idle_s)
        return Hang(m.worker, f"rank {m.rank} made no progress for {m.idle_s:.1f}s while "
                              f"{len(waiting)} peers wait for it in the all-reduce")
    if len(waiting) == len(members) and all((m.in_commit_s or 0.0) > timeout_s for m in waiting):
        steps = {m.step for m in waiting}
        if len(steps) > 1:  # someone is in a different collective: the odd one out
            odd = min(waiting, key=lambda m: sum(o.step == m.step for o in waiting))
            return Hang(odd.worker, f"rank {odd.rank} waits in step {odd.step}'s all-reduce, "
                                    f"its peers in another step's (a skipped collective)")
        return Hang(None, f"every rank has waited {timeout_s:.1f}s in step "
                          f"{steps.pop()}'s all-reduce: rebuilding the communicator")
    return None


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
