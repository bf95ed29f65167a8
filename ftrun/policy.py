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
