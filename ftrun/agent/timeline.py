"""A run's history for `ftrun report`: the committed step of every rank over time, the world
size and the spares, sampled from the status document into `<run dir>/timeline.jsonl`.

Owns: `Timeline` (when to sample, what a line holds, the steps per second over the last
minute that `ftrun status` shows); `ftrun report` reads the file back. A line is written only
when something changed, or every `KEEPALIVE_S` while nothing does, so an idle or a long job
writes little; jobs of more than `PER_RANK_MAX` ranks keep only the slowest and fastest rank's step.
Must not import: torch, typer, rich, the CLI, the agent's node.
"""

from __future__ import annotations

import collections
import json
from typing import IO, Any

from ftrun.protocol.status import Status

EVERY_S = 0.5  # how often the agent samples its status document...
NODES_PER_EVERY = 16  # ...and past this many nodes, proportionally less often (the
# coordinator's job status reads every node's payload from the store)
KEEPALIVE_S = 10.0  # a line at least this often while the job runs unchanged
RATE_WINDOW_S = 60.0  # `ftrun status`: steps per second over this window
PER_RANK_MAX = 64  # above this many ranks a line keeps the min and max step only
FILE = "timeline.jsonl"


def line_of(doc: Status) -> dict[str, Any]:
    """What one sample keeps of a status document (without its time)."""
    steps = {w.rank: w.committed_step for w in doc.workers
             if w.rank >= 0 and w.committed_step is not None and w.role != "spare"}
    line: dict[str, Any] = {
        "attempt": doc.attempt, "generation": doc.generation, "world_size": doc.world_size,
        "spares": sum(1 for w in doc.workers if w.role == "spare"),
        "step_min": min(steps.values(), default=None),
        "step_max": max(steps.values(), default=None),
    }
    if len(steps) <= PER_RANK_MAX:
        line["steps"] = {str(r): s for r, s in sorted(steps.items())}
    return line


def sample_every_s(nodes: int) -> float:
    """Seconds between samples for a job of `nodes` nodes: 0.5 s up to 16 nodes, then as many
    store reads per second as 16 nodes cost (512 nodes: one sample every 16 s)."""
    return EVERY_S * max(1.0, nodes / NODES_PER_EVERY)


class Timeline:
    def __init__(self, run_dir: str | None, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self._file: IO[str] | None = (open(f"{run_dir}/{FILE}", "a")  # noqa: SIM115
                                      if run_dir else None)
        self._next = 0.0
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._failed = False

    def due(self, now: float) -> bool:
        return now >= self._next

    def sample(self, doc: Status, now: float) -> None:
        """Record a status document taken at `now` (wall clock)."""
        self._next = now + self.every_s
        line = line_of(doc)
        if line["step_max"] is not None:
            self._recent.append((now, int(line["step_max"])))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        if self._file is None or (line == self._last and now - self._last_at < KEEPALIVE_S):
            return
        self._file.write(json.dumps({"t": round(now, 3), **line}) + "\n")
        self._file.flush()
        self._last, self._last_at = line, now

    def failed(self, now: float) -> bool:
        """A sample could not be taken: try again later; True the first time only."""
        self._next = now + self.every_s
        first, self._failed = not self._failed, True
        return first

    def steps_per_s(self) -> float | None:
        """Committed steps per second over the last minute (None before two samples)."""
        if len(self._recent) < 2:
            return None
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        return round(max(0, s1 - s0) / (t1 - t0), 3) if t1 > t0 else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
