"""The simulated nodes' heartbeats (issue #52): a thread for each `NODES_PER_BEATER` nodes of a
simulator process bumps their counters once a period and sets their payloads when rebuilt, as
`link.Heartbeat` sends a real node's, spread over the period as nodes on their own clocks beat.
Must not import: `sim_scale`, the agent's loop, the CLI.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ftrun.cluster.link import Endpoint, connect, heartbeat_key, payload_key

NODES_PER_BEATER = 128  # the nodes one heartbeat thread beats, one round trip after another:
# while the store worked off a start of 4,096 nodes, 512 a thread left a node up to 20 s
# without a beat in starts that held, 65 s in one that failed; with 128, 3.8-5.9 s in four
BEAT_SLICES = 32  # ...in this many slices a period, evenly apart
BEATERS_APART = 8  # the threads' slices, offset by this share of a slice's time
CONNECT_S = 120.0


class Beating(Protocol):
    """What a heartbeat thread reads of a simulated node."""

    index: int
    ended: bool

    def payload(self, now: float, started: float) -> str: ...


class Beaters:
    """The heartbeat threads of one process's nodes (`nodes()`, read under `lock`), each on its
    own store connection: a real node beats on its own, and one thread's round of 2,048
    sequential round trips, each a turn of a store server busy with a start, ran past 20 s at
    4,096 nodes (the coordinator then dropped hundreds of nodes as cut off); so did 512."""

    def __init__(self, ep: Endpoint, beat_s: float, payload_s: float, started: float,
                 nodes: Callable[[], Sequence[Beating]], lock: threading.Lock,
                 lost: Callable[[str], None]) -> None:
        self.ep, self.beat_s, self.payload_s, self.started = ep, beat_s, payload_s, started
        self._nodes, self._lock, self._lost = nodes, lock, lost
        self._stop = threading.Event()
        self._threads = 0
        self.max_gap = 0.0  # the longest a node went between two beats

    def cover(self, count: int) -> None:
        """A heartbeat thread for each `NODES_PER_BEATER` of the first `count` nodes."""
        while self._threads * NODES_PER_BEATER < count:
            threading.Thread(target=self._run, args=(self._threads,), daemon=True,
                             name=f"sim-beats-{self._threads}").start()
            self._threads += 1

    def close(self) -> None:
        self._stop.set()

    def _run(self, share: int) -> None:
        """The `share`-th block's beats, a round a period, the rounds on a fixed clock."""
        beats = connect(self.ep, CONNECT_S)
        sent: dict[int, float] = {}  # node -> its last payload
        last: dict[int, float] = {}  # node -> its last beat
        offset = (share % BEATERS_APART) / BEATERS_APART / BEAT_SLICES
        due = time.monotonic() + self.beat_s * (1 + offset)
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            with self._lock:
                block = self._nodes()[share * NODES_PER_BEATER:(share + 1) * NODES_PER_BEATER]
                nodes = [n for n in block if not n.ended]
            try:
                if not self._round(beats, nodes, due, sent, last):
                    return
            except Exception as exc:
                self._lost(str(exc))
                return
            due = max(due + self.beat_s, time.monotonic())  # late: no rounds piled up

    def _round(self, beats: Any, nodes: list[Beating], due: float, sent: dict[int, float],
               last: dict[int, float]) -> bool:
        """One period's beats of `nodes`, from `due` on, in BEAT_SLICES slices evenly apart, as
        thousands of nodes on their own clocks beat. All of a block's at once, 512 requests
        and ~2 MB of payloads every ~2 s, held up any fault that came behind them: at 4,096
        nodes the last node's p99 was 360-425 ms, and 190 ms with the beats all but off.
        False: stopped meanwhile."""
        size = max(1, -(-len(nodes) // BEAT_SLICES))
        for k, first in enumerate(range(0, len(nodes), size)):
            if self._stop.wait(max(0.0, due + k * self.beat_s / BEAT_SLICES - time.monotonic())):
                return False
            now, wall = time.monotonic(), time.time()
            for node in nodes[first:first + size]:
                if wall - sent.get(node.index, 0.0) >= self.payload_s:
                    beats.set(payload_key(node.index), node.payload(wall, self.started))
                    sent[node.index] = wall
                beats.add(heartbeat_key(node.index), 1)
                self.max_gap = max(self.max_gap, now - last.get(node.index, now))
                last[node.index] = now
        return True
