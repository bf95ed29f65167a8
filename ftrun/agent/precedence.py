"""The agent's loop goes first: background builders step aside while it decides a fault.

Owns: `LoopPrecedence`, which the loop holds through each of its passes (`deciding`: where
it decides and publishes a fault's generation; between passes it waits for the next event),
and at whose `yield_to_loop` the threads that build the job's status (every few seconds,
~0.3-0.6 s of Python at 8,192 workers) pause between their pieces. Python runs one thread at
a time: a fault that arrived during a status build waited for the build, each of its store
round trips for the builder's time slice (at 1,024 nodes one fault in ~12 was published
450 ms late, not ~40 ms). During a pass the collector's automatic runs are deferred as well
(a full collection of the coordinator's heap took up to ~140 ms at 1,024 nodes): it runs
after the pass.
Must not import: anything of ftrun beyond core (the cluster's status thread imports this).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YIELD_MAX_S = 1.0  # a builder waits at most this long at one pause: a loop that stays busy
# (a node of thousands saturated) slows the status, never stops it


class LoopPrecedence:
    """Shared by the agent's loop (the only one that decides) and its background builders."""

    def __init__(self) -> None:
        self._quiet = threading.Event()
        self._quiet.set()
        self._owner: int | None = None  # the deciding thread: it never waits for itself
        self._depth = 0
        self._collector_was_on = False

    @contextmanager
    def deciding(self) -> Iterator[None]:
        """A pass of the loop (what it found decided and published) runs within this;
        nested uses are one window."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

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

    def yield_to_loop(self) -> None:
        """A builder's pause between two pieces: returns at once unless the loop is deciding
        (then when it is done, or after YIELD_MAX_S); the deciding thread never waits here."""
        if not self._quiet.is_set() and threading.get_ident() != self._owner:
            self._quiet.wait(YIELD_MAX_S)

    @property
    def is_deciding(self) -> bool:
        return not self._quiet.is_set()
