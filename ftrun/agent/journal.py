"""What happened in a run: the event log (JSON lines), fault records with recovery phases,
the `ftrun status` document and the end-of-run summary figures.

Owns: `Journal` (every agent event goes through it: written to `<run dir>/events.jsonl`,
passed on to the console sink, and folded into `FaultRecord`s; `Journal.replay` folds an
event log read back, at the times it holds, into the same records for `ftrun report`), and
the pure helpers that turn records into the status document and the drill/run summary.
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from ftrun.agent.heals import HealLedger
from ftrun.core.events import (
    DrainFields,
    Event,
    EventSink,
    FailureFields,
    FaultFields,
    GenerationFields,
    HealedFields,
    InjectedFields,
    RecoveredFields,
    RestartFields,
    ResumedFields,
    StartedFields,
    StateSizeFields,
    TrainedFields,
    emit_as,
    fields_of,
)
from ftrun.core.faultkinds import CORRUPTION_DRILLS, GROUP_DRILLS  # faults naming no worker
from ftrun.core.policy import FaultAction
from ftrun.protocol.status import Fault

LOG_FILE = "events.jsonl"  # the journal's file in a run's log directory
PHASES = ("detected", "published", "rebuilt", "healed", "first_commit")
# the decisions an urgent generation answers (a fault's record takes that generation's number)
REGENERATING = (FaultAction.REPLACE, FaultAction.SHRINK, FaultAction.REBUILD)
FOLDED = frozenset({  # the kinds fault records are made of
    Event.FAULT, Event.FAILURE, Event.RESTART, Event.STARTED, Event.GENERATION,
    Event.RECOVERED, Event.TRAINED, Event.DRAIN, Event.RESUMED, Event.HEALED,
    Event.STATE_SIZE, Event.INJECTED})


@dataclass
class FaultRecord:
    id: int
    kind: str  # the drill (kill, ..., stall, wedge) or the agent's kill (hang, straggler), else
    # why it was detected (a rebuild's "comm", "exit N", "SIGNAL")
    worker: int
    rank: int
    at: float  # wall clock of the fault (injection time for drills, else detection)
    decision: FaultAction = FaultAction.NONE
    reason: str = ""
    injected: bool = False
    generation: int | None = None
    recovered: bool = False
    recovery_ms: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    lost_steps: int = 0  # committed before the fault, minus the step training resumed from
    committed_before: int = -1
    lost_from: float | None = None  # wall clock where lost work starts (a restart: the attempt;
    # a restart that resumed from a snapshot: when the snapshot was taken)
    resumed_step: int | None = None  # a whole-group restart resumed from this snapshot step
    redone_samples: int | None = None  # --redo: samples its recovery recomputed (-1: unknown)
    redone_fraction: float | None = None  # ...as a fraction of the step's global batch
    redone_s: float | None = None  # ...and the seconds that took (make-up pass or repeat)
    short_steps: int = 0  # steps after it committed with fewer ranks than the job's size
    rolled_back_to: int | None = None  # silent corruption: the verified step every replica
    # went back to (a gradient caught before its commit: the step it repeated)

    def __post_init__(self) -> None:
        self.decision = FaultAction(self.decision)  # a record built from a decision's text

    def fault(self) -> Fault:
        """As the journal hands it out (`ftrun status`, the run's result): the protocol's
        frozen record, no JSON in between."""
        return Fault(**{**asdict(self), "decision": self.decision.value})


class Journal:
    def __init__(self, sink: EventSink, log_path: str | None = None) -> None:
        self._sink = sink
        self._file: IO[str] | None = open(log_path, "a") if log_path else None  # noqa: SIM115
        self.faults: list[FaultRecord] = []
        self.heals = HealLedger()
        self._drills: dict[int, tuple[str, float]] = {}  # worker -> (kind, injected at)
        self.started_at = time.time()
        self._attempt_started_at = self.started_at
        self._restarting: list[FaultRecord] = []  # faults a whole-group restart answers
        self._restarted: list[FaultRecord] = []  # ...and that the attempt's resume may answer
        self._now = self.started_at  # the time of the event being folded
        self.drains: dict[int, DrainFields] = {}  # drain id -> its newest state
        self._sizes: dict[int, int] = {}  # generation -> its world size
        self._full = 0  # the attempt's world size: the job's size
        self._short: tuple[FaultRecord, int] | None = None  # a recovery below the job's
        # size and the step it resumed at: its short-handed steps end with the next

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def emit(self, kind: Event, fields: Mapping[str, object]) -> None:
        now = time.time()
        if self._file is not None:
            self._file.write(json.dumps({"t": now, "event": kind, **fields},
                                        default=str) + "\n")
            self._file.flush()
        self._fold(Event(kind), fields, now)  # Event(): a bare string that names none fails
        self._sink(kind, fields)

    def _fold(self, kind: Event, fields: Mapping[str, object], now: float) -> None:
        """Fold an event of a kind fault records are made of, read as its record."""
        if kind not in FOLDED:
            return
        self._now = now
        match fields_of(kind, fields):
            case FaultFields() as f:
                self._on_fault(f)
            case FailureFields() as f:
                self._on_failure(f)
            case RestartFields():
                self._on_restart()
            case StartedFields() as f:
                self._on_started(f)
            case GenerationFields() as f:
                self._on_generation(f)
            case RecoveredFields() as f:
                self._on_recovered(f)
            case TrainedFields() as f:
                self._end_short(f.step)
            case DrainFields() as f:
                self.drains[f.drain] = f
            case ResumedFields() as f:
                self._on_resumed(f)
            case HealedFields() as f:
                self.heals.on_healed(f, now)
            case StateSizeFields() as f:
                self.heals.on_state_size(f)
            case InjectedFields() as f:
                self._drills.setdefault(f.worker, (f.kind, f.at))

    @classmethod
    def replay(cls, lines: list[dict[str, Any]]) -> Journal:
        """The records an event log holds, folded at the times it gives (lines of kinds this
        version does not know are left out)."""
        journal = cls(lambda kind, fields: None)
        known = {e.value for e in Event}
        if lines:
            journal.started_at = journal._attempt_started_at = float(lines[0]["t"])
        for line in lines:
            if line.get("event") in known:
                fields = {k: v for k, v in line.items() if k not in ("t", "event")}
                journal._fold(Event(line["event"]), fields, float(line["t"]))
        return journal

    def pending_drill(self, worker: int) -> str | None:
        """The drill (or the agent's own kill: hang, straggler) waiting for `worker`'s fault."""
        drill = self._drills.get(worker)
        return drill[0] if drill else None

    def drill_injected(self, worker: int, kind: str, at: float) -> None:
        """The next fault of `worker` is this drill (the first one named wins: a SIGSTOP drill
        stays a "hang" dated from the injection, when the hang detector later kills it).
        An event of its own, so that a replay of the log names the fault the same way."""
        emit_as(self.emit, InjectedFields(worker, kind, at))

    # -------------------------------------------------------------- folding events
    def _on_fault(self, f: FaultFields) -> None:
        detected = self._now if f.detected_at is None else f.detected_at
        drill = self._drills.pop(f.worker, None) if f.worker >= 0 else self._group_drill(
            CORRUPTION_DRILLS if f.why == "corruption" else GROUP_DRILLS)
        kind, at = drill if drill else (f.why, detected)
        rec = FaultRecord(id=len(self.faults) + 1, kind=kind, worker=f.worker, rank=f.rank,
                          at=at, decision=f.decision, reason=f.reason,
                          injected=drill is not None, committed_before=f.committed_before)
        rec.phases_ms = {"detected": round((detected - at) * 1000, 1)}
        if f.rolled_back_to is not None:
            _rolled_back(rec, f, f.rolled_back_to)
        self.faults.append(rec)

    def _group_drill(self, kinds: tuple[str, ...]) -> tuple[str, float] | None:
        """A rebuild covers every live member, and stall and wedge drills only ever target
        live members: it answers every one pending (the earliest names it). Left pending, one
        would name that worker's next, unrelated fault. So does a corruption nobody is
        blamed for, the bitflips pending."""
        taken = sorted((at, kind) for kind, at in self._drills.values() if kind in kinds)
        self._drills = {w: d for w, d in self._drills.items() if d[0] not in kinds}
        return (taken[0][1], taken[0][0]) if taken else None

    def _on_failure(self, f: FailureFields) -> None:
        """A failure on torchrun's path (a script without the API): a fault record too."""
        rank = -1 if f.rank is None else f.rank
        drill = self._drills.pop(rank, None)  # first-attempt worker ids are the ranks
        now = self._now
        kind, at = drill if drill else ("failure", now)
        self.faults.append(FaultRecord(id=len(self.faults) + 1, kind=kind, worker=rank,
                                       rank=rank, at=at, decision=FaultAction.FAIL,
                                       reason=f.reason, injected=drill is not None,
                                       phases_ms={"detected": round((now - at) * 1000, 1)}))

    def _on_restart(self) -> None:
        """Every fault not recovered yet is answered by the restart (a replacement that was
        still healing when the last replica died included)."""
        for rec in self.faults:
            if not rec.recovered and rec not in self._restarting:
                if rec.decision == FaultAction.FAIL:
                    rec.decision = FaultAction.RESTART_GROUP
                self._restarting.append(rec)

    def _on_started(self, f: StartedFields) -> None:
        """A new attempt runs: the faults it answers are recovered. What they cost: the time
        until now, and, for API scripts (which restart from step 0), every committed step of
        the attempt before, with the time spent reaching them."""
        now = self._now
        for i, rec in enumerate(self._restarting):
            rec.recovered = True
            rec.recovery_ms = round((now - rec.at) * 1000, 1)
            rec.phases_ms = {**rec.phases_ms, "restarted": rec.recovery_ms}
            if rec.committed_before >= 0:
                rec.lost_steps = rec.committed_before if i == 0 else 0  # lost once, not per fault
                rec.lost_from = self._attempt_started_at
        self._restarted, self._restarting = self._restarting, []
        self._attempt_started_at = now
        self._full, self._sizes, self._short = f.world_size or 0, {}, None

    def _on_resumed(self, f: ResumedFields) -> None:
        """The restarted workers resumed from a snapshot (the first one to say so counts): only
        the steps after it were lost, and the time since it was taken; recovery ends here."""
        step, taken_at = f.step, f.taken_at
        for i, rec in enumerate(self._restarted):
            rec.recovery_ms = round((f.loaded_at - rec.at) * 1000, 1)
            rec.phases_ms = {**rec.phases_ms, "resumed": rec.recovery_ms}
            if rec.committed_before >= 0:
                rec.lost_steps = max(0, rec.committed_before - step) if i == 0 else 0
                rec.lost_from = min(taken_at, rec.at)
            rec.resumed_step = step
        self._restarted = []

    def _on_generation(self, f: GenerationFields) -> None:
        self._sizes[f.generation] = f.world_size
        if not f.urgent:
            return
        for rec in self.faults:  # every fault decided since the last one (a burst: several)
            if rec.generation is None and rec.decision in REGENERATING:
                rec.generation = f.generation
                ms = round((f.published_at - rec.at) * 1000, 1)
                rec.phases_ms = {**rec.phases_ms, "published": ms}  # copy: status reads it

    def _on_recovered(self, f: RecoveredFields) -> None:
        gen, step = f.generation, f.step
        if step is not None:
            self._end_short(step)
        for rec in self.faults:  # faults close together are all recovered by the newest gen
            if rec.generation is not None and rec.generation <= gen and not rec.recovered:
                if rec.generation == gen:
                    _from_the_fault(rec, f)
                phases = dict(rec.phases_ms)
                for name, at in (("rebuilt", f.rebuilt), ("healed", f.healed),
                                 ("first_commit", f.first_commit)):
                    if at:
                        phases[name] = round((at - rec.at) * 1000, 1)
                rec.phases_ms = phases
                if step is not None and rec.committed_before >= 0 and \
                        rec.rolled_back_to is None:  # a rollback's are counted already
                    rec.lost_steps = max(0, rec.committed_before - step)
                rec.recovered = True
                rec.recovery_ms = phases.get("first_commit")
                if f.redone_samples is not None:
                    rec.redone_samples = f.redone_samples
                    rec.redone_fraction = f.redone_fraction or 0.0
                if f.redone_s is not None:
                    rec.redone_s = f.redone_s
                if rec.generation == gen and step is not None and \
                        self._sizes.get(gen, self._full) < self._full:
                    self._short = (rec, step)  # it resumed at `step` short of ranks

    def _end_short(self, step: int) -> None:
        """The job is whole again, or in its next recovery, or trained, at `step`: the steps
        committed since a short-handed recovery's own step were short of ranks."""
        if self._short is not None:
            rec, resumed = self._short
            rec.short_steps += max(0, step - resumed - 1)
            self._short = None


def _rolled_back(rec: FaultRecord, f: FaultFields, to_step: int) -> None:
    """Silent corruption: every replica went back to a verified step; the steps since are
    lost, and the time since that state was kept. Recovered where it was found (nobody to
    replace: a rollback, a redo) when `recovered_at` says so."""
    rec.rolled_back_to = to_step
    rec.lost_steps = max(0, rec.committed_before - to_step)
    if f.lost_from is not None:
        rec.lost_from = min(f.lost_from, rec.at)
    if f.recovered_at is not None:
        rec.recovered = True
        rec.recovery_ms = round((f.recovered_at - rec.at) * 1000, 1)
        rec.phases_ms = {**rec.phases_ms, rec.decision.value: rec.recovery_ms}


def _from_the_fault(rec: FaultRecord, f: RecoveredFields) -> None:
    """One fault, one origin: where the workers' phases count from (its generation's fault
    time: when a lost node was last seen, when the coordinator's store was lost; or the first
    phase, if earlier) is earlier than the agent's detection: the record counts from there
    too. A drill keeps its injection time."""
    origin = f.origin()
    if rec.injected or origin is None or origin >= rec.at:
        return
    shift = round((rec.at - origin) * 1000, 1)
    rec.phases_ms = {name: round(ms + shift, 1) for name, ms in rec.phases_ms.items()}
    rec.at = origin


def summarize(faults: Sequence[FaultRecord | Fault], run_seconds: float) -> dict[str, Any]:
    """Figures for a drill table or the end-of-run summary."""
    times = sorted(r.recovery_ms for r in faults if r.recovery_ms is not None)
    lost_s = _union_s([(r.at if r.lost_from is None else r.lost_from, r.at + r.recovery_ms / 1000)
                       for r in faults if r.recovery_ms is not None])
    return {
        "faults": len(faults),
        "recovered": sum(r.recovered for r in faults),
        "p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
        "max_ms": times[-1] if times else None,
        "lost_steps": sum(r.lost_steps for r in faults),
        "time_lost_s": round(lost_s, 3),
        "goodput": round(1 - lost_s / run_seconds, 4) if run_seconds > 0 else None,
    }


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the spans: faults recovered together are not counted twice."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def percentile(values: Sequence[float], p: int) -> float | None:
    """The p-th percentile (inclusive method), to 0.1; None of nothing."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[p - 1], 1)


def fault_docs(faults: list[FaultRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in faults]
