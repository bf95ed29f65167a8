"""Replica groups that span nodes (--shard-size a multiple of the workers per node), without
processes: the option's checks, the pure decision on a lost node (in the style of
test_policy.py), which ready workers enter as whole groups, and the coordinator with a real
`Recovery` (test_cluster_units' harness) carrying a node loss out: its group out, the group's
ranks on another node stopped and started again, a waiting node admitted for the lost ranks,
and the fresh group entering whole. The end-to-end run is test_replica_groups_span.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from fakestore import generation
from test_cluster_units import Job, join, make  # noqa: F401 (the fixture)
from test_replica_groups_recovery import recovered

from ftrun.cli.launch_args import parse_run_args
from ftrun.cluster.messages import End, Kill, Left, Spawn, Start
from ftrun.core.errors import UsageError
from ftrun.core.events import Event
from ftrun.core.membership import WorkerRole
from ftrun.core.policy import FaultAction, FaultDecision, Snapshot
from ftrun.core.replica_groups import decide_group_node_loss, entering_groups, group_rows
from ftrun.protocol.rendezvous import Hello, encode

A = FaultAction
R = WorkerRole
MULTI = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]


# ------------------------------------------------------------------ the option
def test_a_multiple_of_the_workers_per_node_is_accepted() -> None:
    spec = parse_run_args(["--nproc", "2", "--nnodes", "2:4", "--shard-size", "4", *MULTI,
                           "t.py"])
    assert (spec.shard_size, spec.nproc, spec.nnodes_min, spec.nnodes_max) == (4, 2, 2, 4)
    assert parse_run_args(["--nproc", "1", "--nnodes", "4", "--shard-size", "2", *MULTI,
                           "t.py"]).shard_size == 2


@pytest.mark.parametrize(("argv", "says", "hint"), [
    (["--nproc", "4", "--shard-size", "6"], "does not divide --nproc-per-node 4, nor is it a "
     "multiple of it", "pick a divisor (2, 4: a group inside one node) or a multiple (8, 12"),
    (["--nproc", "2", "--shard-size", "4"], "--shard-size 4 spans 2 nodes: --nnodes 1:1 does "
     "not count whole replica groups", "multiples of 2"),
    (["--nproc", "2", "--nnodes", "3:4", *MULTI, "--shard-size", "4"], "--nnodes 3:4",
     "--nnodes 2:4"),
    (["--nproc", "1", "--nnodes", "2:4", *MULTI, "--shard-size", "2", "--spares", "1"],
     "--spares", "start a spare node instead"),
])
def test_what_spanning_groups_cannot_run_is_one_line_naming_what_to_pick(
        argv: list[str], says: str, hint: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_run_args([*argv, "t.py"])
    assert says in str(err.value) and "\n" not in str(err.value)
    assert err.value.hint and hint in err.value.hint


# ------------------------------------------------------------------ the decision
# 4 nodes of 1 worker (ids 0, 10, 20, 30), groups of 2: (0, 10) and (20, 30)
NODES = Snapshot(members=(0, 10, 20, 30), faults=1, max_faults=10, nodes_left=3, min_nodes=2)
OUT = "node 3 lost with 1 member; replica group 1 out"
GOES_ON = (f"{OUT} (1 rank on other nodes stopped), continuing with 1 group of 2; a fresh "
           f"group heals and rejoins once a node joins for the lost ranks")


def outcome(d: FaultDecision) -> tuple:
    return d.action, d.members, d.evicted, d.regrow, d.reason


NODE_LOSSES = [
    ("goes-on", {}, (30,), (A.SHRINK, (0, 10), (20,), True, GOES_ON)),
    ("coordinator's-group", {}, (0,), (A.SHRINK, (20, 30), (10,), True,
                                       GOES_ON.replace("group 1 out", "group 0 out")
                                       .replace("node 3", "node 0"))),
    ("two-groups-out", dict(members=(0, 10, 20, 30, 40, 50)), (30,),
     (A.SHRINK, (0, 10, 40, 50), (20,), True,
      GOES_ON.replace("1 group of 2", "2 groups of 2"))),
    ("only-group", dict(members=(0, 10), restarts_left=1), (10,),
     (A.RESTART_GROUP, (), (), True, "node 3 lost with 1 member; replica group 0 out, no "
      "other replica group holds the model; no replica left to heal from; restarting all "
      "workers")),
    ("healing-survivor", dict(unhealed=frozenset({0})), (30,),
     (A.FAIL, (), (), True, f"{OUT}, no other replica group holds the model; no replica "
      f"left to heal from")),
    ("from-snapshot", dict(unhealed=frozenset({10}), snapshot_step=40), (30,),
     (A.RESTART_GROUP, (), (), True, f"{OUT}, no other replica group holds the model; no "
      f"replica left to heal from: restarting all workers from the snapshot of step 40")),
    ("below-min-nodes", dict(nodes_left=1), (30,),
     (A.FAIL, (), (), True, "node 3 lost with 1 member; 1 node left is below --nnodes "
      "minimum 2")),
    ("below-min-nproc", dict(min_nproc=3), (30,),
     (A.FAIL, (), (), True, f"{OUT}; 2 left is below --min-nproc 3")),
    ("over-budget", dict(faults=11), (30,),
     (A.FAIL, (), (), True, "node 3 lost with 1 member; fault budget exhausted (10, "
      "--max-faults)")),
]


@pytest.mark.parametrize("changes, lost, expected",
                         [pytest.param(*row[1:], id=row[0]) for row in NODE_LOSSES])
def test_decide_group_node_loss(changes: dict, lost: tuple, expected: tuple) -> None:
    label = "node 0" if lost == (0,) else "node 3"
    assert outcome(decide_group_node_loss(replace(NODES, **changes), label, lost, 2)) == \
        expected


def test_ready_workers_enter_as_whole_groups_once_none_is_starting() -> None:
    assert entering_groups([40_000, 20_001], joining=0, shard_size=2) == (20_001, 40_000)
    assert entering_groups([40_000, 20_001], joining=1, shard_size=2) == ()
    assert entering_groups([20_001], joining=0, shard_size=2) == ()  # its node is to come
    assert entering_groups([50_000, 40_000, 20_001], 0, 2) == (20_001, 40_000)


# ------------------------------------------------------------------ the agent carries it out
def hello(job: Job, *wids: int) -> None:
    rec = job.node.recovery
    assert rec is not None
    for wid in wids:
        rec.deliver(encode(Hello(worker=wid, pid=1, spare=False)))
    assert rec.handle_requests() is None


def test_a_lost_node_takes_its_group_out_and_a_waiting_node_brings_it_back_whole(
        make: Callable[..., Job]) -> None:  # noqa: F811
    job = make(nproc=2, shard_size=4, nnodes_min=2, nnodes_max=4)
    job.start(1, 2, 3)  # groups (0, 1, 10000, 10001) and (20000, 20001, 30000, 30001)
    rec = job.recovery()
    for n in (1, 2, 3):
        job.sent(n)
    job.report(join(4))  # a spare node: the job is full, it waits
    job.coord.remote_exits()
    assert job.coord.tick() is None and job.sent(4) == []

    job.report(Left(node=3, reason="received SIGKILL"))
    job.coord.remote_exits()
    assert job.coord.tick() is None  # the loss, then the admission, in one pass
    gen = generation(job.worker_store)
    assert gen.members == (0, 1, 10_000, 10_001)  # group 0 goes on, never waited for
    fault, = job.node.of_kind(Event.FAULT)
    assert fault["decision"] == "shrink" and "replica group 1 out (2 ranks on other nodes " \
        "stopped), continuing with 1 group of 4" in fault["reason"]
    assert job.sent(2) == [Kill(worker=20_000), Kill(worker=20_001)]  # its partner node's
    assert isinstance(job.sent(3)[0], End)
    start, = job.sent(4)  # the waiting node enters for the lost ranks
    assert isinstance(start, Start) and not start.spare
    assert rec.membership.with_role(R.JOINING) == [40_000, 40_001]

    hello(job, 40_000, 40_001)  # ready, but half a group: it waits for its partner's ranks
    assert generation(job.worker_store).number == gen.number
    recovered(rec, 0, fault_at=1000.0)  # the live group's first commit: the ranks restart
    assert job.sent(2) == [Spawn(worker=20_002, rank=-1, local_rank=0, spare=False),
                           Spawn(worker=20_003, rank=-1, local_rank=1, spare=False)]
    rows = group_rows(rec.membership, 4)
    assert rows[-1] == {"group": None, "ranks": [], "state": "starting",
                        "workers": [40_000, 40_001, 20_002, 20_003]}
    hello(job, 20_002)
    assert generation(job.worker_store).number == gen.number  # 20003 is still starting
    hello(job, 20_003)
    grown = generation(job.worker_store)
    fresh = (20_002, 20_003, 40_000, 40_001)  # node by node, as ranks are assigned
    assert grown.members == (0, 1, 10_000, 10_001, *fresh) and grown.joiners == fresh
    assert [r["state"] for r in group_rows(rec.membership, 4)] == ["training", "healing"]
    recovered(rec, 40_000, first_commit=1000.5)
    assert job.node.notices()[-1].startswith("replica groups back in service")
    job.report(join(5))  # the groups are whole: a node that would bring spares waits
    job.coord.remote_exits()
    assert job.coord.tick() is None and job.sent(5) == []
    assert job.node.notices()[-1] == ("node 5 (h5) waits: the job is full (4 of --nnodes max "
                                      "4 nodes); it enters when a node is lost")


def test_the_first_attempt_takes_whole_groups_and_a_node_left_over_waits(
        make: Callable[..., Job]) -> None:  # noqa: F811
    job = make(nproc=2, shard_size=4, nnodes_min=2, nnodes_max=4)
    job.start(1, 2)  # 3 nodes at the last call: 2 make a group, the third waits
    assert job.coord.others.initial_members() == (0, 1, 10_000, 10_001)
    assert job.sent(2) == []
    job.recovery()
    assert job.coord.tick() is None and job.sent(2) == []
    assert job.node.notices()[-1] == ("node 2 (h2) waits: the replica groups are whole (they "
                                      "span nodes); it enters when a node is lost")


def test_without_a_node_the_stopped_ranks_wait_and_start_when_one_enters(
        make: Callable[..., Job]) -> None:  # noqa: F811
    job = make(nproc=2, shard_size=4, nnodes_min=2, nnodes_max=4)
    job.start(1, 2, 3)
    rec = job.recovery()
    for n in (1, 2, 3):
        job.sent(n)
    job.report(Left(node=1, reason="received SIGKILL"))  # group 0: the coordinator's node's
    job.coord.remote_exits()
    assert job.coord.tick() is None
    assert generation(job.worker_store).members == (20_000, 20_001, 30_000, 30_001)
    assert job.node.workers.signals == [(0, 9), (1, 9)]  # its ranks here were stopped
    job.node.workers.reap()
    recovered(rec, 20_000, fault_at=1000.0)
    assert job.node.workers.all[2:] == []  # no node for the lost ranks: nothing started yet
    assert rec.membership.with_role(R.JOINING) == []
    job.report(join(4))  # a node joins later: it enters, and the stopped ranks start at once
    job.coord.remote_exits()
    assert job.coord.tick() is None
    assert [w.worker_id for w in job.node.workers.all[2:]] == [2, 3]
    assert rec.membership.with_role(R.JOINING) == [40_000, 40_001, 2, 3]
    hello(job, 2, 3, 40_000, 40_001)
    assert generation(job.worker_store).members == (20_000, 20_001, 30_000, 30_001, 2, 3,
                                                    40_000, 40_001)
