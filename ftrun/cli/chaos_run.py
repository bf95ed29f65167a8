"""Chaos drills, the loop: `ftrun inject-fault --chaos` against a running job.

Owns: following the seeded plan (chaos.plan) over the control socket: one fault at a time,
each sent only once the previous one has settled and the job is whole again (every member
back, committing), so that the job never has more to absorb than its policy allows; a slow
drill's hold and release; what the run collected (`ChaosRun`) for the summary.
Must not import: torch, typer, rich (render.py prints), the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ftrun.adapters import control
from ftrun.cli import chaos
from ftrun.core.errors import FtrunError
from ftrun.core.faultkinds import FaultKind
from ftrun.protocol.control import GpuInjected, Injected, Preempted, read_reply
from ftrun.protocol.control_ops import InjectOp
from ftrun.protocol.status import Fault, Status

SETTLE_WAIT_S = 120.0  # a fault not recovered (or decided) by then stops the chaos
WHOLE_WAIT_S = 60.0  # the job back to its members (and spares) after a recovery
POLL_S = 0.2  # status is asked this often while waiting (a cheap local request)
Say = Callable[[str], None]


@dataclass
class ChaosRun:
    """What the chaos did: the kinds sent in order, the faults the job recorded meanwhile."""

    started_at: float  # wall clock
    ended_at: float = 0.0
    injected: list[str] = field(default_factory=list)
    faults: tuple[Fault, ...] = ()
    skipped: int = 0  # planned faults that could not hit their rank (an xid: no healthy GPU)
    stopped: str = ""  # why it stopped before its plan ended ("" when it did not)
    error: FtrunError | None = None  # what stopped it, when that is an error

    @property
    def window_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    @property
    def unsettled(self) -> int:
        return sum(not f.settled for f in self.faults)


def run(info: control.RunInfo, spec: chaos.ChaosSpec, say: Say) -> ChaosRun:
    """Follow the plan until --count faults are sent or --duration has passed, or the job
    ends (`stopped` says so). The spec's kinds are already checked against the job."""
    doc = control.status(info)
    members, spares, first = _members(doc), _spares(doc), len(doc.faults)
    result = ChaosRun(started_at=time.time())
    deadline = time.monotonic() + spec.duration_s if spec.duration_s else float("inf")
    try:
        for n, planned in enumerate(chaos.plan(spec, members), start=1):
            if spec.count and n > spec.count:
                break
            if time.monotonic() + planned.delay_s >= deadline:
                time.sleep(max(0.0, deadline - time.monotonic()))
                break
            time.sleep(planned.delay_s)
            doc = control.status(info)
            result.faults = doc.faults[first:]
            if not _inject(info, doc, planned, n, spec, result, say):
                continue
            result.faults = _wait_settled(info, first, len(doc.faults), planned.kind not in (
                FaultKind.SLOW, FaultKind.PREEMPT))  # neither is a fault
            _wait_whole(info, members, spares)
    except control.JobGone:
        result.stopped = "the job ended"
    except FtrunError as exc:  # the summary of what was done still prints; then this error
        result.error = exc
    result.ended_at = time.time()
    return result


def _inject(info: control.RunInfo, doc: Status, planned: chaos.Planned, n: int,
            spec: chaos.ChaosSpec, result: ChaosRun, say: Say) -> bool:
    """Send one planned fault (a slow one: hold it, then give the rank its speed back)."""
    rank = chaos.live_rank(doc, planned.rank)
    op = None if rank is None else chaos.drill_of(doc, planned, rank, n)
    of = f"/{spec.count}" if spec.count else ""
    if rank is None or op is None:
        result.skipped += 1
        say(f"ftrun: chaos {n}{of}: no {planned.kind} now (no member rank with a healthy "
            f"GPU); skipped")
        return False
    reply = control.request(info, op.to_wire())
    result.injected.append(planned.kind)
    at = f"t+{time.time() - result.started_at:.1f} s"
    if op.kind == FaultKind.PREEMPT:
        sent = read_reply(Preempted, reply)
        say(f"ftrun: chaos {n}{of} ({at}): preempt: a notice to the job's agent (pid "
            f"{sent.pid}): its ranks hand over within {sent.window_s:g} s, or it requeues")
        return True
    if op.gpu is not None:
        hit = read_reply(GpuInjected, reply)
        say(f"ftrun: chaos {n}{of} ({at}): xid {op.xid} into GPU {hit.gpu} (rank {rank})")
        return True
    who = read_reply(Injected, reply)
    extra = f" (+{op.arg:g} s a step for {chaos.SLOW_HOLD_S:g} s)" if op.arg else ""
    say(f"ftrun: chaos {n}{of} ({at}): {planned.kind} into rank {rank} (worker "
        f"{who.worker}){extra}")
    if planned.kind == FaultKind.SLOW:
        time.sleep(chaos.SLOW_HOLD_S)
        control.request(info, InjectOp(FaultKind.SLOW, rank, None, arg=0.0).to_wire())
    return True


def _wait_settled(info: control.RunInfo, first: int, mark: int,
                  expect_fault: bool) -> tuple[Fault, ...]:
    """The chaos window's faults once the ones recorded after `mark` are all settled (and,
    `expect_fault`, there is at least one): else a one-line FtrunError after SETTLE_WAIT_S."""
    deadline = time.monotonic() + SETTLE_WAIT_S
    while True:
        faults = control.status(info).faults
        new = faults[mark:]
        if (new or not expect_fault) and all(f.settled for f in new):
            return faults[first:]
        if time.monotonic() >= deadline:
            what = (f"{sum(not f.settled for f in new)} fault(s) not recovered" if new
                    else "the drill made no fault")
            raise FtrunError(f"chaos stopped: {what} after {SETTLE_WAIT_S:g} s",
                             hint="see `ftrun status` and the run's events.jsonl")
        time.sleep(POLL_S)


def _wait_whole(info: control.RunInfo, members: int, spares: int) -> None:
    """Until the job has its members back, each committing, and its spares (the next fault
    must find the job as the policy left it after the last one settled)."""
    deadline = time.monotonic() + WHOLE_WAIT_S
    while True:
        doc = control.status(info)
        if _members(doc) >= members and _spares(doc) >= spares and _committing(doc):
            return
        if time.monotonic() >= deadline:
            raise FtrunError(f"chaos stopped: the job did not get back to {members} members "
                             f"and {spares} spare(s) within {WHOLE_WAIT_S:g} s (now "
                             f"{_members(doc)} and {_spares(doc)})",
                             hint="see `ftrun status`")
        time.sleep(POLL_S)


def _members(doc: Status) -> int:
    return sum(w.role == "member" for w in doc.workers)


def _spares(doc: Status) -> int:
    return sum(w.role == "spare" for w in doc.workers)


def _committing(doc: Status) -> bool:
    return all(w.committed_step is not None for w in doc.workers if w.role == "member")
