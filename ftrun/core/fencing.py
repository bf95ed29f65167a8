"""The fencing rule of a multi-node job, as pure decisions: who is the job after a partition.

The coordinator's side is the job. The coordinator pings every node when one has been quiet
for `quiet_s` and drops those that do not answer (about a second after a cut). A follower that
has had no store round trip for `fence_s` (longer) stops its own workers: it is *fenced*, and
nothing of it acts on a generation it is no longer part of. A fenced follower may come back
as a *new* node (fresh worker ids: a late node's joiners or spares); nothing it did before the
cut is accepted again. The coordinator goes on as its policy allows (`--nnodes` minimum,
`--min-nproc`); when it is the one cut off, every follower fences and it goes on alone or
ends: there are never two jobs.

Owns: when a quiet node is pinged, when a follower is cut off, what a fenced follower does
next (retry, come back, or end) and the one-line reasons.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.core.states import TextEnum


def quiet_nodes(ages: Mapping[int, float], quiet_s: float) -> list[int]:
    """Nodes whose heartbeat has not moved for `quiet_s`: the coordinator pings every node
    then (one round for all, so that nodes cut off together are dropped together)."""
    return sorted(node for node, age in ages.items() if age >= quiet_s)


def cut_off(silent_s: float, fence_s: float) -> str | None:
    """Why a follower must fence now (its last store round trip was `silent_s` ago), or None."""
    if silent_s < fence_s:
        return None
    return f"no answer from the store for {silent_s:.1f} s"


class Next(TextEnum):
    RETRY = "retry"  # try to reach the store again
    JOIN = "join"  # the store answers, and has for a while: join again, as a new node
    END = "end"  # give up: exit with the reason


@dataclass(frozen=True)
class RejoinStep:
    action: Next
    reason: str


def rejoin_step(reached: bool, err: int | None, stable_s: float, elapsed_s: float,
                window_s: float, settle_s: float) -> RejoinStep:
    """What a fenced follower does after one try to reach the store, `elapsed_s` after it
    fenced: `reached`, or failed with `err` (an errno; None: a timeout); `stable_s`: how long
    every try has succeeded. It joins once the store has answered for `settle_s` (a link that
    flaps is not rejoined at every blink: one outage, one recovery). A refused connection
    means the host is up and nothing serves the endpoint: the coordinating agent has ended.
    An unreachable host may be the cut itself: retry until the window closes."""
    if window_s <= 0:
        return RejoinStep(Next.END, "rejoining is off (--rdzv-conf rejoin_timeout=0)")
    if not reached and err == errno.ECONNREFUSED:
        return RejoinStep(Next.END, "nothing serves the endpoint any more: the coordinating "
                                    "agent has ended")
    if reached and stable_s >= settle_s:
        return RejoinStep(Next.JOIN, f"the store has answered for {stable_s:.1f} s")
    if elapsed_s >= window_s:
        return RejoinStep(Next.END, f"it did not answer steadily again within {window_s:g} s "
                                    "(--rdzv-conf rejoin_timeout=)")
    return RejoinStep(Next.RETRY, "settling" if reached else "unreachable")
