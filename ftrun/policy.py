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


def decide_fault(lost: int, why: str, members: tuple[int, ...], on_fault: str, min_nproc: int,
                 spares: tuple[int, ...], new_worker_id: int, faults: int, max_faults: int,
                 restarts_left: int, unhealed: frozenset[int] = frozenset()) -> FaultDecision:
    """A member of the current generation is gone. Pure: the agent does what this says.
    `unhealed` are joiners that hold no committed state yet: they cannot be a healing source."""
    survivors = tuple(m for m in members if m != lost)
    head = f"worker {lost} (rank {members.index(lost)}) {why}"
    if faults > max_faults:
        return _give_up(f"{head}; fault budget exhausted ({max_faults}, --max-faults)",
                        restarts_left)
    if not [m for m in survivors if m not in unhealed]:
        return _give_up(f"{head}; no replica left to heal from", restarts_left)
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


def _give_up(reason: str, restarts_left: int) -> FaultDecision:
    if restarts_left > 0:
        return FaultDecision(FaultAction.RESTART_GROUP, f"{reason}; restarting all workers")
    return FaultDecision(FaultAction.FAIL, reason)
