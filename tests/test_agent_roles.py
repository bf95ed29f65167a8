"""The agent's one loop at the top swaps the node's roles (#49): a role's `drive` returns the
run's result or a `Handover` to the next role, which the loop prepares and drives after the
last one's frames are gone. A real `Agent` (its guardian, wakeup, starter and services, no
zygote, no worker) with fake roles; the allowed role changes are `core.states.NodeRole`'s."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftrun.agent.cluster import Adopt, Cluster, Handover, Local
from ftrun.agent.node import Agent
from ftrun.agent.pacing import Pacing
from ftrun.agent.roster import RemoteWorker, RunResult
from ftrun.core import timeouts
from ftrun.core.spec import RunSpec
from ftrun.core.states import NodeRole, TransitionError, role_change_refused


class FakeRole(Local):
    """A role whose run is scripted: `then` is what its drive returns (a result, or the
    next role); it records what the agent did to it, in order. (`Local` for the rest.)"""

    def __init__(self, role: NodeRole, log: list[str], then: RunResult | Handover,
                 runs_attempts: bool = False) -> None:
        self.role = role
        self.log = log
        self.then = then
        self.runs_attempts = runs_attempts
        self.closed: list[RunResult | None] = []

    def prepare(self) -> None:
        self.log.append(f"{self.role} prepare")

    def drive(  # type: ignore[override]  # `Local` never hands over; a fake role does
            self, attempts: Callable[[], RunResult]) -> RunResult | Handover:
        self.log.append(f"{self.role} drive")
        if self.runs_attempts:
            attempts()
        return self.then

    def close(self, result: RunResult | None) -> None:
        self.log.append(f"{self.role} close")
        self.closed.append(result)


def _typed(role: FakeRole) -> Cluster:
    return role  # mypy checks here that a fake role fits the protocol


@pytest.fixture
def spec(tmp_path: Path) -> RunSpec:
    return RunSpec("train.py", nproc=1, gpu_backend="none", log_dir=str(tmp_path), zygote=False)


@pytest.fixture
def log() -> Iterator[list[str]]:
    yield []


def test_a_follower_that_takes_over_is_driven_as_the_coordinator_by_the_loop(
        spec: RunSpec, log: list[str]) -> None:
    done = RunResult(0, "the job ended under its new coordinator")
    coordinating = FakeRole(NodeRole.COORDINATING, log, done)
    following = FakeRole(NodeRole.FOLLOWING, log, Handover(coordinating))
    agent = Agent(spec, lambda a: following)
    result = agent.run()
    assert result.reason == done.reason and result.exit_code == 0
    assert log == ["following prepare", "following drive", "coordinating prepare",
                   "coordinating drive", "coordinating close"]
    assert following.closed == [] and coordinating.closed == [result]  # it shares the plane
    assert agent.cluster is coordinating
    assert agent.runtime.workers.on_exit == coordinating.on_local_exit


def test_roles_change_as_often_as_the_job_needs_each_hands_its_attempts_adopt(
        spec: RunSpec, log: list[str]) -> None:
    """A coordinator deposed follows the new one, then takes over when that one's host is
    lost: every role runs from the loop, and a takeover's `adopt` reaches the attempts."""
    adopt: Adopt = lambda store: None  # type: ignore[assignment,return-value]  # noqa: E731
    last = FakeRole(NodeRole.COORDINATING, log, RunResult(0, "done"), runs_attempts=True)
    middle = FakeRole(NodeRole.FOLLOWING, log, Handover(last, adopt))
    first = FakeRole(NodeRole.COORDINATING, log, Handover(middle), runs_attempts=True)
    agent = Agent(spec, lambda a: first)
    attempts: list[Adopt | None] = []

    def attempts_run(adopting: Adopt | None = None) -> RunResult:
        attempts.append(adopting)
        return RunResult(1, "the attempt's result")

    agent._run_attempts = attempts_run  # type: ignore[method-assign,assignment]  # no worker
    assert agent.run().reason == "done"
    assert attempts == [None, adopt]  # its own attempts, then the adopted one's
    assert [e for e in log if e.endswith("drive")] == [
        "coordinating drive", "following drive", "coordinating drive"]


def test_a_role_change_the_state_machine_forbids_is_a_defect_and_the_run_still_closes(
        spec: RunSpec, log: list[str]) -> None:
    coordinating = FakeRole(NodeRole.COORDINATING, log, RunResult(0, "never"))
    alone = FakeRole(NodeRole.ALONE, log, Handover(coordinating))
    agent = Agent(spec, lambda a: alone)
    with pytest.raises(TransitionError, match="from alone to coordinating"):
        agent.run()
    assert "coordinating prepare" not in log and alone.closed == [None]


@pytest.mark.parametrize("src,dst", list(itertools.product(NodeRole, NodeRole)))
def test_the_allowed_role_changes(src: NodeRole, dst: NodeRole) -> None:
    allowed = {(NodeRole.COORDINATING, NodeRole.FOLLOWING),  # deposed: follows the new one
               (NodeRole.FOLLOWING, NodeRole.COORDINATING)}  # elected: adopts the job
    refused = role_change_refused(src, dst)
    assert (refused is None) == ((src, dst) in allowed)
    if refused is not None:
        assert src.value in refused and dst.value in refused


class BurstRole(FakeRole):
    """Other nodes' exits as the loop collects them: one list per call, then none."""

    def __init__(self, log: list[str], exits: Iterator[list[RemoteWorker]]) -> None:
        super().__init__(NodeRole.COORDINATING, log, RunResult(0, "done"))
        self.exits = exits

    def remote_exits(self) -> list[RemoteWorker]:
        return next(self.exits, [])

    def begin(self) -> None:
        """The pass that gathers the burst begins now."""


class SpacedRole(BurstRole):
    """Other nodes' exits reported `gap_s` apart, the first as the pass begins: the loop
    reads them only between its waits for its own workers' exits."""

    def __init__(self, log: list[str], lost: list[RemoteWorker], gap_s: float) -> None:
        super().__init__(log, iter([]))
        self.lost, self.gap_s, self.start = list(lost), gap_s, time.monotonic()
        self.given = 0

    def begin(self) -> None:
        self.start = time.monotonic()

    def remote_exits(self) -> list[RemoteWorker]:
        now = time.monotonic()
        due = min(len(self.lost), int((now - self.start) / self.gap_s) + 1)
        taken, self.given = self.lost[self.given:due], max(self.given, due)
        return taken


def _rest_of_burst(spec: RunSpec, role: BurstRole,
                   after_a_pass: bool = False) -> tuple[list[int], float]:
    """What `Pacing` gathers after a first exit from `role`'s exits, waiting as the loop
    waits for its own workers' (none here), and how long it took."""
    pacing = Pacing()
    if after_a_pass:  # a pass decided exits just now
        pacing.passed(has_exits=True, ran_checks=True)
    start = time.monotonic()
    role.begin()

    def gather(timeout_s: float) -> list[RemoteWorker]:
        time.sleep(timeout_s)
        return role.remote_exits()

    more = pacing.rest_of_burst(gather)
    return [w.worker_id for w in more], time.monotonic() - start


def test_exits_that_follow_one_within_the_quiet_window_join_its_pass(
        spec: RunSpec, log: list[str]) -> None:
    """Ranks lost together (a switch, a rack) are decided in one pass of the loop, so that
    they make one generation: each exit that follows within `BURST_QUIET_S` of the last one
    joins; a quiet window with none ends the burst; a stream that never stops is cut at
    `BURST_MAX_S` (the loop must go on)."""
    lost = [RemoteWorker(rank=r, local_rank=0, worker_id=r * 10_000, node=r) for r in (1, 2)]
    burst = iter([[lost[0]], [lost[1]]])
    got, _ = _rest_of_burst(spec, BurstRole(log, burst))
    assert got == [10_000, 20_000]
    endless = itertools.repeat([lost[0]])
    got, took = _rest_of_burst(spec, BurstRole(log, endless))
    assert len(got) > 2 and timeouts.BURST_MAX_S <= took < timeouts.BURST_MAX_S + 1.0
    got, took = _rest_of_burst(spec, BurstRole(log, iter([])))
    assert got == [] and took < 1.0


def test_the_rest_of_a_burst_after_its_first_pass_is_gathered_into_one(
        spec: RunSpec, log: list[str]) -> None:
    """Exits reported while a pass decided the first of a burst come spread out (10 exits
    over 9.5 ms made 3 generations on etcd at 256 nodes): within `BURST_FOLLOW_S` of a pass
    that decided exits, the next waits `BURST_TAIL_QUIET_S` for quiet, not `BURST_QUIET_S`,
    up to `BURST_TAIL_MAX_S`, so that 10 faults over 0.1 s make 2 generations (the first
    fault's, then the rest's); a fault on its own still waits only `BURST_QUIET_S`."""
    lost = [RemoteWorker(rank=r, local_rank=0, worker_id=r * 10_000, node=r)
            for r in range(1, 10)]  # the 9 that follow the first of 10
    gap_s = 0.9 * timeouts.BURST_TAIL_MAX_S / len(lost)  # 10 ms: all of them within 0.1 s
    assert timeouts.BURST_QUIET_S < gap_s < timeouts.BURST_TAIL_QUIET_S
    got, _ = _rest_of_burst(spec, SpacedRole(log, lost, gap_s))
    assert got[0] == 10_000 and len(got) < len(lost)  # alone: the rest came after the quiet
    got, _ = _rest_of_burst(spec, SpacedRole(log, lost, gap_s), after_a_pass=True)
    assert got == [w.worker_id for w in lost]  # a burst's rest: one pass, one generation


def test_a_pass_that_decides_exits_leaves_its_periodic_checks_to_the_next() -> None:
    """A fault's pass publishes before the checks that read every node's heartbeat and judge
    every member (10-17 ms of a fault's 16 ms at 1,024 nodes); the next pass runs them. Owed
    for one pass at most: exits in every pass still get their checks."""
    pacing = Pacing()
    assert pacing.runs_checks(has_exits=False)
    assert not pacing.runs_checks(has_exits=True)  # a fault's pass
    pacing.passed(has_exits=True, ran_checks=False)
    assert pacing.runs_checks(has_exits=True)  # owed: run even in a pass with exits
    pacing.passed(has_exits=True, ran_checks=True)
    assert not pacing.runs_checks(has_exits=True)
