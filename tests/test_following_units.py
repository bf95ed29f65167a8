"""The following cluster's decisions without processes: `Following` over a fake agent
(`fakes.FakeNode`, typed as `NodeHost`), obeying the coordinator's commands as its reader
thread hands them over (`_deliver`, then `_obey` as the main loop does); what it reports is
read back off the coordinator's queue as the coordinator parses it. The job recovers by
restarting (--on-fault restart): a follower of an in-process job also opens a generation
relay, a TCPStore of its own, which needs torch; the commands are obeyed the same either way."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from fakes import FakeNode
from fakestore import MemoryStore, StoreOutbox, message, reports
from ports import free_port

from ftrun.agent.roster import RunResult
from ftrun.cluster.following import MAX_ERROR_FILE_BYTES, Following
from ftrun.cluster.link import Endpoint
from ftrun.cluster.messages import (
    Command,
    End,
    Exited,
    Kill,
    Ping,
    Pong,
    Report,
    Spawn,
    Spawned,
    Start,
    Stop,
    Stopped,
)
from ftrun.cluster.rejoin import Fenced
from ftrun.core.errors import FtrunError
from ftrun.core.events import Event
from ftrun.core.options import OnFault, RdzvBackend
from ftrun.core.spec import RunSpec
from ftrun.protocol.progress import Reporter
from ftrun.protocol.rendezvous import encode

EP = Endpoint("127.0.0.1", 29400)
START = message(Start, attempt=1, addr="10.0.0.1", port=1234, base_rank=2, world_size=4,
                group_rank=1, group_world_size=2, first_id=10_000, run_id="job-run",
                spare=False)


@dataclass
class Follower:
    node: FakeNode
    cluster: Following
    store: MemoryStore  # the coordinator's: this node's reports land on its queue

    def obey(self, *cmds: Command | str) -> tuple[bool, RunResult | Fenced | None]:
        for cmd in cmds:
            self.cluster._deliver(cmd if isinstance(cmd, str) else encode(cmd), session=0)
        return self.cluster._obey()

    def reports(self) -> list[Report]:
        return reports(self.store)

    def exited(self, worker: int) -> Exited:
        """The report of `worker`'s exit, as its agent sends it."""
        w = self.node.workers.by_id(worker)
        assert w is not None and w.exit is not None
        return Exited(node=1, worker=worker, attempt=1, pid=w.spawned.pid,
                      returncode=w.exit.returncode, wall_time=w.exit.wall_time, error="",
                      by_launcher=w.exit.killed_by_launcher)


@pytest.fixture
def follower(private_run_dir: Path, tmp_path: Path) -> Iterator[Follower]:
    spec = RunSpec("train.py", nproc=2, nnodes_min=2, nnodes_max=2,
                   rdzv_backend=RdzvBackend.C10D, rdzv_endpoint=str(EP), rdzv_id="job",
                   on_fault=OnFault.RESTART, gpu_backend="none",
                   log_dir=str(tmp_path / "logs"), shutdown_timeout=1.0)
    node = FakeNode(spec)
    cluster = Following(node, EP)
    node.attach(cluster)
    store = MemoryStore()
    cluster.index = 1  # given when it joined
    cluster._outbox = StoreOutbox(store)  # what a membership opens, without its thread
    cluster._start(START)
    yield Follower(node, cluster, store)
    node.close()


def test_start_runs_this_nodes_workers_in_the_coordinators_ranks_and_reports_each(
        follower: Follower) -> None:
    node, a = follower.node, follower.node.attempt
    assert (a.restarts, a.run_id, a.master_addr, a.worker_port) == (
        1, "job-run", "10.0.0.1", 1234)
    assert (a.world_size, a.group_rank, a.group_world_size) == (4, 1, 2)
    workers = node.workers.all
    assert [(w.worker_id, w.rank, w.local_rank) for w in workers] == [(10_000, 2, 0),
                                                                     (10_001, 3, 1)]
    assert follower.reports() == [  # one report for the order's workers
        Spawned.of(1, [(w.worker_id, w.local_rank, w.spawned.pid) for w in workers])]
    assert follower.reports() == [] and Spawned.of(1, [(10_000, 0, 77)]).workers == "10000:0:77"
    started, = node.of_kind(Event.STARTED)
    assert started["node"] == 1 and started["master"] == "10.0.0.1:1234"
    follower.cluster._start(message(Start, attempt=2, addr="10.0.0.1", port=1235, base_rank=-1,
                                    world_size=6, group_rank=2, group_world_size=3,
                                    first_id=10_004, run_id="job-run", spare=True))
    assert [(w.worker_id, w.rank) for w in node.workers.all] == [(10_004, -1), (10_005, -1)]
    assert [f["spare"] for f in node.of_kind(Event.SPAWNED)] == [False, False, True, True]


def test_spawn_starts_a_worker_on_the_device_the_health_watch_picks(
        follower: Follower) -> None:
    node, health = follower.node, follower.node.services.health
    health.uuids = [f"GPU-{i}" for i in range(4)]
    health.excluded.add("GPU-1")  # its worker's GPU failed; the worker is gone
    node.fake_workers.kill(10_001)
    node.fake_workers.reap()
    follower.reports()
    assert follower.obey(Spawn(worker=10_002, rank=3, local_rank=1, spare=False),
                         Spawn(worker=10_003, rank=-1, local_rank=3, spare=True)) == (False, None)
    moved, kept = node.workers.by_id(10_002), node.workers.by_id(10_003)
    assert moved is not None and kept is not None
    assert (moved.rank, moved.local_rank, kept.local_rank) == (3, 2, 3)
    assert follower.reports() == [
        Spawned.of(1, [(10_002, 2, moved.spawned.pid)]),
        Spawned.of(1, [(10_003, 3, kept.spawned.pid)])]
    # should this node coordinate later (etcd), its own ids start past those it was given
    assert node.workers.allocate_id() == 10_004


def test_kill_kills_the_named_worker_and_its_exit_is_reported(follower: Follower) -> None:
    follower.reports()
    assert follower.obey(Kill(worker=10_000), Kill(worker=10_999)) == (False, None)
    assert follower.node.fake_workers.signals == [(10_000, signal.SIGKILL)]
    follower.node.fake_workers.reap()
    assert follower.reports() == [follower.exited(10_000)]
    assert follower.exited(10_000).returncode == -signal.SIGKILL


def test_stop_stops_every_worker_reports_their_exits_then_stopped(follower: Follower) -> None:
    follower.reports()
    assert follower.obey(Stop(signal=signal.SIGTERM, grace=2.0), Ping(seq=4)) == (True, None)
    assert follower.node.fake_workers.signals == [(10_000, signal.SIGTERM),
                                             (10_001, signal.SIGTERM)]
    assert follower.reports() == [follower.exited(10_000), follower.exited(10_001),
                                  Stopped(node=1)]
    assert follower.exited(10_000).by_launcher
    assert follower.obey() == (False, None)  # what came after the stop: the next pass's
    assert follower.reports() == [Pong(node=1, seq=4)]


def test_end_lost_fences_this_node(follower: Follower) -> None:
    why = "the coordinator dropped this node (no heartbeat for 6.0 s)"
    assert follower.obey(End(code=1, reason=why, lost=True, refused=False)) == (
        True, Fenced(why, 2))
    assert not follower.node.workers.alive()
    assert all(sig == signal.SIGTERM for _, sig in follower.node.fake_workers.signals)


@pytest.mark.parametrize(("end", "reason"), [
    (End(code=0, reason="training done", lost=False, refused=False),
     "the coordinator ended the job: training done"),
    (End(code=1, reason="node index 1 is taken", lost=False, refused=True),
     "the coordinator refused this node: node index 1 is taken")])
def test_end_stops_the_workers_and_ends_with_the_coordinators_code(
        follower: Follower, end: End, reason: str) -> None:
    stop, result = follower.obey(end)
    assert stop and isinstance(result, RunResult)
    assert (result.exit_code, result.reason, result.restarts_used) == (end.code, reason, 1)
    assert len(result.exits) == 2 and not follower.node.workers.alive()
    failures = [f["reason"] for f in follower.node.of_kind(Event.FAILURE)]
    assert failures == ([reason] if end.code else [])


def test_a_malformed_command_gives_a_notice_and_the_rest_is_obeyed(follower: Follower) -> None:
    follower.reports()
    assert follower.obey("{not json", '{"kind": "explode"}', '{"kind": "kill", "worker": "x"}',
                         Ping(seq=1)) == (False, None)
    assert follower.node.notices()[-3:] == [
        "ignored a malformed command (not JSON)",
        "ignored a malformed command (unknown kind 'explode')",
        "ignored a malformed command (kill: 'worker' is 'x', not int)"]
    assert follower.node.fake_workers.signals == []
    assert follower.reports() == [Pong(node=1, seq=1)]


def test_a_local_exit_is_reported_at_once_with_its_error_file(follower: Follower) -> None:
    follower.reports()
    workers = follower.node.fake_workers
    traceback = '{"message": {"message": "RuntimeError: boom"}}'
    crashed, huge = workers.by_id(10_001), workers.by_id(10_000)
    assert crashed is not None and huge is not None
    Path(crashed.streams.error_file).write_text(traceback)
    Path(huge.streams.error_file).write_text("x" * (MAX_ERROR_FILE_BYTES + 10))
    workers.end(10_001, 1)
    workers.end(10_000, 1)
    first, second = follower.reports()
    assert isinstance(first, Exited) and isinstance(second, Exited)
    assert first == Exited(node=1, worker=10_001, attempt=1, pid=crashed.spawned.pid,
                           returncode=1, wall_time=first.wall_time, error=traceback,
                           by_launcher=False)
    assert second.error == "x" * MAX_ERROR_FILE_BYTES  # the first 64 KiB travel


def test_a_net_down_drill_on_another_node_is_one_line(follower: Follower) -> None:
    with pytest.raises(FtrunError, match="^this is node 1, not node 2$") as err:
        follower.cluster.net_down(2, 5.0)
    assert "node 2" in err.value.hint
    with pytest.raises(FtrunError, match="has not joined the job yet"):
        follower.cluster.net_down(1, 5.0)  # no link drills before `drive` opened them


def test_uses_api_follows_the_live_workers_progress_slots(follower: Follower) -> None:
    cluster, node = follower.cluster, follower.node
    assert not cluster.uses_api(True)  # no Recovery here: the slots say, not `local`
    reporter = Reporter(node.services.progress_dir, 10_000)  # the worker's side of its slot
    try:
        reporter.step_started(0, rank=2, generation=0, now=1000.0)
        assert cluster.uses_api(False)
        node.fake_workers.end(10_000, 0)
        assert not cluster.uses_api(False)  # only live workers count
    finally:
        reporter.slot.close()


def test_a_fenced_etcd_follower_rejoins_the_store_the_new_leader_published(
        follower: Follower) -> None:
    """The coordinator's process died (its store refuses connections): with c10d that is the
    job's end; with etcd the node joins the store of the leader elected meanwhile."""
    import torch.distributed as dist

    from ftrun.cluster.rejoin import Rejoin

    dead = Endpoint("127.0.0.1", free_port())  # a port nothing serves: the dead coordinator's
    new = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                        wait_for_workers=False)
    published: list[Endpoint | None] = [None, None, Endpoint("127.0.0.1", new.port)]
    c10d = Rejoin(follower.node, dead, rejoin_s=5.0)
    ended = c10d.connect(Fenced("no answer from the store for 3.0 s", 0))
    assert isinstance(ended, RunResult) and "nothing serves the endpoint" in ended.reason
    etcd = Rejoin(follower.node, dead, rejoin_s=20.0,
                  resolve=lambda: published.pop(0) if len(published) > 1 else published[0])
    link = etcd.connect(Fenced("no answer from the store for 3.0 s", 0))
    assert not isinstance(link, RunResult) and etcd.ep == Endpoint("127.0.0.1", new.port)
    link.set("joined", "1")
    assert new.get("joined") == b"1"
