"""The pace of the agent's loop: which exits one pass gathers, and when its periodic checks run.

Owns: `Pacing`, which the agent asks two things of each pass. Which exits follow the first
one closely enough to be decided with it (a burst: one generation, one communicator rebuild
on every survivor, not one each). And whether the pass runs the periodic checks, which read
every node's heartbeat and judge every member's progress (at 1,024 nodes they took 10-17 ms
of a fault's 16 ms from report to publication, `docs/scale.md`). A pass that decides exits
publishes first and owes those checks to the next pass (due by their own clocks, they wait
at most the loop's usual wait; not at once: the nodes are taking the new generation then).
Checks are owed for one pass at most: a stream of exits never starves them.
Must not import: typer, rich, the CLI, the worker library, the agent's other modules.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from ftrun.core import timeouts

T = TypeVar("T")


class Pacing:
    def __init__(self) -> None:
        self.exits_decided_at = -math.inf  # when a pass last decided exits (and published)
        self.checks_owed = False  # the last pass decided exits and left its checks out

    def runs_checks(self, has_exits: bool) -> bool:
        """Whether this pass runs the periodic checks: not when it decides exits, unless the
        previous pass left them out already."""
        return not has_exits or self.checks_owed

    def passed(self, has_exits: bool, ran_checks: bool) -> None:
        """A pass is over: what the next one owes and how it gathers a burst's rest."""
        self.checks_owed = not ran_checks
        if has_exits:
            self.exits_decided_at = time.monotonic()

    def rest_of_burst(self, gather: Callable[[float], list[T]]) -> list[T]:
        """The exits that follow one within `BURST_QUIET_S` of each other (up to
        `BURST_MAX_S`): ranks lost together (a switch, a rack) are decided in one pass.
        Within `BURST_FOLLOW_S` of a pass that decided exits, a burst's rest: quiet
        `BURST_TAIL_QUIET_S`, up to `BURST_TAIL_MAX_S` (10 exits over 0.1 s: 2 generations).
        `gather(timeout_s)`: the exits seen within at most that long."""
        more: list[T] = []
        now = time.monotonic()
        tail = now - self.exits_decided_at < timeouts.BURST_FOLLOW_S  # the rest of a burst
        quiet = timeouts.BURST_TAIL_QUIET_S if tail else timeouts.BURST_QUIET_S
        deadline = now + (timeouts.BURST_TAIL_MAX_S if tail else timeouts.BURST_MAX_S)
        quiet_until = now + quiet
        while True:  # one look at least: a thread of a loaded host may wake past `quiet`
            got = gather(max(0.0, min(quiet_until, deadline) - now))
            if got:
                more += got
                quiet_until = time.monotonic() + quiet
            if (now := time.monotonic()) >= min(quiet_until, deadline):
                return more
