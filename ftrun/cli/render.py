"""Turning results into text for people: rich on a terminal, plain when piped.

Owns: printing agent notices (from the events' typed fields), the end-of-run failure report
and fault summary, the drill and report tables (from the `protocol.status` records); the
`ftrun status` view is cli/status_view.py's.
Must not import: torch, the agent internals (it receives plain data and records).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, TextIO

from ftrun.adapters.report import WorkerExit, failure_block
from ftrun.core import events as ev
from ftrun.core.errors import FtrunError
from ftrun.protocol.status import (
    Fault,
    Summary,
)


def use_rich(stream: TextIO) -> bool:
    return stream.isatty()


def notice(kind: str, fields: Mapping[str, object], stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    if kind not in _SHOWN:
        return
    try:
        text = _notice_text(ev.fields_of(ev.Event(kind), fields))
    except FtrunError as exc:  # the console must never stop the job
        text = f"{kind} {dict(fields)} (unreadable: {exc.message})"
    if text:
        print(f"ftrun: {text}", file=stream, flush=True)


_SHOWN = {ev.Event.NOTICE, ev.Event.FAILURE, ev.Event.FAULT, ev.Event.GENERATION,
          ev.Event.RECOVERED, ev.Event.RESTART, ev.Event.SNAPSHOT_FAILED, ev.Event.HEALED,
          ev.Event.RESUMED, ev.Event.SIGNAL}  # the kinds the console says something of


def _notice_text(f: ev.Fields) -> str | None:
    match f:
        case ev.NoticeFields():
            return f.text
        case ev.FaultFields(decided_with=int()):
            return None  # said with the first node's record of the same decision
        case ev.FailureFields() | ev.FaultFields():
            return f.reason
        case ev.GenerationFields():
            return f"generation {f.generation}: {f.world_size} workers ({f.reason})"
        case ev.RecoveredFields(fault_at=float() | int() as fault_at) if fault_at:
            return _recovered_text(f, fault_at)
        case ev.RestartFields():
            return f"restart {f.attempt} starting"
        case ev.SnapshotFailedFields():
            return f"snapshot of step {f.step} could not be written to {f.dir}: {f.error}"
        case ev.HealedFields():
            return (f"worker {f.worker} healed {f.nbytes / 1e6:.1f} MB from {f.sources} "
                    f"source(s) (ranks {f.source_ranks}) in {f.seconds:.2f} s ({f.gb_per_s} "
                    f"GB/s)")
        case ev.ResumedFields():
            return (f"worker {f.worker} resumed from step {f.step} ({f.source}, "
                    f"{f.load_ms:.0f} ms)")
        case ev.SignalFields() if f.workers:
            return (f"received {f.signal}; forwarded to {f.workers} workers, SIGKILL in "
                    f"{f.grace_s}s (send it again to kill now)")
        case ev.SignalFields():
            return f"received {f.signal} again; killing the workers now"
    return None


def _recovered_text(f: ev.RecoveredFields, fault_at: float) -> str:
    t0 = f.origin() or fault_at  # the journal's fault record counts from the same origin
    shown = ", ".join(f"{name} +{(at - t0) * 1000:.0f}" for name, at in f.phases())
    return f"generation {f.generation} committed step {f.step} (ms after the fault: {shown})"


def print_failure(title: str, cause: WorkerExit, exits: tuple[WorkerExit, ...],
                  restarts_used: int, max_restarts: int, log_dir: str | None,
                  stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    lines = failure_block(title, cause, exits, restarts_used, max_restarts, log_dir)
    if use_rich(stream):
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text

        body = Text("\n".join(lines[1:]))
        Console(file=stream).print(Panel(body, title=f"[bold red]{lines[0]}", expand=False))
        return
    width = min(max(len(ln) for ln in lines), 60)
    print("\n".join(["=" * width, lines[0], "-" * width, *lines[1:], "=" * width]),
          file=stream, flush=True)


# ------------------------------------------------------------------ status and drills
def fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}{unit}" if abs(value) >= 10 else f"{value:.2f}{unit}"
    return f"{value}{unit}"


def print_runs(runs: Sequence[Any], stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    print(f"{len(runs)} ftrun jobs are running (pick one with --run-id):", file=stream)
    for r in runs:
        print(f"  {r.run_id}  pid {r.pid}  {r.script}", file=stream)


def fault_table(title: str, faults: Sequence[Fault]) -> Any:
    """One row per fault: what, where, the decision, and the recovery phases in ms."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("#", "kind", "rank", "decision", "recovered", "ms", *PHASE_COLUMNS):
        table.add_column(col)
    for f in faults:
        table.add_row(str(f.id), f.kind, str(f.rank), f.decision,
                      "yes" if f.recovered else "no", fmt(f.recovery_ms),
                      *(fmt(f.phases_ms.get(p)) for p in PHASE_KEYS))
    return table


PHASE_KEYS = ("detected", "published", "rebuilt", "healed", "first_commit")
PHASE_COLUMNS = ("detected", "published", "comm rebuilt", "healed", "1st commit")


def print_drill(faults: Sequence[Fault], stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    from ftrun.agent.journal import summarize

    if not faults:
        print("ftrun: no fault was recorded (the job may have ended first)", file=stream)
        return
    from rich.console import Console

    console = Console(file=stream, force_terminal=stream.isatty(), width=140)
    console.print(fault_table("drill", faults))
    s = Summary.from_json(summarize(faults, 0.0))
    console.print(f"recovery p50 {fmt(s.p50_ms, ' ms')}, p95 {fmt(s.p95_ms, ' ms')}, "
                  f"max {fmt(s.max_ms, ' ms')}; committed steps lost: {s.lost_steps}")


def print_run_summary(faults: Sequence[Any], run_seconds: float,
                      stream: TextIO | None = None, ended: str = "") -> None:
    """After a run that survived faults: how many, how fast, what it cost. `ended`: how a
    run that did not succeed ended ("failed", "was interrupted"); with a fault not recovered
    by then, the summary says so, and counts the time since that fault as lost."""
    from ftrun.agent.journal import summarize

    stream = stream or sys.stderr
    if all(f.decision == "fail" for f in faults):
        return  # nothing was recovered or tried: the failure report says it all
    s = Summary.from_json(summarize(list(faults), run_seconds))
    open_faults = [f for f in faults if not f.recovered]
    if ended and open_faults:
        print(_unfinished_summary(faults, open_faults, run_seconds, ended, s), file=stream,
              flush=True)
        return
    restarted = sum("restarted" in f.phases_ms and f.recovered for f in faults)
    resumed = sorted({f.resumed_step for f in faults if f.resumed_step is not None})
    how = f" ({restarted} by restarting every worker)" if restarted else ""
    if resumed:
        how = (f" ({restarted} by restarting every worker, from the snapshot of step"
               f"{'s' if len(resumed) > 1 else ''} {', '.join(map(str, resumed))}; "
               f"{s.lost_steps} committed steps recomputed)")
    print(f"ftrun: survived {s.recovered}/{s.faults} faults{how}; recovery p50 "
          f"{fmt(s.p50_ms, ' ms')}, p95 {fmt(s.p95_ms, ' ms')}, max "
          f"{fmt(s.max_ms, ' ms')}{_redone(faults)}; time lost {s.time_lost_s} s; goodput "
          f"{fmt(s.goodput)}", file=stream, flush=True)


def _redone(faults: Sequence[Any]) -> str:
    """`; redone 640 samples (0.25 of a step) in 0.31 s; 2 steps short-handed` over the
    faults whose recovery said (--redo), and the steps a silent corruption's rollback redid:
    what a fault cost beside its recovery time."""
    short = sum(getattr(f, "short_steps", 0) for f in faults)
    short_text = f"; {short} step{'s' if short != 1 else ''} short-handed" if short else ""
    rolled = sum(f.lost_steps for f in faults if getattr(f, "rolled_back_to", None) is not None)
    if rolled:  # silent corruption: every replica went back to its last verified step
        short_text = f"; {rolled} committed steps rolled back and redone{short_text}"
    told = [f for f in faults if getattr(f, "redone_samples", None) is not None
            and f.redone_samples > 0]  # a fault between two steps redid nothing
    if not told:
        return short_text
    steps = sum(f.redone_fraction or 0.0 for f in told)
    seconds = [f.redone_s for f in told if getattr(f, "redone_s", None) is not None]
    took = f" in {sum(seconds):.2f} s" if seconds else ""
    return (f"; redone {sum(f.redone_samples for f in told)} samples ({steps:.2f} of a step)"
            f"{took}{short_text}")


def _unfinished_summary(faults: Sequence[Any], open_faults: Sequence[Any],
                        run_seconds: float, ended: str, s: Summary) -> str:
    """`recovered 1 of 2 faults; the job failed before fault #2 (kill, rank 1) recovered,
    3.2 s after it; ...`: an unrecovered fault's time is lost up to the end of the run."""
    import dataclasses
    import time

    from ftrun.agent.journal import summarize

    now = time.time()
    first = min(open_faults, key=lambda f: f.at)
    to_the_end = [f if f.recovered else dataclasses.replace(
        f, recovery_ms=round(max(0.0, now - f.at) * 1000, 1)) for f in faults]
    lost = Summary.from_json(summarize(to_the_end, run_seconds))
    when = ("on" if first.decision == "fail" else "before") + f" fault #{first.id} " \
        f"({first.kind}, rank {first.rank})" + (" recovered" if first.decision != "fail" else "")
    return (f"ftrun: recovered {s.recovered} of {s.faults} faults; the job {ended} "
            f"{when}, {max(0.0, now - first.at):.1f} s after it; recovery p50 "
            f"{fmt(s.p50_ms, ' ms')}, max {fmt(s.max_ms, ' ms')} (of those "
            f"recovered); time lost {lost.time_lost_s} s; goodput {fmt(lost.goodput)}")


# ------------------------------------------------------------------ ftrun report
def print_report(rep: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """`ftrun report`: what the run went through, where the time went."""
    from rich.console import Console
    from rich.table import Table

    stream = stream or sys.stdout
    # the texts come from a log file that anyone may have written: no markup, no escapes
    console = Console(file=stream, force_terminal=stream.isatty(), width=120, markup=False,
                      highlight=False, emoji=False)
    rep = _printable(rep)
    s = rep["summary"]
    kinds = ", ".join(f"{k} {n}" for k, n in rep["faults_by_kind"].items())
    console.print(f"run {rep['run_dir']}: {rep['seconds']:.1f} s, {rep['attempts']} "
                  f"attempt{'s' if rep['attempts'] != 1 else ''}, world size "
                  f"{' -> '.join(map(str, rep['world_sizes'])) or '-'}, last committed step "
                  f"{fmt(rep['last_step'])}")
    console.print(f"faults: {s['faults']}{f' ({kinds})' if kinds else ''}, recovered "
                  f"{s['recovered']}; time lost {s['time_lost_s']} s, goodput "
                  f"{fmt(s['goodput'])}, committed steps lost {s['lost_steps']}"
                  f"{_redone([SimpleNamespace(**f) for f in rep['faults']])}")
    if rep["phases_ms"]:
        table = Table(title="recovery, ms after the fault", title_justify="left")
        for col in ("phase", "faults", "p50", "p95", "max"):
            table.add_column(col)
        for phase, row in rep["phases_ms"].items():
            table.add_row(phase, str(row["count"]), fmt(row["p50"]), fmt(row["p95"]),
                          fmt(row["max"]))
        console.print(table)
    for st in rep["stragglers"]:
        console.print(f"straggler at +{st['t']:.1f} s: worker {st['worker']} ({st['reason']})"
                      + (", evicted" if st["evicted"] else ""))
    for g in rep["gpu_events"]:
        console.print(f"GPU at +{g['t']:.1f} s: {g['uuid']} {g['health']} ({g['reason']})")
    for r in rep["restarts"]:
        console.print(f"restart {r['attempt']} at +{r['t']:.1f} s: {r['reason']}")
    for name, bad in rep.get("skipped_lines", {}).items():
        console.print(f"skipped {bad['count']} malformed line{'s' if bad['count'] != 1 else ''}"
                      f" of {name} (the first, {bad['first']})")
    snap = rep["snapshots"]
    if snap["count"]:
        console.print(f"snapshots: {snap['count']}, the last of step {snap['last_step']}; "
                      f"blocking {fmt(snap['blocking_ms_median'], ' ms')}, write "
                      f"{fmt(snap['write_ms_median'], ' ms')} (medians)")
    if snap.get("failed"):
        console.print(f"snapshots that could not be written: {snap['failed']}")
    if rep.get("picture"):
        console.print(f"picture: {rep['picture']}")


def _printable(value: Any) -> Any:
    """`value` with every control character of its texts shown as '?' (a crafted log must
    not move the cursor or retitle the terminal)."""
    if isinstance(value, str):
        return "".join(c if c.isprintable() else "?" for c in value)
    if isinstance(value, Mapping):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value
