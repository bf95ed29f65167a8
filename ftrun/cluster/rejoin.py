"""A fenced follower: out of the job after a cut, and on its way back in, or out for good.

Owns: `Fenced` (why a follower left the job without being told, and how many of its workers
it stopped) and `Rejoin`, which a follower holds: reaching the store at first (retried until
`join_timeout`), trying to reach it again after a cut until it has answered steadily for a
while (a link that flaps is not rejoined at every blink: `ftrun.core.fencing.rejoin_step`
decides), and the one line a follower leaves with when it does not come back.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun.agent.outcomes import stopped_by
from ftrun.agent.roster import RunResult
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import Endpoint, connect, reach
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.core.events import FailureFields, emit_as, notice
from ftrun.core.fencing import Next, rejoin_step
from ftrun.core.policy import _s

REJOIN_RETRY_S = 0.2  # between two tries of a fenced node to reach the store again


@dataclass(frozen=True)
class Fenced:
    """This node left the job without being told: its store was lost or silent, or the
    coordinator dropped it. `stopped`: how many of its workers it stopped."""

    why: str
    stopped: int
    final: bool = False  # the control plane itself is gone (etcd's majority): no rejoining


class Rejoin:
    """A fenced follower's way back: a new connection, or the run's end (held by it)."""

    def __init__(self, host: NodeHost, ep: Endpoint, rejoin_s: float,
                 resolve: Callable[[], Endpoint | None] | None = None) -> None:
        """`resolve`: where the job's store is now (etcd: the leader in office publishes it;
        a refused old store is then a coordinator being replaced, not the job's end)."""
        self.host = host
        self.ep = ep
        self.rejoin_s = rejoin_s
        self.resolve = resolve

    def moved_to(self, ep: Endpoint) -> None:
        """The job's store is at `ep` now (a rejoin found it elsewhere): reach it there."""
        self.ep = ep

    def first_connect(self, join_s: float) -> Any:
        """Reach the store for the first time (a connection, or the run's result after a
        signal), retrying in short tries so that Ctrl-C is honoured meanwhile."""
        deadline = time.monotonic() + join_s
        while True:
            try:
                return connect(self.ep, min(timeouts.CONNECT_TRY_S, join_s))
            except FtrunError:
                if time.monotonic() >= deadline:
                    raise
            sig = self.host.runtime.wakeup.pop_signal()
            if sig is not None:
                return stopped_by(sig, 0, self.host.runtime.workers.exits(),
                                  self.host.runtime.services.logs.run_dir)

    def connect(self, fenced: Fenced) -> Any:
        """A new connection to the store (to join again, as a new node), or the run's end."""
        if fenced.final:
            return self._ended(f"{fenced.why}; stopped {fenced.stopped} worker"
                               f"{_s(fenced.stopped)} of this node")
        if self.rejoin_s > 0:
            notice(self.host.emit, f"fenced: cut off from {self._store_lost(fenced)}; trying "
                                   f"to rejoin for up to {self.rejoin_s:g} s")
        start, stable_since = time.monotonic(), None
        while (sig := self.host.runtime.wakeup.pop_signal()) is None:
            if self._moved():
                stable_since = None
            failed = reach(self.ep, timeouts.CONNECT_TRY_S) if self.rejoin_s > 0 else None
            now = time.monotonic()
            stable_since = None if failed else stable_since or now
            err = failed.errno if failed and self.resolve is None else None
            step = rejoin_step(failed is None, err,
                               now - (stable_since or now), now - start, self.rejoin_s,
                               timeouts.NODE_SETTLE_S)
            if step.action is Next.END:
                return self._lost_result(fenced, step.reason)
            if step.action is Next.JOIN:
                with contextlib.suppress(FtrunError):
                    return connect(self.ep, timeouts.CONNECT_TRY_S)
                stable_since = None
            self.host.runtime.wakeup.wait(REJOIN_RETRY_S)
        host = self.host
        return stopped_by(sig, host.attempt.restarts, host.runtime.workers.exits(),
                          host.runtime.services.logs.run_dir)

    def _moved(self) -> bool:
        """etcd: another leader's store is published: rejoin there (as a new node)."""
        try:
            ep = self.resolve() if self.resolve is not None else None
        except FtrunError:  # etcd away: try the store we know
            return False
        if ep is None or ep == self.ep:
            return False
        self.ep = ep
        return True

    def _store_lost(self, fenced: Fenced) -> str:
        return (f"the rendezvous store at {self.ep} ({fenced.why}); stopped {fenced.stopped} "
                f"worker{_s(fenced.stopped)} of this node")

    def _lost_result(self, fenced: Fenced, why: str) -> RunResult:
        return self._ended(f"lost {self._store_lost(fenced)}; {why}")

    def _ended(self, reason: str) -> RunResult:
        emit_as(self.host.emit, FailureFields(reason))
        return RunResult(1, reason, restarts_used=self.host.attempt.restarts,
                         log_dir=self.host.runtime.services.logs.run_dir)
