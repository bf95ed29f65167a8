"""Replica groups (--shard-size) as `Recovery` runs them, without processes: `ReplicaGroups`
through a real `Recovery` over the in-memory store and the fake port of test_recovery_core.
test_replica_groups.py has the pure decision (`decide_group_fault`) case by case; here: what
is published, stopped, started and called in, and when."""

from __future__ import annotations

import json

from test_recovery_core import FakePort, MemoryStore, exit_, hello, make, say

from ftrun.agent.recovery import Recovery
from ftrun.core.membership import WorkerRole
from ftrun.core.policy import CRASH_LOOP_LIMIT
from ftrun.protocol.rendezvous import spare_group_key

R = WorkerRole
SHARDED = {"nproc": 4, "shard_size": 2, "max_faults": 100}  # groups (0, 1) and (2, 3)


def recovered(rec: Recovery, wid: int, first_commit: float = 1000.25,
              fault_at: float = 0.0) -> None:
    """`wid`'s first commit in the current generation (`fault_at` 0: no fault led to it)."""
    assert say(rec, "recovered", worker=wid, generation=rec.membership.generation,
               fault_at=fault_at, published_at=0.0, noticed=0.0, rebuilt=0.0, healed=0.0,
               step=3, first_commit=first_commit) is None


def spare_group(port: FakePort, store: MemoryStore, ids: tuple[int, ...]) -> list[object]:
    """How a started spare group shows: placed as spares on the devices after the node's
    workers, each member told its group in the store before it starts."""
    return [((w, -1, True), port.workers[w].local_rank, store.keys[spare_group_key(w)])
            for w in ids]


def test_a_lost_member_takes_its_group_out_and_a_fresh_group_comes_after_the_commit() -> None:
    rec, port, store = make(**SHARDED)
    hello(rec, 0)
    assert rec.on_exit(exit_(port, 3, 1)) is None
    gen = store.generation()
    assert (gen.number, gen.members, gen.joiners) == (1, (0, 1), ())
    assert port.killed == [2]  # its group cannot step without it: stopped at once
    assert port.placed == []  # the fresh group waits for the others' first commit
    fault, = port.faults()
    assert fault["decision"] == "shrink" and "replica group 1 out" in fault["reason"]
    assert rec.on_exit(exit_(port, 2, -9)) is None  # the stopped member's end: expected
    assert len(port.faults()) == 1
    recovered(rec, 0, fault_at=1000.0)
    assert port.placed == [(4, -1, False), (5, -1, False)]
    assert [port.workers[w].local_rank for w in (4, 5)] == [3, 2]  # the lost group's devices
    assert rec.membership.with_role(R.JOINING) == [4, 5]
    hello(rec, 4)
    assert store.generation().number == 1  # a group enters whole: 5 is not ready yet
    hello(rec, 5)
    gen = store.generation()
    assert (gen.number, gen.members, gen.joiners) == (2, (0, 1, 4, 5), (4, 5))
    assert gen.reason == "workers 4, 5 join as ranks 2, 3"
    recovered(rec, 4)  # generation 2's first commit, at full size
    assert port.notices()[-1] == ("replica groups back in service: generation 2 committed "
                                  "step 3 at full size, 250 ms after the fault")


def test_a_ready_spare_group_is_called_in_after_the_first_commit_and_replaced() -> None:
    rec, port, store = make(**SHARDED, spares=1)
    hello(rec, 0)  # the script uses the API: the spare group starts
    assert spare_group(port, store, (4, 5)) == [((4, -1, True), 4, b"4,5"),
                                               ((5, -1, True), 5, b"4,5")]
    for w in (4, 5):
        hello(rec, w, spare=True)
    assert rec.on_exit(exit_(port, 1, 1)) is None
    gen = store.generation()
    assert (gen.number, gen.members) == (1, (2, 3))  # the others go on without the group
    assert port.killed == [0]
    assert port.faults()[0]["reason"].endswith("spare group 4, 5 joins at the next step "
                                               "boundary")
    assert rec.membership.role(4) is rec.membership.role(5) is R.SPARE  # not before a commit
    assert len(port.placed) == 2
    recovered(rec, 2, fault_at=1000.0)
    gen = store.generation()
    assert (gen.number, gen.members, gen.joiners) == (2, (2, 3, 4, 5), (4, 5))
    assert rec.membership.role(4) is rec.membership.role(5) is R.HEALING
    assert port.placed[2:] == [(6, -1, True), (7, -1, True)]  # the pool is refilled
    assert [port.workers[w].local_rank for w in (6, 7)] == [0, 1]  # on the lost group's
    assert [port.workers[w].local_rank for w in (4, 5)] == [4, 5]  # devices, not on 4, 5
    assert store.keys[spare_group_key(7)] == b"6,7"
    assert rec.groups.spares == [(6, 7)]


def test_a_starting_spare_group_is_not_called_in_a_fresh_group_is() -> None:
    rec, port, store = make(**SHARDED, spares=1)
    hello(rec, 0)
    hello(rec, 4, spare=True)  # 5 is still building its model
    assert rec.on_exit(exit_(port, 1, 1)) is None
    assert "spare group" not in port.faults()[0]["reason"]
    recovered(rec, 2, fault_at=1000.0)
    assert port.placed[2:] == [(6, -1, False), (7, -1, False)]  # a fresh group, as joiners
    assert rec.groups.spares == [(4, 5)]  # the spare group stays in the pool
    assert store.generation().members == (2, 3)


def test_a_spare_groups_member_dying_stops_the_group_and_starts_another() -> None:
    rec, port, store = make(**SHARDED, spares=1)
    hello(rec, 0)
    hello(rec, 4, spare=True)
    assert rec.on_exit(exit_(port, 5, 1)) is None
    assert port.killed == [4]  # no use without its group
    assert rec.membership.role(4) is rec.membership.role(5) is R.GONE
    assert spare_group(port, store, (6, 7)) == [((6, -1, True), 4, b"6,7"),
                                               ((7, -1, True), 5, b"6,7")]
    assert port.notices()[-1] == "spare worker 5 exited with 1; starting another"
    assert rec.on_exit(exit_(port, 4, -9)) is None  # the stopped member's end: expected
    assert len(port.placed) == 4 and store.generation().number == 0
    assert rec.groups.spares == [(6, 7)]


def test_spare_groups_dying_before_any_commit_are_not_restarted_forever() -> None:
    rec, port, _ = make(**SHARDED, spares=1)
    hello(rec, 0)
    for _ in range(CRASH_LOOP_LIMIT):
        newest = port.placed[-1][0]
        assert rec.on_exit(exit_(port, newest, 1)) is None
    assert len(port.placed) == 2 * CRASH_LOOP_LIMIT  # the last death started none
    assert "(a crash loop); not starting more" in port.notices()[-1]
    assert rec.groups.spares == []


def test_a_fresh_groups_hello_queued_behind_the_commit_that_started_it_is_taken() -> None:
    """A forked worker can say hello before the agent is done with the request whose handling
    started it: the hello, queued behind that first commit, is the started worker's."""
    rec, port, store = make(**SHARDED)
    hello(rec, 0)
    assert rec.on_exit(exit_(port, 3, 1)) is None
    gen = rec.membership.generation
    rec.deliver(json.dumps({"kind": "recovered", "worker": 0, "generation": gen,
                            "fault_at": 1000.0, "published_at": 0.0, "noticed": 0.0,
                            "rebuilt": 0.0, "healed": 0.0, "step": 3, "first_commit": 1000.25}))
    for w in (4, 5):  # the ids the first commit's refill gives the fresh group
        rec.deliver(json.dumps({"kind": "hello", "worker": w, "pid": 100 + w, "spare": False}))
    assert rec.handle_requests() is None
    assert port.notices() == []  # neither hello refused as a stranger's
    gen2 = store.generation()
    assert (gen2.number, gen2.members, gen2.joiners) == (2, (0, 1, 4, 5), (4, 5))
