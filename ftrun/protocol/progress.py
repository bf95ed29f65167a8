"""Per-worker progress and drill slots in a small shared file: no store round trip per step.

Owns: the fixed layout of `<progress dir>/<worker id>` (written by the worker as it moves
through a step, read by the agent for `ftrun status` and hang detection) and the drill slot
the agent writes for faults that must happen inside the worker (exit, exception, slow, comm,
spin, deadlock, stall, wedge, or any kind at a given step). Where the worker is (its phase: the
step's own code, collective n of step s, the optimizer, user code between steps, a named
long phase, recovery) and since when: what the agent judges hangs by. A worker's write is a
memory store into an mmap: no syscall in the hot loop.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ftrun.core.faultkinds import SLOT_DRILLS, FaultKind
from ftrun.core.states import Phase

ENV = "FTRUN_PROGRESS_DIR"
LABEL_BYTES = 32  # a long phase's name, UTF-8, cut to this
# The one layout: (field, struct code). Every offset below is derived from it; add fields at
# the end. Times are wall-clock seconds (the agent on the same host reads time.time() too).
FIELDS: tuple[tuple[str, str], ...] = (
    ("step", "q"),  # the step being worked on (= steps committed)
    ("last_commit", "d"),
    ("step_time", "d"),  # EMA of commit -> commit
    ("step_started", "d"),
    ("rank", "q"),
    ("generation", "q"),
    ("drill_seq", "q"),  # the agent's: a new number is a new drill
    ("drill_kind", "q"),
    ("drill_at", "q"),
    ("drill_arg", "d"),
    ("collective_started", "d"),  # entered the collective it is in (0: in none)
    ("compute_time", "d"),  # EMA of step start -> its first collective (what tells a
    # straggler: all-reduces make every rank's step time equal)
    ("phase", "q"),  # index into Phase
    ("phase_started", "d"),  # the slot's last advance: a hang is measured from here
    ("collective", "q"),  # collectives entered in this step (n of "collective n of step s")
    ("step_p95", "d"),  # p95 of recent step times, 0 until WARMUP_STEPS were measured
    ("label", f"{LABEL_BYTES}s"),  # the long phase's name
)
NAMES = tuple(name for name, _ in FIELDS)
_LAYOUT = struct.Struct("<" + "".join(code for _, code in FIELDS))
SIZE = _LAYOUT.size
_PHASES = tuple(Phase)  # the slot's phase codes
WARMUP_STEPS = 10  # step times measured before a p95 is published (first-step compile, warm-up)
P95_WINDOW = 128  # recent step times the p95 is taken over
P95_EVERY = 16  # once the window is full, commits between two p95 updates


def _span(first: str, last: str) -> tuple[int, struct.Struct]:
    """Offset and packer of the contiguous fields first..last, from the layout."""
    i, j = NAMES.index(first), NAMES.index(last) + 1
    offset = struct.calcsize("<" + "".join(code for _, code in FIELDS[:i]))
    return offset, struct.Struct("<" + "".join(code for _, code in FIELDS[i:j]))


_PROGRESS = _span("step", "generation")
_MEMBER = _span("rank", "generation")
_DRILL_SEQ = _span("drill_seq", "drill_seq")
_DRILL_BODY = _span("drill_kind", "drill_arg")
_COLLECTIVE = _span("collective_started", "compute_time")
_COLLECTIVE_STARTED = _span("collective_started", "collective_started")
_PHASE = _span("phase", "phase_started")
_COUNT = _span("collective", "collective")
_P95 = _span("step_p95", "step_p95")
_LABEL = _span("label", "label")


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
    collective_started: float = 0.0
    compute_time: float = 0.0
    phase: Phase = Phase.NONE
    phase_started: float = 0.0
    collective: int = 0
    step_p95: float = 0.0
    label: str = ""


def unpack(buffer: bytes | mmap.mmap) -> Progress:
    """A slot's bytes as a Progress (an unknown phase code reads as not reported yet)."""
    raw = dict(zip(NAMES, _LAYOUT.unpack_from(buffer, 0), strict=True))
    code = raw["phase"]
    raw["phase"] = _PHASES[code] if 0 <= code < len(_PHASES) else Phase.NONE
    raw["label"] = raw["label"].rstrip(b"\0").decode("utf-8", "replace")
    return Progress(**raw)


def pack(p: Progress) -> bytes:
    """A whole slot holding `p`: the inverse of unpack (a label is cut to LABEL_BYTES)."""
    raw = {name: getattr(p, name) for name in NAMES}
    raw["phase"] = _PHASES.index(p.phase)
    raw["label"] = p.label.encode("utf-8")[:LABEL_BYTES]
    return _LAYOUT.pack(*raw.values())


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
        return unpack(self._map)

    def put(self, span: tuple[int, struct.Struct], *values: object) -> None:
        span[1].pack_into(self._map, span[0], *values)

    def write_progress(self, step: int, last_commit: float, step_time: float,
                       step_started: float, rank: int, generation: int) -> None:
        self.put(_PROGRESS, step, last_commit, step_time, step_started, rank, generation)

    def write_phase(self, phase: Phase, since: float) -> None:
        """The phase last: a reader that sees it sees when it began."""
        self.put(_PHASE, _PHASES.index(phase), since)

    def reset(self) -> None:
        """A worker id starts afresh (ids restart with every attempt)."""
        self._map[:] = bytes(SIZE)
        self.write_progress(-1, 0.0, 0.0, 0.0, -1, -1)
        self.write_drill(0, FaultKind.KILL, -1, 0.0)

    def write_drill(self, seq: int, kind: str, at_step: int, arg: float) -> None:
        # the sequence number last: a reader that sees the new number sees the whole drill
        self.put(_DRILL_BODY, SLOT_DRILLS.index(kind), at_step, arg)
        self.put(_DRILL_SEQ, seq)

    def close(self) -> None:
        self._map.close()


def slot_path(directory: str, worker_id: int) -> str:
    return os.path.join(directory, str(worker_id))


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else 0.0


class Reporter:
    """The worker's side: say where it is as it moves through a step, and hand over a drill
    once it is due. Each mark is a few stores into the mapped slot."""

    def __init__(self, directory: str, worker_id: int) -> None:
        self.slot = Slot(slot_path(directory, worker_id), create=True)
        self._seen_drill = self.slot.read().drill_seq
        self._ema = 0.0
        self._compute = 0.0
        self._last = 0.0  # the last commit, 0 when the next step time is not comparable
        self._started = 0.0
        self._count = 0  # collectives entered in this step
        self._times: deque[float] = deque(maxlen=P95_WINDOW)
        self._commits = 0
        self._long: list[str] = []  # nested long phases, innermost last
        self._phase = Phase.USER  # what a long phase returns to

    def _mark(self, phase: Phase, now: float) -> None:
        self._phase = phase
        if not self._long:
            self.slot.write_phase(phase, now)

    def step_started(self, step: int, rank: int, generation: int, now: float) -> None:
        self._started, self._count = now, 0
        self.slot.put(_COLLECTIVE_STARTED, 0.0)
        self.slot.put(_COUNT, 0)
        self.slot.write_progress(step, self._last, self._ema, now, rank, generation)
        self._mark(Phase.STEP, now)

    def collective_started(self, now: float) -> None:
        """Entering collective n (n = 1, 2, ...) of this step."""
        self._count += 1
        if self._count == 1 and self._started:
            compute = max(0.0, now - self._started)
            self._compute = compute if not self._compute else 0.8 * self._compute + 0.2 * compute
        self.slot.put(_COLLECTIVE, now, self._compute)
        self.slot.put(_COUNT, self._count)
        self._mark(Phase.COLLECTIVE, now)

    def finished(self, now: float) -> None:
        """Past the last collective of the run: the script's own code from here."""
        self.slot.put(_COLLECTIVE_STARTED, 0.0)
        self._mark(Phase.USER, now)

    def optimizer(self, now: float) -> None:
        self.slot.put(_COLLECTIVE_STARTED, 0.0)
        self._mark(Phase.OPTIMIZER, now)

    def committed(self, step: int, rank: int, generation: int, now: float) -> None:
        took = now - (self._last or self._started)
        if self._last:
            self._ema = took if not self._ema else 0.8 * self._ema + 0.2 * took
        if self._last or self._started:
            self._record(took)
        self._last, self._count = now, 0
        self.slot.put(_COLLECTIVE_STARTED, 0.0)
        self.slot.put(_COUNT, 0)  # the next step's collectives are yet to come
        self.slot.write_progress(step, now, self._ema, now, rank, generation)
        self._mark(Phase.USER, now)

    def _record(self, took: float) -> None:
        self._times.append(took)
        self._commits += 1
        filling = len(self._times) < P95_WINDOW  # then every commit: a sort of a few floats
        if len(self._times) >= WARMUP_STEPS and (filling or self._commits % P95_EVERY == 0):
            self.slot.put(_P95, p95(list(self._times)))

    def recovering(self, now: float, rank: int = -1, generation: int = -1) -> None:
        """Rebuilding, aligning or healing (switching to `generation`, if given): the next
        step time is measured from its start."""
        self._last = 0.0
        self.slot.put(_COLLECTIVE_STARTED, 0.0)
        if generation >= 0:
            self.slot.put(_MEMBER, rank, generation)
        self._mark(Phase.RECOVERING, now)

    @contextlib.contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        self.long_phase_entered(name, time.time())
        try:
            yield
        finally:
            self.long_phase_left(time.time())

    def long_phase_entered(self, name: str, now: float) -> None:
        self._long.append(name)
        self.slot.put(_LABEL, name.encode("utf-8")[:LABEL_BYTES])
        if len(self._long) == 1:
            self.slot.write_phase(Phase.LONG, now)

    def long_phase_left(self, now: float) -> None:
        self._long.pop()
        self._last = 0.0  # its duration is no step time
        if self._long:
            self.slot.put(_LABEL, self._long[-1].encode("utf-8")[:LABEL_BYTES])
            return
        self.slot.write_phase(self._phase, now)  # the time spent in it counts as progress
        self.slot.put(_LABEL, b"")

    def due_drill(self, step: int) -> tuple[FaultKind, float] | None:
        p = self.slot.read()
        if p.drill_seq == self._seen_drill or (p.drill_at >= 0 and step < p.drill_at):
            return None
        self._seen_drill = p.drill_seq
        return SLOT_DRILLS[p.drill_kind], p.drill_arg


def hang_here(kind: str) -> None:
    """A drill that hangs the calling thread for good, as real hangs do: spin (a busy loop),
    deadlock (a lock it already holds) or wedge (blocked, as a host thread behind a kernel
    that never ends). Only the agent's SIGKILL ends it."""
    print(f"ftrun: drill: the training thread hangs ({kind})", file=sys.stderr, flush=True)
    if kind == FaultKind.SPIN:
        while True:
            pass
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
