"""The health watch as an object, without processes: what one `HealthWatch.tick` finds over
real progress slots (written by the worker's own `Reporter`, at given times) and a fake node
typed as `WatchPort`. The pure detectors are tested case by case in test_hangs.py and
test_health.py; here: which rows they are given, when, and what the watch makes of them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from fakes import fake_worker

from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.ports import WatchPort
from ftrun.agent.roster import Worker
from ftrun.agent.watch import (
    CHECK_EVERY_S,
    HANG_CHECK_MARGIN_S,
    KILL_EXIT_WAIT_S,
    ROWS_PER_CHECK,
    STRAGGLER_CHECKS,
    Drain,
    HealthWatch,
    Kill,
    Rebuild,
    next_hang_check_s,
)
from ftrun.core.events import Event
from ftrun.core.membership import Membership
from ftrun.core.policy import Liveness
from ftrun.core.spec import RunSpec
from ftrun.core.states import Phase
from ftrun.core.timeouts import GPU_THROTTLE_SUSTAINED_S
from ftrun.gpu.verdicts import Health, Verdict
from ftrun.protocol.progress import Reporter

T = 1000.0  # the workers' clock, and the watch's `now`


@dataclass
class WatchNode:
    """The node as the health watch reads it: this node's workers, the others' liveness."""

    spec: RunSpec
    workers: list[Worker] = field(default_factory=list)
    remote: list[Liveness] = field(default_factory=list)
    events: list[tuple[Event, dict[str, Any]]] = field(default_factory=list)

    def emit(self, kind: Event, fields: Mapping[str, object]) -> None:
        self.events.append((kind, dict(fields)))

    def wake(self) -> None:
        pass

    def workers_snapshot(self) -> list[Worker]:
        return [w for w in self.workers if w.alive]

    def live_members(self) -> list[Worker]:
        return sorted(self.workers_snapshot(), key=lambda w: w.rank)

    def remote_liveness(self) -> list[Liveness]:
        return list(self.remote)

    def of_kind(self, kind: Event) -> list[dict[str, Any]]:
        return [f for k, f in self.events if k is kind]


@dataclass
class Watched:
    watch: HealthWatch
    node: WatchNode
    reporters: dict[int, Reporter]  # each worker's side of its slot

    def tick(self, ms: Membership | None, at: float) -> list[Any]:
        return list(self.watch.tick(ms, T + at))


@pytest.fixture
def watched(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Watched]:
    """Three members of one node (workers 0-2, ranks 0-2), each with its slot reset as the
    agent resets it before a worker starts; `--hang-timeout 5` unless a test says otherwise."""
    spec = RunSpec("train.py", **{"nproc": 3, "hang_timeout": 5.0, "gpu_backend": "none",
                                  **getattr(request, "param", {})})
    node = WatchNode(spec, [fake_worker(i, i, i) for i in range(3)])
    port: WatchPort = node  # mypy checks here that the fake fits the port
    slots = ProgressSlots(str(tmp_path))
    for w in node.workers:
        slots.reset(w.worker_id)
    reporters = {w.worker_id: Reporter(str(tmp_path), w.worker_id) for w in node.workers}
    watch = HealthWatch(port, slots)
    yield Watched(watch, node, reporters)
    for r in reporters.values():
        r.slot.close()
    watch.close()
    slots.close()


def api(members: tuple[int, ...] = (0, 1, 2)) -> Membership:
    """The attempt's membership once a worker said hello (the script uses the API)."""
    ms = Membership(members)
    ms.api_users.add(members[0])
    return ms


def in_step(w: Watched, step: int, at: float, generation: int = 0, *ranks: int) -> None:
    for r in ranks or tuple(w.reporters):
        w.reporters[r].step_started(step, rank=r, generation=generation, now=T + at)


def in_collective(w: Watched, at: float, *ranks: int) -> None:
    for r in ranks:
        w.reporters[r].collective_started(T + at)


# ------------------------------------------------------------------ hangs
def test_a_rank_its_peers_wait_for_is_killed_when_their_wait_crosses_the_timeout(
        watched: Watched) -> None:
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.1, 0, 2)  # rank 1 never gets there
    assert watched.tick(ms, 1.0) == []  # they have waited 0.9 s of 5
    assert watched.watch.wait_s(T + 1.0) == CHECK_EVERY_S  # far from it: the usual pace
    assert watched.tick(ms, 5.0) == []  # 4.9 s of 5: the next check is when it crosses
    assert watched.watch.wait_s(T + 5.0) == pytest.approx(0.1 + HANG_CHECK_MARGIN_S)
    assert watched.tick(ms, 5.05) == []  # not due yet
    assert watched.tick(ms, 5.0 + 0.1 + HANG_CHECK_MARGIN_S) == [
        Kill(1, "hang", "hang: rank 1 made no progress for 5.1s (in step 5's own code) while "
                        "2 of its peers wait for it in collective 1 of step 5; killing worker 1")]
    assert watched.watch.timeout_s == 5.0


def test_nothing_more_is_found_while_a_member_killed_for_a_hang_is_still_listed(
        watched: Watched) -> None:
    """A chaos soak recorded two faults for one SIGSTOP: the stopped rank's kill, then 28 ms
    later, its exit not yet seen, every rank waiting in the collective read as a stuck
    communicator and was rebuilt for nothing."""
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.1, 0, 2)
    kill, = watched.tick(ms, 5.2)
    assert isinstance(kill, Kill) and kill.worker == 1
    in_collective(watched, 5.2, 1)  # now every rank waits in collective 1, past the timeout:
    assert watched.tick(ms, 10.3) == []  # but rank 1's exit is on its way
    late, = watched.tick(ms, 10.4 + KILL_EXIT_WAIT_S)  # its exit never came: judged again
    assert late == Rebuild("every rank has waited 15.2s in collective 1 of step 5: "
                           "rebuilding the communicator", 5)


def test_waits_already_past_the_timeout_keep_the_usual_check_pace() -> None:
    def waiting(s: float | None) -> Liveness:
        return Liveness(worker=0, rank=0, step=5, idle_s=9.0, waiting_s=s, stopped=False,
                        compute_s=0.0, step_s=0.0)

    assert next_hang_check_s([waiting(None)], 5.0) is None
    assert next_hang_check_s([waiting(9.0)], 5.0) is None  # judged: a long phase?
    assert next_hang_check_s([waiting(9.0), waiting(4.95)], 5.0) == pytest.approx(
        0.05 + HANG_CHECK_MARGIN_S)
    assert next_hang_check_s([waiting(0.01)], 0.6) == pytest.approx(0.59 + HANG_CHECK_MARGIN_S)


def test_a_large_job_is_judged_less_often_unless_a_wait_is_about_to_cross(
        watched: Watched) -> None:
    """Past ROWS_PER_CHECK members a job is judged every CHECK_EVERY_S x members /
    ROWS_PER_CHECK (8,192: every second), not every CHECK_EVERY_S; a wait about to cross the
    timeout still brings a check at its crossing. (At 32,768 members a judgement took ~25 ms
    of the coordinator's loop; a check pulled back to every 0.25 s made that a tenth of a
    core, in every fault's fan-out.)"""
    remote = [Liveness(worker=10_000 + i, rank=3 + i, step=5, idle_s=0.1, waiting_s=None,
                       stopped=False, compute_s=0.0, step_s=0.0, generation=0,
                       phase=Phase.STEP) for i in range(4 * ROWS_PER_CHECK - 3)]
    judged: list[float] = []

    class Counting(WatchNode):
        def remote_liveness(self) -> list[Liveness]:
            judged.append(0.0)
            return list(self.remote)

    watched.watch.port = Counting(watched.node.spec, watched.node.workers, remote)
    ms = api((0, 1, 2, *(m.worker for m in remote)))
    in_step(watched, 5, 0.0)
    for k in range(8):  # 1.0, 1.25, ... 2.75
        assert watched.tick(ms, 1.0 + 0.25 * k) == []
    assert len(judged) == 2  # at 1.0 and 2.0
    remote[-1] = replace(remote[-1], waiting_s=4.9)  # crosses the 5 s timeout in 0.1 s
    watched.tick(ms, 3.0)  # judged: its next check at the crossing, not at 4.0
    watched.tick(ms, 3.05)
    assert len(judged) == 3
    watched.tick(ms, 3.0 + 0.1 + HANG_CHECK_MARGIN_S)
    assert len(judged) == 4


def test_a_small_job_is_still_judged_every_check_interval(watched: Watched) -> None:
    """ROWS_PER_CHECK members or fewer, no wait about to cross: every CHECK_EVERY_S, as
    before next_hang_check_s stopped capping the pace (it says None here)."""
    judged: list[float] = []

    class Counting(WatchNode):
        def remote_liveness(self) -> list[Liveness]:
            judged.append(0.0)
            return []

    watched.watch.port = Counting(watched.node.spec, watched.node.workers)
    in_step(watched, 5, 0.0)
    for k in range(4):  # 1.0, 1.25, 1.5, 1.75
        assert watched.tick(api(), 1.0 + CHECK_EVERY_S * k) == []
    assert len(judged) == 4


def test_the_whole_job_is_judged_here_other_nodes_members_included(watched: Watched) -> None:
    def quiet(worker: int, rank: int, stopped: bool) -> Liveness:  # in its step for 30 s
        return Liveness(worker=worker, rank=rank, step=5, idle_s=30.0, waiting_s=None,
                        stopped=stopped, compute_s=0.0, step_s=0.0, generation=0,
                        phase=Phase.STEP)

    watched.node.remote = [quiet(10_000, 2, False), quiet(10_001, 3, True)]
    del watched.node.workers[2]
    ms = api((0, 1, 10_000))  # 10_001: stopped, but no member (a spare, an evicted one)
    in_step(watched, 5, 0.0, 0, 0, 1)
    in_collective(watched, 0.0, 0, 1)
    kill, = watched.tick(ms, 30.0)
    assert isinstance(kill, Kill) and kill.worker == 10_000 and kill.why == "hang"


@pytest.mark.parametrize("watched", [{"hang_timeout": None}], indirect=True)
def test_the_timeout_follows_the_slowest_members_step_times(watched: Watched) -> None:
    ms = api()
    for r in watched.reporters.values():  # 11 commits one second apart: a p95 of 1 s
        for step in range(11):
            r.committed(step, 0, 0, T + step)
    in_step(watched, 11, 11.0)
    assert watched.tick(ms, 11.5) == [] and watched.watch.timeout_s == 10.0
    watched.reporters[2].committed(11, 2, 0, T + 14.0)  # a 4 s step: its p95 4 s
    assert watched.tick(ms, 15.0) == [] and watched.watch.timeout_s == 40.0


def test_nothing_is_judged_without_the_api_or_while_members_move_to_a_new_generation(
        watched: Watched) -> None:
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.1, 0, 2)
    assert watched.tick(None, 60.0) == []  # a job without in-process recovery
    assert watched.tick(Membership((0, 1, 2)), 61.0) == []  # no hello yet
    ms = api()
    ms.publish((0, 1, 2))  # generation 1: every slot still says 0
    assert watched.tick(ms, 62.0) == []
    assert watched.watch.timeout_s == 5.0


# ------------------------------------------------------------------ a stuck communicator
def test_a_stuck_communicator_is_rebuilt_then_the_ranks_that_never_reached_it_replaced(
        watched: Watched) -> None:
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.0, 0, 1, 2)
    assert watched.tick(ms, 6.0) == [Rebuild("every rank has waited 6.0s in collective 1 of "
                                             "step 5: rebuilding the communicator", 5)]
    ms.publish((0, 1, 2))  # what the agent does with a Rebuild
    watched.watch.rebuilt(ms.generation, 5, T + 6.0)
    for r in (0, 1):  # rank 2 stays behind, in the old collective
        watched.reporters[r].recovering(T + 6.5, rank=r, generation=1)
    in_step(watched, 5, 7.0, 1, 0, 1)
    in_collective(watched, 7.1, 0, 1)
    assert watched.tick(ms, 10.0) == []  # within a timeout of the rebuild
    assert watched.tick(ms, 11.5) == [Kill(2, "hang")]
    assert watched.node.events[-1] == (Event.NOTICE, {
        "text": "hang: the communicator rebuilt as generation 1 never reached it: replacing "
                "rank 2"})


def test_a_commit_after_a_rebuild_ends_the_watch_on_it(watched: Watched) -> None:
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.0, 0, 1, 2)
    assert len(watched.tick(ms, 6.0)) == 1
    ms.publish((0, 1, 2))
    watched.watch.rebuilt(ms.generation, 5, T + 6.0)
    for r, reporter in watched.reporters.items():
        reporter.recovering(T + 6.5, rank=r, generation=1)
        reporter.committed(6, r, 1, T + 7.0)
    assert watched.tick(ms, 12.0) == []
    assert watched.node.events == []


# ------------------------------------------------------------------ stragglers
@pytest.mark.parametrize("watched", [{"evict_stragglers": False}, {"evict_stragglers": True}],
                         indirect=True, ids=["named", "evicted"])
def test_a_straggler_is_named_after_consecutive_checks_and_evicted_only_if_asked(
        watched: Watched) -> None:
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.1, 0, 2)
    in_collective(watched, 0.4, 1)  # 4x its peers' compute time
    evict = watched.node.spec.evict_stragglers
    found = [watched.tick(ms, 0.5 + i * CHECK_EVERY_S) for i in range(STRAGGLER_CHECKS + 2)]
    assert found[STRAGGLER_CHECKS - 1] == ([Kill(1, "straggler")] if evict else [])
    assert [f for i, f in enumerate(found) if i != STRAGGLER_CHECKS - 1] == [[]] * (
        STRAGGLER_CHECKS + 1)
    reason = "rank 1 computes a step in 400 ms, its peers in 100 ms (4.0x)"
    assert watched.node.of_kind(Event.STRAGGLER) == [
        {"worker": 1, "reason": reason, "evicted": evict}]  # said once
    assert watched.watch.stragglers == {1: reason}


# ------------------------------------------------------------------ GPUs
def test_peers_waiting_on_a_member_killed_for_its_gpu_are_no_stuck_communicator(
        watched: Watched) -> None:
    ms = api()
    in_step(watched, 5, 0.0)
    in_collective(watched, 0.0, 0, 1, 2)  # rank 1 hangs inside it on its failed GPU
    watched.watch.uuids = [f"GPU-{i}" for i in range(3)]
    watched.watch.changes.put(("GPU-1", Verdict(Health.FAILED, "XID 79: fallen off the bus")))
    assert watched.tick(ms, 6.0) == [Kill(1, "gpu: XID 79: fallen off the bus")]
    assert watched.tick(ms, 7.0) == []  # its exit is on its way
    stuck, = watched.tick(ms, 7.0 + KILL_EXIT_WAIT_S)  # it never came: judged again
    assert isinstance(stuck, Rebuild)


def test_a_failed_gpu_is_excluded_and_its_workers_killed_and_avoided(watched: Watched) -> None:
    watch = watched.watch
    watch.uuids = [f"GPU-{i}" for i in range(4)]  # the monitor's map, local rank -> UUID
    watch.changes.put(("GPU-0", Verdict(Health.DEGRADED, "temperature 90 C")))
    watch.changes.put(("GPU-1", Verdict(Health.FAILED, "XID 79: fallen off the bus")))
    assert watched.tick(None, 0.0) == [Kill(1, "gpu: XID 79: fallen off the bus")]
    assert [(g["uuid"], g["health"], g["local_ranks"])
            for g in watched.node.of_kind(Event.GPU)] == [("GPU-0", "degraded", [0]),
                                                          ("GPU-1", "failed", [1])]
    assert watch.excluded == {"GPU-1"}
    assert watch.pick_local_rank(0) == 0  # degraded is no reason to move
    assert watch.pick_local_rank(1) == 3  # 0-2 are busy, 1 excluded
    del watched.node.workers[1:]
    assert watch.pick_local_rank(1) == 2


@pytest.mark.parametrize("watched", [{"drain_on": "degraded"}], indirect=True)
def test_drain_on_degraded_hands_worn_memory_over_at_once_and_throttling_once_sustained(
        watched: Watched) -> None:
    """#48: a GPU whose readings predict a failure drains its member's rank (once) and is not
    used again; a hot GPU only once it stayed throttled GPU_THROTTLE_SUSTAINED_S."""
    watch = watched.watch
    watch.uuids = [f"GPU-{i}" for i in range(4)]
    watch.changes.put(("GPU-0", Verdict(Health.DEGRADED, "corrected ECC errors rising (+64 "
                                                         "since the last poll)")))
    watch.changes.put(("GPU-2", Verdict(Health.DEGRADED, "temperature 90 C at the slowdown "
                                                         "threshold")))
    (drain,) = watched.tick(None, 0.0)
    assert isinstance(drain, Drain) and drain.request.leavers == (0,)
    assert drain.request.what.startswith("gpu 0 (degraded: corrected ECC errors rising")
    assert "GPU-0" in watch.excluded and watched.tick(None, 1.0) == []  # once
    assert watched.tick(None, GPU_THROTTLE_SUSTAINED_S - 1) == []  # not sustained yet
    (hot,) = watched.tick(None, GPU_THROTTLE_SUSTAINED_S)
    assert isinstance(hot, Drain) and hot.request.leavers == (2,)


def test_without_drain_on_a_degraded_gpu_is_only_shown(watched: Watched) -> None:
    watched.watch.uuids = [f"GPU-{i}" for i in range(3)]
    watched.watch.changes.put(("GPU-0", Verdict(Health.DEGRADED, "retired pages pending")))
    assert watched.tick(None, 0.0) == [] and not watched.watch.excluded


def test_a_gpu_that_held_corrupt_state_is_suspect_and_avoided(watched: Watched) -> None:
    """#53: a worker outvoted by its replicas leaves; its GPU shows as suspect in status and
    the metrics, and no replacement starts on it (a failed verdict still wins)."""
    watch = watched.watch
    watch.uuids = [f"GPU-{i}" for i in range(4)]
    watch.suspect(1, "worker 1 held corrupt state on it (silent corruption)")
    assert watch.gpu_of(1) == ("GPU-1", "suspect") and watch.gpu_of(0)[1] == "healthy"
    assert [(g["uuid"], g["health"]) for g in watched.node.of_kind(Event.GPU)] == [
        ("GPU-1", "suspect")]
    assert watch.pick_local_rank(1) == 3  # 0-2 busy, 1 suspect
    assert [g["excluded"] for g in watch.gpu_table()] == [False, True, False, False]
    watch.suspect(9, "no such device")  # a CPU run has no GPU to suspect: nothing happens
    assert len(watched.node.of_kind(Event.GPU)) == 1
