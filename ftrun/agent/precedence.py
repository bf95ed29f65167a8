"""The agent's loop goes first: background builders step aside while it decides a fault.

Owns: `LoopPrecedence`, which the loop holds through each of its passes (`deciding`: where
it decides and publishes a fault's generation; between passes it waits for the next event),
and at whose `yield_to_loop` the thread that builds the job's status (every few seconds,
~0.3-0.6 s of Python at 8,192 workers) pauses between its pieces, within a budget a build
(`building`); and the status build for SETTLE_S after a pass that published a generation,
while the fault's record fans out to the forwarders, the nodes and their workers
(`settle_left`). Python runs one thread at a time: a fault that arrived during a status
build waited for the build, each of its store round trips for the builder's time slice (at 1,024
nodes one fault in ~12 was published 450 ms late, not ~40 ms). During a pass the
collector's automatic runs are deferred as well (a full collection of the coordinator's
heap took up to ~140 ms at 1,024 nodes): it runs after the pass. And `freeze_heap`, once an
attempt's store is up, takes what the agent holds by then (its imports) out of full passes.
The settle: at 1,024 nodes on etcd the 9 faults of 84 with a status build in their window
took a median 70.6 ms to reach the last node, the other 75 52.4 ms; the build (~0.15-0.2 s of
the coordinator's host) ran after the publication, beside the fan-out it slowed. With the
settle, at 4,096 simulated nodes the last node's pooled p99 went 349 -> 222 ms (15 pairs,
docs/scale.md); at 1,024 on etcd the change was within the host's noise.
Must not import: anything of ftrun beyond core (the cluster's status thread imports this).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

YIELD_BUDGET_S = 1.0  # a build pauses at most this long in all: a pass that blocks (an etcd
# write during an outage) or a loop that stays busy slows the status, never stops it
SETTLE_S = 0.3  # after a publication the status build waits this long: the last node of
# 4,096 has the record ~0.25 s after it (p99, simulated); a status is at most this much staler


def freeze_heap() -> None:
    """What the process holds now is left out of the collector's passes from now on
    (`gc.freeze`): mostly its imports (torch's alone are ~200,000 objects, a full pass over
    them ~85 ms here). A full pass is not deferred when a status build's allocations start
    it just before a fault: at 1,024 nodes the coordinator's took 106-132 ms, every ~9 s,
    and 3 faults of 60 were published 28-86 ms late, not ~7 ms (after: 17-34 ms passes, the
    latest publication 30 ms). Not collected first: that pass would be the same pause, on a
    new leader's takeover too. An object frozen and freed later by its count goes as any
    other; only garbage in a cycle at this moment stays, once."""
    gc.freeze()


class LoopPrecedence:
    """Shared by the agent's loop (the only one that decides) and its background builders."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self._settle_s = settle_s
        self._settled_at = 0.0  # monotonic: the last publication's settle ends then
        self._quiet = threading.Event()
        self._quiet.set()
        self._owner: int | None = None  # the deciding thread: it never waits for itself
        self._depth = 0
        self._collector_was_on = False
        self._budgets: dict[int, float] = {}  # a building thread -> its pauses' budget left
        self._settles: dict[int, float] = {}  # a status build -> its settles' budget left

    @contextmanager
    def deciding(self, generation: Callable[[], object] | None = None) -> Iterator[None]:
        """A pass of the loop (what it found decided and published) runs within this;
        nested uses are one window. `generation`: the number the pass may publish, read
        before and after; a pass that moved it starts a settle (`published`)."""
        before = None if generation is None else generation()
        self._enter()
        try:
            yield
        finally:
            if generation is not None and generation() != before:
                self.published()  # before the builders are let go
            self._leave()

    def published(self) -> None:
        """A generation went out now: builders settle SETTLE_S from here."""
        self._settled_at = time.monotonic() + self._settle_s

    def settle_left(self) -> float:
        """Seconds until the last publication's settle ends (0.0: none under way)."""
        return max(0.0, self._settled_at - time.monotonic())

    def _enter(self) -> None:
        if self._depth == 0:
            self._owner = threading.get_ident()
            self._collector_was_on = gc.isenabled()
            gc.disable()
            self._quiet.clear()
        self._depth += 1

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._quiet.set()
            if self._collector_was_on:
                gc.enable()

    @contextmanager
    def building(self, budget_s: float | None = None,
                 settle_budget_s: float = 0.0) -> Iterator[None]:
        """A background build on this thread: its pauses at `yield_to_loop` for the loop
        take at most `budget_s` (YIELD_BUDGET_S) in all, those for a publication's settle
        at most `settle_budget_s` (0.0: it does not wait for settles). A thread outside one
        (the control thread answering `ftrun status`) never pauses: a pass blocked on an
        etcd write during an outage would hold the answer."""
        me = threading.get_ident()
        self._budgets[me] = YIELD_BUDGET_S if budget_s is None else budget_s
        self._settles[me] = settle_budget_s
        try:
            yield
        finally:
            self._budgets.pop(me, None)
            self._settles.pop(me, None)

    def yield_to_loop(self) -> None:
        """A builder's pause between two pieces: returns at once unless this thread is
        `building` and the loop is deciding or (a build with a settle budget) a publication
        settling: then when both are over, or when the budgets for them are spent. The
        deciding thread never waits here."""
        me = threading.get_ident()
        if me == self._owner or me not in self._budgets:
            return
        left, settles = self._budgets[me], self._settles[me]
        while True:
            start = time.monotonic()
            if left > 0.0 and not self._quiet.is_set():
                self._quiet.wait(left)
                left -= time.monotonic() - start
            elif settles > 0.0 and (settle := self.settle_left()) > 0.0:
                time.sleep(min(settle, settles))
                settles -= time.monotonic() - start
            else:
                break
        self._budgets[me], self._settles[me] = left, settles

    @property
    def is_deciding(self) -> bool:
        return not self._quiet.is_set()
