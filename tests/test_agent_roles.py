"""The agent's one loop at the top swaps the node's roles (#49): a role's `drive` returns the
run's result or a `Handover` to the next role, which the loop prepares and drives after the
last one's frames are gone. A real `Agent` (its guardian, wakeup, starter and services, no
zygote, no worker) with fake roles; the allowed role changes are `core.states.NodeRole`'s."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftrun.agent.cluster import Adopt, Cluster, Handover, Local
from ftrun.agent.node import Agent
from ftrun.agent.roster import RunResult
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
    assert agent.workers.on_exit == coordinating.on_local_exit


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
