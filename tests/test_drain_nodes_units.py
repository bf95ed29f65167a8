"""Planned leaves on many nodes without processes (#48): the `Draining` report as the
coordinator parses it, the coordinator's node drains (`Coordinating` over a fake agent, a
real `Recovery`, the in-memory store of tests/test_cluster_units.py), the coordinator's own
notice under c10d (the whole job requeues) and under etcd (it steps down once its ranks are
served elsewhere), and a follower's side (`Leaving`, over tests/test_following_units.py's
follower)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
from fakes import FakeNode
from fakestore import MemoryHosted, MemoryStore, generation
from test_cluster_units import CONF, EP, Job, exited, spec
from test_cluster_units import make as make  # noqa: F401  (the fixture)
from test_following_units import Follower
from test_following_units import follower as follower  # noqa: F401  (the fixture)
from test_recovery_core import hello, recovered

from ftrun.agent.notices import Notices
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RunResult
from ftrun.cluster.coordinating import Coordinating
from ftrun.cluster.messages import Draining, End, Left, Stop, parse_report
from ftrun.core.drains import DrainState
from ftrun.core.events import Event
from ftrun.core.exits import EXIT_REQUEUE
from ftrun.core.membership import WorkerRole
from ftrun.core.policy import Action
from ftrun.protocol.rendezvous import Generation, encode
from ftrun.protocol.status import ControlPlane

R = WorkerRole
NOTICE = Draining(node=2, reason="SIGTERM: a notice", window_s=30.0)


# ------------------------------------------------------------------ the report
def test_draining_round_trips_and_is_parsed_strictly() -> None:
    assert parse_report(encode(NOTICE)) == NOTICE
    bad = {'{"kind": "draining", "node": 2, "reason": "x", "window_s": "30"}':
           "draining: 'window_s' is '30', not float",
           '{"kind": "draining", "node": 2, "reason": "x", "window_s": NaN}':
           "draining: 'window_s' is 'nan', not float",
           '{"kind": "draining", "node": -2, "reason": "x", "window_s": 1}':
           "draining: node -2 is negative",
           '{"kind": "draining", "node": 2, "window_s": 1}': "draining: no 'reason'"}
    for raw, why in bad.items():
        assert parse_report(raw) == why


# ------------------------------------------------------------------ the coordinator
def spared(job: Job, *nodes: int) -> Recovery:
    """`nodes` joined (two members each, this node one): once the script said hello, every
    node starts one spare; each says hello and waits, ready."""
    job.start(*nodes)
    rec = job.recovery()
    spares = rec.membership.with_role(R.STARTING_SPARE)
    for wid in spares:
        hello(rec, wid, spare=True)
    assert rec.membership.with_role(R.SPARE) == spares and len(spares) == 1 + len(nodes)
    for n in nodes:
        job.sent(n)  # their Start and Spawn
    return rec


def leave(job: Job, rec: Recovery, *wids: int) -> None:
    """Remote members leave at the swap (exit 0), as their node reports them."""
    job.report(*(exited(w, 0) for w in wids))
    for w in job.coord.remote_exits():
        assert rec.on_exit(w) is None


def test_a_followers_notice_hands_its_ranks_to_spares_elsewhere_then_ends_it_cleanly(
        make: Callable[..., Job]) -> None:
    job = make(nproc=1, spares=1)
    rec = spared(job, 1, 2)
    before = generation(job.worker_store).number
    job.report(NOTICE, NOTICE)  # said twice: one drain
    job.coord.remote_exits()
    swap = generation(job.worker_store)  # spares 1 (this node's) and 10002 take rank 3, 4
    assert swap.number == before + 1 and not swap.urgent
    assert swap.members == (0, 10_000, 10_001, 1, 10_002)
    assert swap.joiners == (1, 10_002) and len(rec.drains.all) == 1
    assert job.coord.tick() is None and job.sent(2) == []  # not before its members left
    leave(job, rec, 20_000, 20_001)
    recovered(rec, 0)  # the swap's generation committed
    assert rec.drains.all[0].state is DrainState.DONE
    assert job.coord.tick() is None
    (end,) = job.sent(2)
    assert isinstance(end, End) and end.code == 0 and not end.lost and "hands over" in end.reason
    assert not job.coord.nodes[2].alive and job.coord.others.other_nodes() == [1]
    assert rec.membership.role(20_002) is R.GONE  # its spare: stopped by its own agent
    job.report(exited(20_002, -15), Left(node=2, reason="received SIGTERM"))
    assert job.coord.remote_exits() == []  # expected: no exit handed over, no loss
    assert job.coord.tick() is None and job.sent(2) == []
    assert job.node.of_kind(Event.FAULT) == [] and rec.faults == 0
    assert generation(job.worker_store).number == swap.number  # no urgent generation
    assert "node 2 (h2) drained; it leaves the job" in " ".join(job.node.notices())


def test_a_node_without_a_rank_is_ended_at_once(make: Callable[..., Job]) -> None:
    job = make(nnodes_max=2)
    job.start(1, 2)  # node 2 waits in line: the job is full
    job.recovery()
    job.report(NOTICE)
    job.coord.remote_exits()
    assert job.sent(2) == [End(code=0, reason="node 2 held no rank of the job", lost=False,
                               refused=False)]
    assert not job.coord.nodes[2].alive and job.node.of_kind(Event.FAULT) == []


def test_a_notice_with_nowhere_to_go_requeues_once_every_member_of_the_job_is_out(
        make: Callable[..., Job]) -> None:
    """No spare, and a shrink would go below --min-nproc: the whole job snapshots and leaves;
    the attempt ends only once every member of every node is out (their snapshots written),
    not as soon as the leaving node's are."""
    job = make(min_nproc=5)
    job.start(1, 2)
    rec = job.recovery()
    job.report(NOTICE)
    job.coord.remote_exits()
    gen = generation(job.worker_store)
    assert gen.members == () and gen.snapshot_first
    assert rec.drains.all[0].state is DrainState.REQUEUE
    leave(job, rec, 20_000, 20_001)
    assert rec.handle_requests() is None  # node 1's members and this node's still write
    leave(job, rec, 10_000, 10_001)
    for wid in (0, 1):
        job.node.fake_workers.end(wid, 0)
        assert rec.on_exit(job.node.workers.all[wid]) is None
    d = rec.handle_requests()
    assert d is not None and d.action is Action.REQUEUE


def test_a_notice_below_nnodes_min_requeues_the_whole_job(make: Callable[..., Job]) -> None:
    job = make(nproc=1, spares=1, nnodes_min=3)
    rec = spared(job, 1, 2)
    members = rec.membership.members
    job.report(NOTICE)
    job.coord.remote_exits()
    drain = rec.drains.all[0]
    assert drain.state is DrainState.REQUEUE and "below --nnodes minimum 3" in drain.reason
    assert drain.request.leavers == members and generation(job.worker_store).members == ()


def test_the_c10d_coordinators_notice_requeues_even_with_spares_on_other_nodes(
        make: Callable[..., Job]) -> None:
    """Its store goes with it: no spare elsewhere can keep the job (agent.node's `whole`)."""
    job = make(nproc=1, spares=1)
    rec = spared(job, 1, 2)
    members = rec.membership.members
    req = Notices(job.node.spec).take(signal.SIGTERM, 0, members, whole_job=True)
    drain = rec.drains.start(req)
    assert drain.state is DrainState.REQUEUE and "nowhere to go" in drain.reason
    assert drain.reason.startswith("node 0 (SIGTERM: a notice; the store goes with it)")
    assert generation(job.worker_store).members == ()


class EtcdPlane:
    """The etcd control plane as the coordinator asks it; it records when it let go."""

    backend = "etcd"
    leader_changes = 0
    ousted: str | None = None

    def __init__(self, hosted: MemoryHosted) -> None:
        self.hosted = hosted
        self.closed_with_store_open: bool | None = None

    def served(self, ep: Any) -> None: ...
    def register(self, index: int) -> None: ...
    def store_now(self) -> None: ...
    def record(self, gen: Generation) -> None: ...
    def deposed(self) -> None: ...
    def up(self) -> bool:
        return True
    def describe(self) -> ControlPlane:
        return ControlPlane(backend="etcd", endpoints=(), leader=None, leader_changes=0, up=True,
                            members=())
    def close(self) -> None:
        self.closed_with_store_open = self.hosted.store is not None


@pytest.fixture
def etcd_job(tmp_path: Any, private_run_dir: Any) -> Any:
    node = FakeNode(spec(log_dir=str(tmp_path / "logs"), nproc=1, spares=1,
                         rdzv_backend="etcd", rdzv_conf=CONF))
    store = MemoryStore()
    hosted = MemoryHosted(store)
    hosted.serve()
    plane = EtcdPlane(hosted)
    coord = Coordinating(node, hosted, EP, plane)
    node.attach(coord)
    yield Job(node, coord, store, MemoryStore()), plane
    node.close()


def test_the_etcd_coordinators_notice_hands_its_ranks_over_then_steps_down(
        etcd_job: Any) -> None:
    job, plane = etcd_job
    rec = spared(job, 1, 2)
    req = Notices(job.node.spec).take(signal.SIGTERM, 0, rec.membership.members)
    rec.drains.start(req)  # as agent.node does on the notice (not whole: etcd)
    swap = generation(job.worker_store)
    assert swap.members == (10_002, 10_000, 10_001, 20_000, 20_001)  # a spare elsewhere
    assert job.coord.tick() is None
    job.node.fake_workers.end(0, 0)  # worker 0 left at the swap
    assert rec.on_exit(job.node.workers.all[0]) is None
    recovered(rec, 10_000)
    d = job.coord.tick()
    assert d is not None and d.action is Action.SUCCEED
    assert "lets go of the coordinator's role" in d.reason
    assert job.coord.stop_workers(signal.SIGKILL, 0.0, job.node.workers.stop) is None
    assert not job.node.workers.alive()  # its own spare
    assert not any(isinstance(c, (Stop, End)) for n in (1, 2) for c in job.sent(n))
    job.coord.close(None)
    assert plane.closed_with_store_open is True  # the leadership went first
    assert [c for n in (1, 2) for c in job.sent(n)] == []  # the others go on: no End
    assert job.node.of_kind(Event.FAULT) == []


# ------------------------------------------------------------------ the follower
def test_a_followers_notice_is_told_and_its_workers_run_on_until_the_coordinator_ends_it(
        follower: Follower) -> None:
    cluster, node = follower.cluster, follower.node
    follower.reports()  # its Spawned
    leaving = cluster.leaving
    assert leaving.signalled(signal.SIGTERM, 1, uses_api=True) is None
    assert follower.reports() == [Draining(node=1, reason="SIGTERM: a notice",
                                           window_s=node.spec.drain_window)]
    assert all(w.alive for w in node.workers.all) and leaving.draining
    node.fake_workers.end(10_000, 0)  # its member left at the swap; its spare waits
    stop, result = follower.obey(End(code=0, reason="node 1 (SIGTERM: a notice): ...",
                                     lost=False, refused=False))
    assert stop and isinstance(result, RunResult) and result.exit_code == 0
    assert result.reason == "this node drained: node 1 (SIGTERM: a notice): ..."
    assert not node.workers.alive() and node.of_kind(Event.FAILURE) == []


def test_a_second_signal_or_no_api_stops_the_follower_at_once(follower: Follower) -> None:
    leaving, node = follower.cluster.leaving, follower.node
    follower.reports()
    assert leaving.signalled(signal.SIGTERM, 1, uses_api=False) is not None  # no API
    assert follower.reports()[0] == Left(node=1, reason="received SIGTERM")  # then its exits
    assert not node.workers.alive()


def test_a_second_notice_stops_at_once(follower: Follower) -> None:
    leaving = follower.cluster.leaving
    assert leaving.signalled(signal.SIGTERM, 1, uses_api=True) is None
    result = leaving.signalled(signal.SIGTERM, 1, uses_api=True)
    assert result is not None and result.signal_received == "SIGTERM"
    assert Left(node=1, reason="received SIGTERM") in follower.reports()


def test_a_requeue_ending_is_not_a_failure_on_a_follower(follower: Follower) -> None:
    stop, result = follower.obey(End(code=EXIT_REQUEUE, reason="node 2 ...; requeue the job",
                                     lost=False, refused=False))
    assert stop and isinstance(result, RunResult) and result.exit_code == EXIT_REQUEUE
    assert result.reason.startswith("the coordinator ended the job: ")
    assert follower.node.of_kind(Event.FAILURE) == []
    _, failed = follower.obey(End(code=1, reason="boom", lost=False, refused=False))
    assert failed is not None and follower.node.of_kind(Event.FAILURE) != []

