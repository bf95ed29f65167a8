"""Per-worker progress and drill slots in a small shared file: no store round trip per step.

Owns: the fixed layout of `<progress dir>/<worker id>` (written by the worker at each commit,
read by the agent for `ftrun status` and hang detection) and the drill slot the agent writes
for faults that must happen inside the worker (exit, exception, slow, comm, or any kind at a
given step). A worker's write is a memory store into an mmap: no syscall in the hot loop.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

ENV = "FTRUN_PROGRESS_DIR"
# committed step, last commit (wall), step-time EMA, in-step start (wall), rank, generation,
# drill sequence, drill kind code, drill at-step, drill argument,
# entered the commit's all-reduce at (wall, 0 = not in it), compute-time EMA (step start to
# commit: what tells a straggler, since all-reduces make every rank's step time equal)
_LAYOUT = struct.Struct("<qddd qq qqqd dd")
SIZE = _LAYOUT.size
DRILL_KINDS = ("kill", "segv", "exit", "exception", "hang", "slow", "comm")


@dataclass(frozen=True)
class Progress:
    step: int = -1
    last_commit: float = 0.0
    step_time: float = 0.0
    step_started: float = 0.0
    rank: int = -1
    generation: int = -1
    drill_seq: int = 0
    drill_kind: int = -1
    drill_at: int = -1
    drill_arg: float = 0.0
    commit_started: float = 0.0
    compute_time: float = 0.0


class Slot:
    """One worker's slot; the worker and the agent each map it."""

    def __init__(self, path: str, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path = path

    def read(self) -> Progress:
        return Progress(*_LAYOUT.unpack_from(self._map, 0))

    def write_progress(self, step: int, last_commit: float, step_time: float,
                       step_started: float, rank: int, generation: int) -> None:
        struct.pack_into("<qddd qq", self._map, 0, step, last_commit, step_time, step_started,
                         rank, generation)

    def write_drill(self, seq: int, kind: str, at_step: int, arg: float) -> None:
        # the sequence number last: a reader that sees the new number sees the whole drill
        struct.pack_into("<qqd", self._map, 56, DRILL_KINDS.index(kind), at_step, arg)
        struct.pack_into("<q", self._map, 48, seq)

    def close(self) -> None:
        self._map.close()


def slot_path(directory: str, worker_id: int) -> str:
    return os.path.join(directory, str(worker_id))


class Reporter:
    """The worker's side: publish progress each step, and hand over a drill once it is due."""

    def __init__(self, directory: str, worker_id: int) -> None:
        self.slot = Slot(slot_path(directory, worker_id), create=True)
        self._seen_drill = self.slot.read().drill_seq
        self._ema = 0.0
        self._compute = 0.0
        self._last = 0.0

    def step_started(self, step: int, rank: int, generation: int, now: float) -> None:
        struct.pack_into("<d", self.slot._map, 80, 0.0)
        self.slot.write_progress(step, self._last, self._ema, now, rank, generation)

    def commit_started(self, now: float) -> None:
        started = self.slot.read().step_started
        compute = max(0.0, now - started)
        self._compute = compute if not self._compute else 0.8 * self._compute + 0.2 * compute
        struct.pack_into("<dd", self.slot._map, 80, now, self._compute)

    def committed(self, step: int, rank: int, generation: int, now: float) -> None:
        if self._last:
            dt = now - self._last
            self._ema = dt if not self._ema else 0.8 * self._ema + 0.2 * dt
        self._last = now
        struct.pack_into("<d", self.slot._map, 80, 0.0)
        self.slot.write_progress(step, now, self._ema, now, rank, generation)

    def due_drill(self, step: int) -> tuple[str, float] | None:
        p = self.slot.read()
        if p.drill_seq == self._seen_drill or (p.drill_at >= 0 and step < p.drill_at):
            return None
        self._seen_drill = p.drill_seq
        return DRILL_KINDS[p.drill_kind], p.drill_arg
