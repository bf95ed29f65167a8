"""`ftrun report`'s numbers: a run's event log and timeline read back and summed up.

Owns: finding the run (a log directory, a --log-dir base, or the last run on this host),
reading it, and `build_report`: faults by kind, recovery percentiles per phase, time lost,
goodput, the work each in-process recovery redid (--redo), stragglers, GPU events, restarts
and snapshots. Fault records come from replaying
the event log through the agent's own journal, so the report, `ftrun status` and the
end-of-run summary agree by construction. Only lines that `loglines` accepts, and whose
fields read into their kind's `core.events` record, are read (the report reads those
records): the rest are counted, per file, in the report.
Must not import: torch, typer, rich, matplotlib, the running agent.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ftrun.adapters import history
from ftrun.agent.journal import LOG_FILE as EVENTS_FILE
from ftrun.agent.journal import FaultRecord, Journal, fault_docs, percentile, summarize
from ftrun.agent.timeline import FILE as TIMELINE_FILE
from ftrun.cli.loglines import Skipped, line_problem
from ftrun.core import events as ev
from ftrun.core.errors import FtrunError, UsageError

F = TypeVar("F", bound=ev.Fields)
PHASE_ORDER = ("detected", "published", "rebuilt", "healed", "first_commit", "restarted",
               "resumed")


@dataclass(frozen=True)
class RunRecord:
    path: str
    events: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    faults: list[FaultRecord] = field(default_factory=list)
    skipped: dict[str, Skipped] = field(default_factory=dict)  # file name -> lines left out

    @property
    def t0(self) -> float:
        firsts = [float(x[0]["t"]) for x in (self.events, self.timeline) if x]
        return min(firsts) if firsts else 0.0

    @property
    def t1(self) -> float:
        lasts = [float(x[-1]["t"]) for x in (self.events, self.timeline) if x]
        return max(lasts) if lasts else self.t0

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def fields(self, record: type[F]) -> list[tuple[float, F]]:
        """Each `record.event` line's time and typed fields (`read_checked` let in only lines
        that read)."""
        return [(float(e["t"]), record.of(e)) for e in self.of_kind(record.event)]


def find_run_dir(where: str | None) -> str:
    """A run's log directory from what the user named: None means the last run here."""
    if where is None:
        return _last_run_dir()
    path = os.path.abspath(os.path.expanduser(where))
    if os.path.isfile(os.path.join(path, EVENTS_FILE)):
        return path
    if os.path.isdir(path):
        runs = [e.path for e in os.scandir(path)
                if e.is_dir() and os.path.isfile(os.path.join(e.path, EVENTS_FILE))]
        if runs:
            return max(runs, key=lambda p: os.stat(os.path.join(p, EVENTS_FILE)).st_mtime)
        raise UsageError(f"no ftrun event log in {where}",
                         hint="give a run's log directory (<--log-dir>/<run id>_...), or --last")
    raise UsageError(f"{where}: no such directory", hint="give a run's log directory, or --last")


def _last_run_dir() -> str:
    last = history.last_run()
    if last is None:
        raise FtrunError("no ftrun run is recorded on this host yet",
                         hint="run a job first, or give its log directory")
    run_id, path = last
    if path is None:
        raise FtrunError(f"the last run ({run_id}) kept no event log (--log-dir {os.devnull})",
                         hint="run it again without --log-dir /dev/null")
    if not os.path.isfile(os.path.join(path, EVENTS_FILE)):
        raise FtrunError(f"the last run's log directory {path} is gone",
                         hint="give another run's log directory")
    return path


def load_run(path: str) -> RunRecord:
    events, bad_events = read_checked(os.path.join(path, EVENTS_FILE), timeline=False)
    timeline, bad_samples = read_checked(os.path.join(path, TIMELINE_FILE), timeline=True)
    faults = Journal.replay(events).faults
    skipped = {name: bad for name, bad in ((EVENTS_FILE, bad_events),
                                           (TIMELINE_FILE, bad_samples)) if bad.count}
    return RunRecord(path, events, timeline, faults, skipped)


def read_checked(path: str, timeline: bool) -> tuple[list[dict[str, Any]], Skipped]:
    """The lines of an event log (or a timeline) that `loglines` accepts, and those left
    out: not JSON (a line cut off by a crash), nested past the parser's depth, or not what
    the report reads. A file not written at all holds no line."""
    out: list[dict[str, Any]] = []
    skipped = Skipped()
    try:
        with open(path, errors="replace") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = json.loads(raw)
                except (ValueError, RecursionError):
                    skipped.add(number, "not a whole JSON line")
                    continue
                why = line_problem(line, timeline) or (None if timeline else _unreadable(line))
                if why is None:
                    out.append(line)
                else:
                    skipped.add(number, why)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise FtrunError(f"cannot read {path} ({exc.strerror})",
                         hint="check the file's permissions") from None
    return out, skipped


def _unreadable(line: dict[str, Any]) -> str | None:
    """Why an event line's fields do not read into their kind's record (None: they do, or
    the kind is not one this version knows: the replay skips it)."""
    kind = line.get("event")
    if kind not in ev.FIELDS:
        return None
    try:
        ev.fields_of(ev.Event(kind), line)
    except FtrunError as exc:
        return exc.message
    return None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every whole line of an event log or a timeline (a line cut off by a crash, or a file
    not written at all, is left out)."""
    out = []
    try:
        with open(path) as f:
            for raw in f:
                try:
                    out.append(json.loads(raw))
                except (ValueError, RecursionError):
                    continue
    except FileNotFoundError:
        return []
    return out


def build_report(run: RunRecord) -> dict[str, Any]:
    seconds = max(0.0, run.t1 - run.t0)
    t0 = run.t0
    snapshots = [f for _, f in run.fields(ev.SnapshotFields)]
    return {
        "run_dir": run.path,
        "started_at": run.t0, "seconds": round(seconds, 3),
        "attempts": 1 + len(run.of_kind("restart")),
        "world_sizes": _world_sizes(run),
        "generations": len(run.of_kind("generation")),
        "last_step": max((int(x["step_max"]) for x in run.timeline
                          if x.get("step_max") is not None), default=None),
        "summary": summarize(run.faults, seconds),
        "faults_by_kind": dict(sorted(Counter(f.kind for f in run.faults).items())),
        "phases_ms": phase_table(run.faults),
        "redone": redone(run),
        "stragglers": [{"t": round(t - t0, 3), "worker": f.worker, "reason": f.reason,
                        "evicted": f.evicted} for t, f in run.fields(ev.StragglerFields)],
        "gpu_events": [{"t": round(t - t0, 3), "uuid": f.uuid, "health": f.health,
                        "reason": f.reason}
                       for t, f in _gpu_changes(run.fields(ev.GpuFields))],
        "restarts": [{"t": round(t - t0, 3), "attempt": f.attempt, "reason": f.reason}
                     for t, f in run.fields(ev.RestartFields)],
        "snapshots": {"count": len(snapshots),
                      "last_step": snapshots[-1].step if snapshots else None,
                      "blocking_ms_median": _median([f.blocking_ms for f in snapshots]),
                      "write_ms_median": _median([f.write_ms for f in snapshots]),
                      "failed": len(run.of_kind("snapshot_failed"))},
        "faults": fault_docs(run.faults),
        "skipped_lines": {name: {"count": bad.count, "first": bad.first}
                          for name, bad in run.skipped.items()},
    }


def phase_table(faults: Sequence[FaultRecord]) -> dict[str, dict[str, float | int | None]]:
    """Per phase (ms after the fault that it ended), and for the whole recovery: count,
    p50, p95, max, over the faults that went through it."""
    table: dict[str, dict[str, float | int | None]] = {}
    for phase in (*PHASE_ORDER, "recovery"):
        if phase == "recovery":
            values = sorted(f.recovery_ms for f in faults if f.recovery_ms is not None)
        else:
            values = sorted(f.phases_ms[phase] for f in faults if phase in f.phases_ms)
        if values:
            table[phase] = {"count": len(values), "p50": percentile(values, 50),
                            "p95": percentile(values, 95), "max": values[-1]}
    return table


def redone(run: RunRecord) -> list[dict[str, Any]]:
    """Per in-process recovery (its generation's first commit): the work of the broken step
    it redid, job-wide: samples (-1: the script cut its batches itself), the fraction of the
    step (--redo lost: the lost ranks' share; --redo step: 1.0; 0: no step broke) and the
    seconds that took (the make-up pass, or the repeated step; None: an older log)."""
    return [{"generation": e.get("generation"), "step": e.get("step"),
             "samples": e["redone_samples"], "fraction": e.get("redone_fraction"),
             "seconds": e.get("redone_s")}
            for e in run.of_kind("recovered") if "redone_samples" in e]


def _gpu_changes(events: Sequence[tuple[float, ev.GpuFields]]
                 ) -> list[tuple[float, ev.GpuFields]]:
    """GPU events that change something: not the first look at a healthy GPU."""
    seen: dict[str, str] = {}
    out = []
    for t, f in events:
        if seen.get(f.uuid, "healthy") != f.health:
            out.append((t, f))
        seen[f.uuid] = f.health
    return out


def _world_sizes(run: RunRecord) -> list[int]:
    """The world size as it changed: the first attempt's, then each generation's."""
    sizes = [f.world_size for _, f in run.fields(ev.StartedFields)
             if f.world_size is not None][:1]
    if not sizes and run.timeline:
        sizes = [int(run.timeline[0].get("world_size", 0))]
    for _, f in run.fields(ev.GenerationFields):
        if not sizes or sizes[-1] != f.world_size:
            sizes.append(f.world_size)
    return sizes


def _median(values: Sequence[float | None]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None
