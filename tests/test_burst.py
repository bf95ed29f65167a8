"""A burst of faults found in one pass of the agent's loop is one generation (#52): each fault
is decided on the membership the previous one left, the record goes out once, under the next
number (a worker's watcher reads the numbers one after another), and the journal closes every
fault that generation answers. `Recovery` with the fake port and store of
tests/test_recovery_core.py; the journal fed as the agent feeds it."""
from __future__ import annotations

from test_recovery_core import FakePort, MemoryStore, exit_, hello, make, recovered

from ftrun.agent.journal import Journal
from ftrun.agent.recovery import Recovery
from ftrun.core.events import FaultFields, GenerationFields, RecoveredFields, emit_as
from ftrun.core.membership import WorkerRole
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, gen_key


def with_spares(nproc: int, spares: int) -> tuple[Recovery, FakePort, MemoryStore]:
    """Members 0..nproc-1 and `spares` ready spares after them, every one said hello."""
    rec, port, store = make(nproc=nproc, spares=spares)
    for wid in range(nproc + spares):
        hello(rec, wid, spare=wid >= nproc)
    return rec, port, store


def test_two_faults_in_one_pass_are_one_generation_under_the_next_number() -> None:
    rec, port, store = with_spares(4, 2)
    first = rec.membership.generation
    with rec.gens.batch():
        assert rec.on_exit(exit_(port, 1, -9)) is None
        assert rec.on_exit(exit_(port, 3, 1)) is None
        assert LATEST_KEY not in store.keys or int(store.keys[LATEST_KEY]) == first  # held
    gen = store.generation()
    assert gen.number == first + 1 == rec.membership.generation
    assert gen_key(first + 2) not in store.keys  # one record, no gap for a watcher to wait in
    assert gen.members == (0, 4, 2, 5) and set(gen.joiners) == {4, 5} and gen.urgent
    assert "worker 1" in gen.reason and "worker 3" in gen.reason
    assert [k for k, _ in port.events].count("generation") == 1
    assert [k for k, _ in port.events].count("fault") == 2
    assert (rec.membership.role(1), rec.membership.role(3)) == (WorkerRole.GONE,) * 2


def test_one_fault_alone_is_published_at_once_as_before() -> None:
    rec, port, store = make(nproc=2)
    hello(rec, 0)
    with rec.gens.batch():
        assert rec.on_exit(exit_(port, 1, 1)) is None
    assert store.generation().members == (0, 2) and store.generation().number == 1
    assert store.generation().reason == "worker 1 (rank 1) exited with 1; new worker 2 takes " \
                                        "rank 1"


def test_a_generation_that_answers_two_faults_closes_both_records() -> None:
    j = Journal(lambda kind, f: None)
    for worker in (1, 3):
        emit_as(j.emit, FaultFields(worker=worker, rank=worker, decision="replace",
                                    reason=f"worker {worker} replaced", why="exited with 1",
                                    committed_before=9))
    emit_as(j.emit, GenerationFields(1, 4, j.started_at, "both", urgent=True))
    emit_as(j.emit, RecoveredFields(1, worker=4, step=9, first_commit=j.started_at))
    assert [(r.generation, r.recovered, r.lost_steps) for r in j.faults] == [(1, True, 0)] * 2


def test_the_batch_recovers_as_one_generation() -> None:
    rec, port, store = with_spares(3, 2)
    with rec.gens.batch():
        rec.on_exit(exit_(port, 0, -9))
        rec.on_exit(exit_(port, 1, -9))
    assert store.generation().members == (3, 4, 2) and store.generation().number == 1
    recovered(rec, 2)
    assert [k for k, _ in port.events].count("recovered") == 1


def test_a_planned_change_in_the_same_pass_goes_out_alone_after_the_faults() -> None:
    """A planned change (switched at a step boundary; a drain's members snapshot first) is
    never merged into a fault's urgent generation: the faults held so far go out first."""
    rec, port, store = with_spares(4, 2)
    with rec.gens.batch():
        rec.on_exit(exit_(port, 1, -9))
        planned = tuple(m for m in rec.membership.members if m != 3)
        rec.gens.publish(planned, "worker 3 leaves (planned)", False, snapshot_first=True)
        rec.on_exit(exit_(port, 0, -9))
    records = [Generation.from_json(store.keys[gen_key(n)]) for n in (1, 2, 3)]
    assert [(g.urgent, g.snapshot_first) for g in records] == [
        (True, False), (False, True), (True, False)]
    assert records[1].members == planned and gen_key(4) not in store.keys
