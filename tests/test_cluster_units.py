"""The coordinating cluster's decisions without processes: `Coordinating` over a fake agent
(`fakes.FakeNode`, typed as `NodeHost`), a real `Recovery`, and an in-memory store with
TCPStore's queue semantics; what it sends each node is read back as that node parses it.
Reports reach it where the reader thread hands them over (`_deliver`), except in the close
test, where a real `QueueReader` thread reads them off the store."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeNode
from fakestore import MemoryHosted, MemoryStore, commands, generation, message

from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RunResult
from ftrun.cluster import coordinating
from ftrun.cluster.coordinating import Coordinating
from ftrun.cluster.link import AGENT_QUEUE, Endpoint
from ftrun.cluster.messages import (
    Bye,
    End,
    Exited,
    Join,
    Kill,
    Left,
    Report,
    Spawn,
    Spawned,
    Start,
    Stop,
)
from ftrun.core import timeouts
from ftrun.core.events import Event
from ftrun.core.membership import WorkerRole
from ftrun.core.node_flags import shared_flags
from ftrun.core.spec import RunSpec
from ftrun.protocol.fanout import relay_queue, warm_message
from ftrun.protocol.rendezvous import Hello, encode

R = WorkerRole
EP = Endpoint("127.0.0.1", 29400)
# no node is lost by the clock here: only by what it says (Left, Bye) or by the test
CONF = (("join_timeout", "5"), ("last_call_timeout", "0"), ("node_timeout", "600"),
        ("quiet_timeout", "600"), ("cut_timeout", "600"), ("suspect_timeout", "600"))


def spec(**kw: Any) -> RunSpec:
    return RunSpec("train.py", **{"nproc": 2, "nnodes_min": 1, "nnodes_max": 3,
                                  "rdzv_backend": "c10d", "rdzv_endpoint": str(EP),
                                  "rdzv_id": "job", "gpu_backend": "none",
                                  "shutdown_timeout": 1.0, "rdzv_conf": CONF, **kw})


@dataclass
class Job:
    node: FakeNode
    coord: Coordinating
    store: MemoryStore  # the rendezvous store, as a follower's connection sees it
    worker_store: MemoryStore  # the attempt's store, where generations are published

    def report(self, *msgs: Report) -> None:
        for msg in msgs:
            self.coord._deliver(encode(msg))  # what the reader thread hands over

    def sent(self, node: int) -> list[Any]:
        return commands(self.store, node)

    def start(self, *nodes: int) -> None:
        """`nodes` join, then the first attempt starts: this node's workers, then theirs."""
        self.report(*(join(n) for n in nodes))
        w = self.node.workers
        w.new_attempt(0, self.node.spec.nproc)

        def start_local() -> None:
            for lr in range(self.node.spec.nproc):
                w.spawn(lr, rank=lr, local_rank=lr)

        self.coord.start_group(0, self.coord.rdzv, start_local)

    def recovery(self) -> Recovery:
        """In-process recovery for the attempt, its script using the API (worker 0's hello)."""
        self.node.recovery = rec = Recovery(self.node.port, self.worker_store)
        rec.deliver(encode(Hello(worker=0, pid=1, spare=False)))
        assert rec.handle_requests() is None and rec.uses_api
        return rec


def join(node: int, rdzv_id: str = "job", host: str = "", flags: str = "",
         relay: str = "") -> Join:
    return message(Join, node=node, host=host or f"h{node}", pid=100 + node, nproc=2,
                   rdzv_id=rdzv_id, flags=flags, relay=relay)


def exited(worker: int, code: int, attempt: int = 0, error: str = "") -> Exited:
    return Exited(node=worker // 10_000, worker=worker, attempt=attempt, pid=7, returncode=code,
                  wall_time=1000.0, error=error, by_launcher=False)


@pytest.fixture
def make(private_run_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    nodes: list[FakeNode] = []
    coords: list[Coordinating] = []

    def build(**kw: Any) -> Job:
        node = FakeNode(spec(log_dir=str(tmp_path / "logs"), **kw))
        nodes.append(node)
        store = MemoryStore()
        hosted = MemoryHosted(store)
        hosted.serve()  # `prepare` serves it; the tests that skip it serve it here
        coord = Coordinating(node, hosted, EP)
        coords.append(coord)
        node.attach(coord)
        return Job(node, coord, store, MemoryStore())

    yield build
    for coord in coords:  # its status thread, which a tick starts, keeps reading otherwise
        coord.table.close()
    for node in nodes:
        node.close()


# ------------------------------------------------------------------ joining
def test_the_first_attempt_ranks_nodes_in_join_order_up_to_nnodes_max(
        make: Callable[..., Job]) -> None:
    job = make(nnodes_max=2)
    job.start(1, 2)
    first = message(Start, attempt=0, addr="", port=0, base_rank=2, world_size=4, group_rank=1,
                  group_world_size=2, first_id=10_000, run_id="units", spare=False)
    assert job.sent(1) == [first]
    assert job.sent(2) == []  # over --nnodes max: it waits for room
    assert job.coord.others.initial_members() == (0, 1, 10_000, 10_001)
    assert job.coord.others.other_nodes() == [1]
    assert [(w.worker_id, w.rank) for w in job.coord.others.remote_workers()] == [(10_000, 2),
                                                                           (10_001, 3)]
    assert (job.node.attempt.world_size, job.node.attempt.group_world_size) == (4, 2)


def test_a_join_of_another_job_or_under_a_taken_index_is_refused_on_its_queue(
        make: Callable[..., Job]) -> None:
    job = make()
    job.report(join(1, rdzv_id="other"))
    assert job.coord.remote_exits() == []
    assert job.sent(1) == [End(code=1, reason="this store serves --rdzv-id 'job', not 'other'",
                               lost=False, refused=True)]
    assert job.coord.nodes == {}
    job.report(join(1), join(1, host="intruder"))
    job.coord.remote_exits()
    assert job.sent(1) == [End(code=1, reason="node index 1 is taken", lost=False,
                               refused=True)]
    assert job.coord.nodes[1].host == "h1"
    assert job.node.notices() == [
        "node 1 (h1) refused: this store serves --rdzv-id 'job', not 'other'",
        "node 1 (h1) joined with 2 workers", "node 1 (intruder) refused: node index 1 is taken"]
    job.report(Bye(node=1), join(1, host="again"))  # an index whose node ended is free
    job.coord.remote_exits()
    assert job.sent(1) == [] and job.coord.nodes[1].host == "again"


def test_a_node_started_with_other_shared_flags_is_refused_and_one_with_the_same_enters(
        make: Callable[..., Job]) -> None:
    job = make(shard_size=2)
    job.report(join(1, flags=shared_flags(spec(shard_size=4, redo="lost"))))
    job.coord.remote_exits()
    [end] = job.sent(1)
    assert end.refused and end.code == 1 and end.reason.startswith(
        "this node was started with --shard-size 4 (the coordinator's: 2), --redo lost (the "
        "coordinator's: step); start every node with the same --shard-size, ")
    assert job.coord.nodes == {}
    assert job.node.notices() == [f"node 1 (h1) refused: {end.reason}"]
    job.report(join(1, flags=shared_flags(spec(shard_size=2, nproc=4, spares=1,
                                               resume="/mine"))))
    job.coord.remote_exits()  # groups inside a node: --nproc, --spares, --resume its own
    assert job.sent(1) == [] and job.coord.nodes[1].host == "h1"


def test_when_groups_span_nodes_a_joining_node_needs_the_same_nproc_and_resume_given(
        make: Callable[..., Job]) -> None:
    job = make(shard_size=4, resume="/ckpt")
    job.report(join(1, flags=shared_flags(spec(shard_size=4, nproc=4))))
    job.report(join(2, flags=shared_flags(spec(shard_size=4, nproc=2, resume="/other"))))
    job.coord.remote_exits()
    [end] = job.sent(1)
    assert end.refused and end.reason.startswith(
        "this node was started with --nproc 4 (the coordinator's: 2), --resume not given (the "
        "coordinator's: given); start every node with the same --shard-size, ")
    assert end.reason.endswith("--verify-every, --verify-grads-every, --nproc, --resume")
    assert job.sent(2) == [] and list(job.coord.nodes) == [2]  # its --resume path is its own


def test_nodes_joining_a_running_job_enter_in_join_order_as_joiners_then_as_spares(
        make: Callable[..., Job]) -> None:
    job = make()
    job.start(1)
    rec = job.recovery()
    job.report(Left(node=1, reason="received SIGTERM"))
    job.coord.remote_exits()
    assert job.coord.tick() is None
    assert generation(job.worker_store).members == (0, 1)  # shrunk: room for 2 workers
    job.sent(1)
    job.report(join(2), join(3))
    job.coord.remote_exits()
    assert job.coord.tick() is None
    assert job.sent(2) == [message(Start, attempt=0, addr="", port=0, base_rank=-1, world_size=4,
                                 group_rank=2, group_world_size=3, first_id=20_000,
                                 run_id="units", spare=False)]
    assert job.sent(3) == [message(Start, attempt=0, addr="", port=0, base_rank=-1, world_size=4,
                                 group_rank=3, group_world_size=4, first_id=30_000,
                                 run_id="units", spare=True)]
    roles = {w: rec.membership.role(w) for w in (20_000, 20_001, 30_000, 30_001)}
    assert roles == {20_000: R.JOINING, 20_001: R.JOINING,
                     30_000: R.STARTING_SPARE, 30_001: R.STARTING_SPARE}
    assert job.node.attempt.world_size == 4 and job.coord.others.other_nodes() == [2, 3]


def test_nodes_wait_in_line_while_the_job_is_full_told_once_and_enter_when_one_is_lost(
        make: Callable[..., Job]) -> None:
    job = make(nnodes_max=2)
    job.start(1)
    rec = job.recovery()
    job.report(join(2), join(3))
    job.coord.remote_exits()
    for _ in range(2):
        assert job.coord.tick() is None
    full = "the job is full (2 of --nnodes max 2 nodes); it enters when a node is lost"
    waits = [t for t in job.node.notices() if "waits" in t]
    assert waits == [f"node 2 (h2) waits: {full}"]  # the first in line holds the rest back
    assert job.sent(2) == job.sent(3) == []
    job.report(Left(node=1, reason="received SIGTERM"))
    job.coord.remote_exits()
    assert job.coord.tick() is None  # the loss, then the admission, in one pass
    start, = job.sent(2)
    assert isinstance(start, Start) and start.base_rank == -1 and not start.spare
    assert rec.membership.with_role(R.JOINING) == [20_000, 20_001]
    assert job.sent(3) == [] and job.node.notices()[-1] == f"node 3 (h3) waits: {full}"


# ------------------------------------------------------------------ remote workers
def test_a_remote_exit_is_kept_with_its_error_and_its_replacement_spawned_on_its_node(
        make: Callable[..., Job]) -> None:
    job = make()
    job.start(1)
    rec = job.recovery()
    job.sent(1)
    job.report(Spawned(node=1, workers="10001:1:4321,10099:0:5"),  # 10099: not its worker
               Spawned(node=1, workers="10000:0:junk"),  # refused whole, with a notice
               exited(10_001, 1, attempt=5),  # an earlier attempt's: not this one's
               exited(10_009, 1),  # never started
               exited(10_001, 1, error='{"message": "boom"}'))
    w, = job.coord.remote_exits()
    assert w.worker_id == 10_001 and w.pid == 4321 and w.exit is not None
    assert job.node.notices()[-1] == ("ignored a malformed agent message (spawned: "
                                      "'10000:0:junk' is not id:local_rank:pid)")
    assert w.exit.returncode == 1 and Path(w.exit.error_file).read_text() == \
        '{"message": "boom"}'
    assert rec.on_exit(w) is None
    assert job.sent(1) == [Spawn(worker=10_002, rank=3, local_rank=1, spare=False)]
    assert generation(job.worker_store).members == (0, 1, 10_000, 10_002)
    assert job.coord.others.remote_workers()[-1].worker_id == 10_002


def test_a_nodes_relay_inbox_is_kept_from_its_report_while_it_is_in_the_attempt(
        make: Callable[..., Job]) -> None:
    job = make()
    job.start(1, 2)
    job.report(Spawned(node=1, workers="10000:0:4321", relay="10.0.0.2:4000"),
               Spawned(node=2, workers="20000:0:4322"))  # no inbox: pushed to directly
    job.coord.remote_exits()
    assert job.coord.others.relay_inboxes() == {1: "10.0.0.2:4000"}
    job.report(Left(node=1, reason="received SIGTERM"))
    job.coord.remote_exits()
    job.coord.tick()
    assert job.coord.others.relay_inboxes() == {}


def test_the_forwarders_are_told_their_groups_once_no_new_inbox_came_for_a_while(
        make: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ahead of the first fault (it found the forwarders unconnected: its record went to
    most of the job on the coordinator's store): once the inboxes stopped coming for
    `RELAY_WARM_QUIET_S`, a periodic tick tells each forwarder its group, once; a fault's
    pass (not periodic) does not stop to do it."""
    monkeypatch.setenv("FTRUN_RELAY_TREE_FROM", "2")
    job = make()
    job.start(1, 2, 3)
    job.recovery()
    job.report(*(Spawned(node=n, workers=f"{n}0000:0:{n}", relay=f"10.0.0.{n}:4000")
                 for n in (1, 2, 3)))
    job.coord.remote_exits()
    told = lambda: job.worker_store.drain(relay_queue(1))  # noqa: E731
    assert told()[0].startswith(b"0\n")  # generation 0, pushed when recovery began
    assert job.coord.tick() is None and told() == []  # inboxes just came: not quiet yet
    monkeypatch.setattr(timeouts, "RELAY_WARM_QUIET_S", 0.0)
    assert job.coord.tick(periodic=False) is None and told() == []
    assert job.coord.tick() is None
    assert told() == [warm_message(("2@10.0.0.2:4000",))]  # groups 1-2, then 3 alone
    job.report(Spawned(node=2, workers="20001:0:2", relay="10.0.0.2:4000"))  # no news
    job.coord.remote_exits()
    job.coord.tick()
    assert told() == []


def test_forwarders_whose_inboxes_came_before_the_recovery_are_told_their_groups_too(
        make: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """A new leader (etcd) adopts nodes that named their inboxes before its recovery began:
    no inbox news follows, and its forwarders are told their groups all the same."""
    monkeypatch.setenv("FTRUN_RELAY_TREE_FROM", "2")
    monkeypatch.setattr(timeouts, "RELAY_WARM_QUIET_S", 0.0)
    job = make()
    job.start(1, 2, 3)
    job.report(*(Spawned(node=n, workers=f"{n}0000:0:{n}", relay=f"10.0.0.{n}:4000")
                 for n in (1, 2, 3)))
    job.coord.remote_exits()
    job.recovery()
    job.worker_store.drain(relay_queue(1))  # generation 0
    assert job.coord.tick() is None
    assert job.worker_store.drain(relay_queue(1)) == [warm_message(("2@10.0.0.2:4000",))]


def test_a_relay_inbox_named_in_a_join_is_kept_on_the_node(make: Callable[..., Job]) -> None:
    """A node that rejoins a new leader with its workers (etcd) keeps its relay, and its Join
    says where its inbox is: the new leader's plan can use it at once."""
    job = make()
    job.report(join(1, relay="10.0.0.3:5000"))
    job.coord.remote_exits()  # the loop reads the agents' reports
    assert job.coord.nodes[1].relay_inbox == "10.0.0.3:5000"


def test_kill_remote_sends_kill_only_for_a_live_worker_on_a_live_node(
        make: Callable[..., Job]) -> None:
    job = make()
    job.start(1, 2)
    job.sent(1), job.sent(2)
    assert job.coord.others.kill_remote(10_000)
    assert job.sent(1) == [Kill(worker=10_000)]
    job.report(exited(10_001, 1), Bye(node=2))  # node 2 ends; its workers' exits unseen
    job.coord.remote_exits()
    assert not job.coord.others.kill_remote(10_001)  # already dead
    assert not job.coord.others.kill_remote(20_000)  # alive as far as we know, but its node is gone
    assert not job.coord.others.kill_remote(10_007)  # never started
    assert job.sent(1) == [] and job.sent(2) == []


# ------------------------------------------------------------------ nodes lost
def test_a_node_that_left_is_dropped_and_its_workers_handed_to_recovery_in_one_decision(
        make: Callable[..., Job]) -> None:
    job = make()
    job.start(1, 2)
    rec = job.recovery()
    job.sent(1)
    job.report(Left(node=1, reason="received SIGTERM"), Left(node=1, reason="again"))
    assert job.coord.remote_exits() == []  # decided at the next tick, with the others lost
    assert job.sent(1) == [] and job.node.of_kind(Event.FAULT) == []
    assert job.coord.tick() is None
    assert job.sent(1) == [End(code=1, reason="the coordinator dropped this node (its agent "
                               "left (received SIGTERM))", lost=True, refused=False)]
    lost = [w for w in job.coord.others.remote_workers() if w.node == 1]
    assert [w.exit.returncode for w in lost if w.exit] == [-signal.SIGKILL] * 2
    fault, = job.node.of_kind(Event.FAULT)  # once, for both of its members
    assert fault["why"] == "node 1 (h1) lost" and fault["decision"] == "shrink"
    gen = generation(job.worker_store)
    assert (gen.number, gen.members) == (1, (0, 1, 20_000, 20_001))
    assert rec.membership.role(10_000) is rec.membership.role(10_001) is R.GONE
    assert job.coord.others.other_nodes() == [2]


def test_nodes_lost_in_one_pass_are_judged_with_all_of_them_gone(
        make: Callable[..., Job]) -> None:
    job = make(nnodes_min=2)
    job.start(1, 2)
    job.recovery()
    job.report(Left(node=1, reason="received SIGTERM"), Left(node=2, reason="received SIGTERM"))
    job.coord.remote_exits()
    d = job.coord.tick()  # both gone before either is judged: 1 node left of min 2
    assert d is not None and "below --nnodes minimum 2" in d.reason
    assert [f["decision"] for f in job.node.of_kind(Event.FAULT)] == ["fail", "fail"]
    assert generation(job.worker_store).number == 0  # no shrink to node 2 on the way
    for n in (1, 2):
        end, = [c for c in job.sent(n) if isinstance(c, End)]
        assert end.lost


def test_without_in_process_recovery_a_lost_nodes_workers_come_back_as_exits(
        make: Callable[..., Job]) -> None:
    job = make(on_fault="restart")
    job.start(1)
    node = job.coord.nodes[1]
    assert job.coord._node_lost(node, "no heartbeat for 6.0 s", 1000.0) is None
    gone = job.coord.remote_exits()
    assert [(w.worker_id, w.exit.returncode if w.exit else None) for w in gone] == [
        (10_000, -signal.SIGKILL), (10_001, -signal.SIGKILL)]
    assert "node 1 (h1) is lost: no heartbeat for 6.0 s" in job.node.notices()
    assert job.node.of_kind(Event.FAULT) == []  # torchrun semantics: the group restarts


# ------------------------------------------------------------------ stopping and ending
def test_stop_workers_stops_the_nodes_of_the_attempt_and_this_nodes_own(
        make: Callable[..., Job]) -> None:
    job = make(nnodes_max=2)
    job.start(1, 2)  # node 2 waits for room: not in the attempt
    job.sent(1)
    job.report(*(exited(w, -15) for w in (10_000, 10_001)))  # what node 1 reports once stopped
    assert job.coord.stop_workers(signal.SIGTERM, 0.5, job.node.workers.stop) is None
    assert job.sent(1) == [Stop(signal=signal.SIGTERM, grace=0.5)]
    assert job.sent(2) == []
    assert not job.coord.nodes[1].in_attempt
    assert [(w.exit.returncode, w.exit.killed_by_launcher) for w in job.node.workers.all
            if w.exit] == [(-signal.SIGTERM, True)] * 2
    assert not any(w.alive for w in job.coord.others.remote_workers())


@pytest.mark.parametrize(("result", "code", "reason"), [
    (RunResult(0, "training done"), 0, "training done"),
    (None, 1, "the coordinator failed")])
def test_close_ends_every_live_node_and_joins_its_reader(
        make: Callable[..., Job], monkeypatch: pytest.MonkeyPatch, result: RunResult | None,
        code: int, reason: str) -> None:
    job = make()
    # the reader's own connection, to the store in memory instead of over TCP
    monkeypatch.setattr(coordinating, "connect", lambda ep, timeout_s: job.store.client())
    job.coord.prepare()
    assert job.node.attempt.master_addr == "127.0.0.1"
    for msg in (join(1), join(2), Bye(node=2)):  # as the followers push them
        job.store.queue_push(AGENT_QUEUE, encode(msg))
    job.node.wait_wakes(3)
    job.coord.remote_exits()
    assert job.coord.others.other_nodes() == []
    assert [n.index for n in job.coord.table.alive()] == [1]
    job.store.queue_push(AGENT_QUEUE, encode(Bye(node=1)))  # node 1's answer to its End
    job.coord.close(result)
    assert job.sent(1) == [End(code=code, reason=reason, lost=False, refused=False)]
    assert job.sent(2) == []
    assert "ftrun-agents" not in [t.name for t in threading.enumerate()]


def test_a_nodes_payload_is_parsed_again_only_when_it_changed(
        make: Callable[..., Job]) -> None:
    """At hundreds of nodes, parsing every payload at every beat took most of a core: an
    unchanged payload keeps its parsed rows; a changed one is read as it is now."""
    import json
    import time

    from ftrun.cluster.jobnodes import LOOP_READS_AFTER, PAYLOAD_READ_SHARE, read_period
    from ftrun.cluster.link import heartbeat_key, payload_key
    from ftrun.cluster.messages import Payload
    from ftrun.core.detectors import Liveness

    job = make()
    job.start(1)

    def beat(step: int) -> None:
        row = Liveness(worker=10000, rank=2, step=step, idle_s=0.0, waiting_s=None,
                       stopped=False, compute_s=0.01, step_s=0.02)
        job.store.set(payload_key(1), json.dumps(Payload(liveness=(row,)).to_json()))
        job.store.add(heartbeat_key(1), 1)
        job.coord.watch.beats.ages(job.store, fresh=True)  # the coordinator reads them now

    beat(5)
    first = job.coord.table.remote_liveness()
    time.sleep(job.coord.beat_s * (LOOP_READS_AFTER + 0.5))  # the loop's next read is due
    again = job.coord.table.remote_liveness()
    assert [r.step for r in first] == [5] and again[0] is first[0]  # read, not parsed again
    beat(6)
    deadline = time.monotonic() + 10  # the next read: a beat, or later on a loaded host
    while [r.step for r in job.coord.table.remote_liveness()] != [6]:
        assert time.monotonic() < deadline, "the changed payload was never read"
        time.sleep(job.coord.beat_s)
    assert read_period(0.1, 0.001) == 0.1  # a small job: every beat
    assert read_period(0.1, 0.06) == 0.06 / PAYLOAD_READ_SHARE  # a large one: less often


def test_the_main_loop_reads_payloads_only_when_the_status_thread_has_not(
        make: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """The status thread reads every payload as it builds the status; the main loop (a
    fault's decision, the health watch) reads them itself only when they are
    LOOP_READS_AFTER periods old, and never waits for a read under way on another thread (at
    1,024 nodes a read and parse in the loop held a fault's publication ~0.2 s); the reads
    go over a connection of their own."""
    import time

    from ftrun.cluster import jobnodes

    reads: list[float] = []
    on: list[object] = []
    real = jobnodes.read_payloads

    def counted(store: object, nodes: list[int], between: Callable[[], None]) -> list[bytes]:
        reads.append(time.monotonic())
        on.append(store)
        return real(store, nodes, between)

    monkeypatch.setattr(jobnodes, "read_payloads", counted)
    job = make()
    job.start(1)
    table = job.coord.table
    table.remote_liveness()  # the first read
    assert on[0] is not job.coord.rdzv.store  # on a connection of its own: the loop's
    # publication never waits behind a megabyte of payloads
    time.sleep(job.coord.beat_s * 1.5)  # stale for a status, not yet for the loop
    table.remote_liveness(), table.highest_committed([10_000])
    assert len(reads) == 1
    table._payload(1)  # a status's read
    assert len(reads) == 2
    time.sleep(job.coord.beat_s * (jobnodes.LOOP_READS_AFTER + 0.5))
    with table._reading:  # another thread is reading them: the loop goes on without
        table.remote_liveness()
        assert len(reads) == 2
    table.remote_liveness()
    assert len(reads) == 3


def test_an_ending_coordinator_does_not_wait_the_grace_out_for_a_silent_node(
        make: Callable[..., Job]) -> None:
    """A node that stopped beating (it follows another leader, or is cut off) will not report
    its workers stopped: past the node timeout it is not waited for (a deposed coordinator
    waited the whole grace, then as long again for its goodbye)."""
    import time

    conf = tuple((k, "0.3" if k == "node_timeout" else v) for k, v in CONF)
    job = make(nnodes_max=2, rdzv_conf=conf)
    job.start(1)
    job.sent(1)
    began = time.monotonic()
    job.coord.stop_workers(signal.SIGTERM, 30.0, job.node.workers.stop)
    assert time.monotonic() - began < 30.0  # well before the grace: it never answers
    assert not job.coord.nodes[1].alive
