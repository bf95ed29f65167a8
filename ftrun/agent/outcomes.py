"""What a worker's exit means for the attempt: recovery's in-process decision, or torchrun's.

Owns: the supervise loop's `Outcome` (the first decision of an attempt wins), `on_exit` (an
exit recorded in it: handed to the
attempt's `Recovery` when the script uses the API or the worker is a replacement, else
remembered as the attempt's first failure), `group_decision` (the attempt's verdict once
nothing more is in-process: every member finished, or torchrun's whole-group rule over the
members' exit codes) and `stopped_by` (the result of a run a signal stopped). Pure over the
objects given; no process is touched here.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ftrun.adapters.report import WorkerExit
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RemoteWorker, RunResult, Worker
from ftrun.core.exits import signal_name
from ftrun.core.policy import Action, Decision, decide_group


@dataclass
class Outcome:
    """What the supervise loop found of the attempt so far: its exits, the first failure, and
    the decision that ends the loop (the first one made stands) or the signal that stops it."""

    decision: Decision | None = None
    signum: int | None = None
    first_failure: int | None = None
    cause: WorkerExit | None = None
    exits: list[WorkerExit] = field(default_factory=list)

    def decide(self, decision: Decision | None, cause: WorkerExit | None = None) -> None:
        """A decision found in this pass: kept only if none was made before it."""
        if decision is not None and self.decision is None:
            self.decision, self.cause = decision, cause if cause is not None else self.cause

    def overruled(self, decision: Decision) -> None:
        """A decision that stands over any made before it: this agent lost its leadership,
        so what it had decided cannot be carried out."""
        self.decision = decision

    def stop(self, signum: int | None) -> None:
        """A signal to the agent (None: none came): it ends the loop."""
        self.signum = signum


def stopped_by(sig: int, restarts: int, exits: tuple[WorkerExit, ...],
               log_dir: str | None) -> RunResult:
    """The run's result once a signal to the agent stopped this node's workers."""
    return RunResult(1, f"received {signal_name(sig)}; workers stopped", exits=exits,
                     restarts_used=restarts, log_dir=log_dir, signal_received=signal_name(sig))


def on_exit(rec: Recovery | None, worker: Worker | RemoteWorker, outcome: Outcome) -> None:
    assert worker.exit is not None
    outcome.exits.append(worker.exit)
    if rec is not None and not rec.owns(worker):
        rec.catch_up()  # its hello may still be queued
        outcome.decide(rec.handle_requests())
    if rec is not None and rec.owns(worker):
        outcome.decide(rec.on_exit(worker), worker.exit)
        return
    if worker.exit.failed and outcome.first_failure is None:
        outcome.first_failure = worker.rank
        outcome.cause = worker.exit


def group_decision(rec: Recovery | None, outcome: Outcome,
                   workers: Callable[[], Sequence[Worker | RemoteWorker]], restarts: int,
                   max_restarts: int) -> Decision | None:
    """The attempt's verdict, or None while it goes on. `workers` is asked only when the
    verdict needs them (every pass of the loop asks this; a job using the API never needs
    them: at 32,768 workers the list was built on every pass for nothing)."""
    if rec is not None and outcome.first_failure is None:
        if rec.done():
            verdict = rec.end_decision()  # FAIL names a rank lost after its last step
            outcome.cause = next((e for e in reversed(outcome.exits)
                                  if e.rank == verdict.culprit and e.failed), None)
            return verdict
        if rec.uses_api:
            return None
    # a set lookup: a pass of the loop asks this of every worker until the first says hello
    # (a tuple's `in` made it O(workers²): ~9 s of the coordinator at 32,768 workers)
    members = list(workers()) if rec is None else [
        w for w in workers() if rec.membership.is_member(w.worker_id)]
    codes = {w.rank: (w.exit.returncode if w.exit else None) for w in members}
    decision = decide_group(codes, outcome.first_failure, restarts, max_restarts)
    return None if decision.action is Action.WAIT else decision
