"""The coordinator's watch on the other nodes: is each one still there?

Owns: each node's heartbeat clock (when its counter last moved, on this host's clock), ping
rounds, and the verdict of each pass: the nodes lost (no heartbeat for `node_timeout`; after
a broken connection, `suspect_timeout`; or a ping unanswered within `timeouts.NODE_PING_S`
with no beat either) and the ping round to send. A node quiet for `quiet_timeout` (a cut
link: no connection breaks, the beats just stop) starts a round for every node, so that
nodes cut off together are dropped together.
Must not import: typer, rich, the CLI, the agent or the worker library.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.cluster.link import heartbeat_key
from ftrun.core import timeouts
from ftrun.core.fencing import quiet_nodes
from ftrun.core.policy import find_lost_nodes
from ftrun.core.rdzv_keys import NodeTimings


class Probe:
    """One ping round after a broken connection: every node of the attempt is asked to answer
    at once; one that neither answers nor beats within the wait is gone."""

    def __init__(self) -> None:
        self.seq = 0
        self._asked: set[int] = set()
        self._sent_at: float | None = None

    def start(self, nodes: list[int], now: float) -> int | None:
        """A new round (None while one is running): the sequence number to send."""
        if self._sent_at is not None:
            return None
        self.seq += 1
        self._asked, self._sent_at = set(nodes), now
        return self.seq

    @property
    def running(self) -> bool:
        """A round was sent and its wait is not over."""
        return self._sent_at is not None

    def answer(self, node: int, seq: int) -> None:
        if seq == self.seq:
            self._asked.discard(node)

    def silent(self, now: float, wait_s: float) -> set[int]:
        """After `wait_s`: the nodes that did not answer (the round is then over)."""
        if self._sent_at is None or now - self._sent_at < wait_s:
            return set()
        silent, self._asked, self._sent_at = self._asked, set(), None
        return silent


def beats_read_every_s(heartbeat_s: float) -> float:
    """Twice a beat: every window the counters are judged by is several beats long (quiet 5,
    cut 10, lost 50 by default), so an age read between two reads is off by less than a
    tenth of the shortest; a ping round and the time after a broken connection, judged on
    `NODE_PING_S`, read on every pass (`NodeWatch.check`). At 4,096 nodes (a 2 s beat) a read
    every 0.1 s was a fifth of the coordinator's loop."""
    return heartbeat_s / 2


class BeatTracker:
    """The coordinator's clock on each follower: when its counter last moved (monotonic,
    this host's clock: immune to skew between hosts)."""

    def __init__(self, read_every_s: float = 0.0) -> None:
        """`read_every_s`: the counters are read at most this often (the loop passes many
        times a beat when busy; between reads a node's age is counted from its last change
        seen, an overestimate by at most this)."""
        self._last: dict[int, tuple[int, float]] = {}
        self._keyed: set[int] = set()  # nodes whose counter exists in the store
        self.read_every_s = read_every_s
        self._read_at = -math.inf

    def watch(self, node: int, now: float | None = None) -> None:
        self._last[node] = (-1, time.monotonic() if now is None else now)

    def forget(self, node: int) -> None:
        self._last.pop(node, None)

    def beaten(self) -> list[int]:
        """The nodes that have beaten at least once (their payload is in the store)."""
        return [node for node, (count, _) in self._last.items() if count > 0]

    def due(self, now: float) -> bool:
        """The counters are read on the next `ages` (its interval has passed)."""
        return now - self._read_at >= self.read_every_s

    def ages(self, store: Any, now: float | None = None, fresh: bool = False
             ) -> dict[int, float]:
        """Seconds since each node's counter last moved: every counter in one round trip (a
        request per node per beat would cost the coordinator a core at a few hundred), read
        again if `fresh` or `read_every_s` has passed (at 4,096 nodes a read on every pass of
        a busy loop was a fifth of the coordinator's time)."""
        now = time.monotonic() if now is None else now
        if not fresh and not self.due(now):
            return {node: now - seen for node, (_, seen) in self._last.items()}
        self._read_at = now
        nodes = list(self._last)
        for node in nodes:
            if node not in self._keyed:  # a multi-get waits for a missing key: make it
                store.add(heartbeat_key(node), 0)
                self._keyed.add(node)
        counts = store.multi_get([heartbeat_key(n) for n in nodes]) if nodes else []
        out: dict[int, float] = {}
        for node, raw in zip(nodes, counts, strict=True):
            count, seen = self._last[node]
            current = int(raw)
            if current != count:
                self._last[node] = (current, now)
                seen = now
            out[node] = now - seen
        return out


@dataclass(frozen=True)
class Verdict:
    lost: list[tuple[int, str, float]]  # node, why, silent for (s)
    ping: tuple[int, list[int]] | None  # a new round: its number and the nodes to ask


class NodeWatch:
    def __init__(self, lost_after_s: float, suspect_after_s: float, quiet_after_s: float,
                 cut_after_s: float, read_every_s: float = 0.0) -> None:
        self.lost_after_s, self.suspect_after_s = lost_after_s, suspect_after_s
        self.quiet_after_s, self.cut_after_s = quiet_after_s, cut_after_s
        self.beats = BeatTracker(read_every_s)
        self._probe = Probe()
        self._suspect_until = 0.0
        self._unanswered: set[int] = set()  # asked in a finished round, silent since

    @classmethod
    def from_timings(cls, timings: NodeTimings) -> NodeWatch:
        """After a broken connection: silent this long means gone (a busy host's agent may
        miss a few beats; killing a healthy node costs far more than a second); quiet this
        long, every node is pinged (a cut link breaks no connection: the beats just stop)."""
        return cls(timings.node_timeout, timings.suspect_timeout, timings.quiet_timeout,
                   timings.cut_timeout, read_every_s=beats_read_every_s(timings.heartbeat))

    def watch(self, node: int, now: float | None = None) -> None:
        self.beats.watch(node, now)

    def forget(self, node: int) -> None:
        self.beats.forget(node)
        self._unanswered.discard(node)

    def answer(self, node: int, seq: int) -> None:
        self._probe.answer(node, seq)
        self._unanswered.discard(node)

    def suspect(self, nodes: Sequence[int], now: float | None = None
                ) -> tuple[int, list[int]] | None:
        """A worker saw a peer's connection break: a ping round over `nodes` (None while one
        runs), and the heartbeats judged on a short fuse for a while."""
        now = time.monotonic() if now is None else now
        self._suspect_until = now + self.lost_after_s
        seq = self._probe.start(list(nodes), now)
        return None if seq is None else (seq, list(nodes))

    def check(self, store: Any, nodes: Callable[[], Sequence[int]],
              now: float | None = None) -> Verdict:
        """One pass over the heartbeats of every watched node, when they are read again (a
        busy loop passes many times between two reads: nothing new to judge, and at 4,096
        nodes judging was ~2 ms a pass); `nodes`: those a quiet node's ping round asks. After
        a broken connection, a node that did not answer is lost once silent for
        `timeouts.NODE_PING_S`; otherwise (a link may just have blinked) once silent for
        `cut_after_s`."""
        now = time.monotonic() if now is None else now
        suspecting = now < self._suspect_until
        fresh = suspecting or self._probe.running  # a ping round's fuse is short
        if not fresh and not self.beats.due(now):
            return Verdict([], None)
        ages = self.beats.ages(store, now, fresh=fresh)
        ping = None
        if not self._probe.running and quiet_nodes(ages, self.quiet_after_s):
            asked = list(nodes())  # built only for a new round: thousands of nodes
            seq = self._probe.start(asked, now)
            ping = None if seq is None else (seq, asked)
        self._unanswered |= self._probe.silent(now, timeouts.NODE_PING_S)
        self._unanswered &= {n for n, age in ages.items() if age >= timeouts.NODE_PING_S}
        lost = [(n, why, ages[n]) for n, why in find_lost_nodes(
            ages, self.suspect_after_s if suspecting else self.lost_after_s,
            frozenset(self._unanswered), timeouts.NODE_PING_S if suspecting
            else self.cut_after_s)]
        return Verdict(lost, ping)
