"""The agent's loop goes before the threads that build the job's status (issue #52: at 1,024
nodes a fault that arrived during a status build was published ~450 ms late)."""
from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable

from statusdocs import fault, status, worker

from ftrun.agent.jobview import Node, merge_job_status
from ftrun.agent.precedence import LoopPrecedence
from ftrun.cluster import jobnodes
from ftrun.cluster.jobnodes import STATUS_PIECE_ROWS, status_text
from ftrun.protocol.status import Status, WorkerRow

WAIT_S = 5.0  # a thread's step in these tests: far beyond what any takes


def test_a_builder_waits_while_the_loop_decides_and_goes_on_after() -> None:
    loop = LoopPrecedence()
    reached, passed = threading.Event(), threading.Event()

    def builder() -> None:
        with loop.building():
            reached.set()
            loop.yield_to_loop()
            passed.set()

    with loop.deciding():
        thread = threading.Thread(target=builder, daemon=True)
        thread.start()
        assert reached.wait(WAIT_S)
        assert not passed.wait(0.2)  # held at its pause while the loop decides
        loop.yield_to_loop()  # the deciding thread itself never waits
        assert loop.is_deciding
    assert passed.wait(WAIT_S)  # let go when the pass ends
    thread.join(WAIT_S)
    assert not loop.is_deciding


def test_outside_a_pass_a_builder_never_waits_nor_a_thread_that_is_not_building() -> None:
    """The control thread answering `ftrun status` is not a builder: a pass blocked on an
    etcd write during an outage held its answer (tests/test_etcd_outage.py)."""
    loop = LoopPrecedence()
    done = threading.Event()

    def builder() -> None:
        with loop.building():
            loop.yield_to_loop()
        done.set()

    threading.Thread(target=builder, daemon=True).start()
    assert done.wait(WAIT_S)
    answered = threading.Event()

    def control() -> None:
        loop.yield_to_loop()
        answered.set()

    with loop.deciding():
        threading.Thread(target=control, daemon=True).start()
        assert answered.wait(WAIT_S)


def test_nested_passes_are_one_window_and_the_collector_runs_again_after() -> None:
    loop = LoopPrecedence()
    assert gc.isenabled()
    with loop.deciding():
        with loop.deciding():
            assert not gc.isenabled()  # a full collection waits for the publication
        assert loop.is_deciding and not gc.isenabled()
    assert not loop.is_deciding and gc.isenabled()


def test_a_collector_turned_off_before_stays_off() -> None:
    loop = LoopPrecedence()
    gc.disable()
    try:
        with loop.deciding():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_builds_pauses_are_bounded_in_all_when_the_loop_stays_busy() -> None:
    loop = LoopPrecedence()
    took: list[float] = []

    def builder() -> None:
        with loop.building(budget_s=0.1):
            for _ in range(5):
                start = time.monotonic()
                loop.yield_to_loop()
                took.append(time.monotonic() - start)

    with loop.deciding():
        thread = threading.Thread(target=builder, daemon=True)
        thread.start()
        thread.join(WAIT_S)
    assert len(took) == 5 and took[0] >= 0.09  # it paused...
    assert sum(took) < 0.1 + 1.0 and max(took[1:]) < 0.05  # ...then its budget was spent
    # (slowed, never stopped: a pass may block for as long as etcd is away)


def test_a_pass_that_published_holds_the_builders_while_it_settles() -> None:
    """After a publication the fault's record fans out (forwarders, nodes, workers): a
    status build beside it slowed the last node (etcd, 1,024 nodes: median 70.6 ms, not
    52.4). A pass that published nothing starts no settle."""
    loop = LoopPrecedence(settle_s=0.3)
    generation = [7]
    with loop.deciding(lambda: generation[0]):
        pass  # nothing published
    assert loop.settle_left() == 0.0
    with loop.deciding(lambda: generation[0]):
        generation[0] += 1
    assert 0.2 < loop.settle_left() <= 0.3
    took: list[float] = []

    def builder() -> None:
        with loop.building():  # no settle budget: it never waits for one
            start = time.monotonic()
            loop.yield_to_loop()
            took.append(time.monotonic() - start)
        with loop.building(settle_budget_s=jobnodes.SETTLE_BUDGET_S):  # the status
            start = time.monotonic()
            loop.yield_to_loop()
            took.append(time.monotonic() - start)
            start = time.monotonic()
            loop.yield_to_loop()  # settled: at once
            took.append(time.monotonic() - start)

    thread = threading.Thread(target=builder, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert len(took) == 3 and took[0] < 0.05 and took[1] >= 0.15 and took[2] < 0.05
    assert loop.settle_left() == 0.0
    start = time.monotonic()
    loop.yield_to_loop()  # a thread that is not building never settles
    assert time.monotonic() - start < 0.05


def test_settles_have_a_budget_of_their_own() -> None:
    """A build that spent its pauses for the loop still pauses for a settle (sharing one
    budget, a build ran through a fault's fan-out at 4,096 nodes); its settles' pauses are
    bounded in all too (faults a few tenths of a second apart stretch a build, never stop
    it)."""
    loop = LoopPrecedence(settle_s=WAIT_S)
    took: list[float] = []
    published = threading.Event()

    def pause() -> None:
        start = time.monotonic()
        loop.yield_to_loop()
        took.append(time.monotonic() - start)

    def builder() -> None:
        with loop.building(budget_s=0.1, settle_budget_s=0.3):
            pause()  # while the loop decides
            assert published.wait(WAIT_S)
            for _ in range(3):
                pause()

    generation = [1]
    with loop.deciding(lambda: generation[0]):
        thread = threading.Thread(target=builder, daemon=True)
        thread.start()
        _wait_for(lambda: bool(took))
        generation[0] += 1  # the pass publishes: a settle starts as it ends
    published.set()
    thread.join(WAIT_S)
    assert len(took) == 4 and took[0] >= 0.09  # the loop's budget, spent while it decided
    assert 0.25 <= sum(took[1:]) < 0.3 + 1.0  # then the settles' own, spent
    assert took[-1] < 0.05 and loop.settle_left() > 0.0


def _rows(n: int) -> tuple[WorkerRow, ...]:
    """Rows with what the encoder must escape: quotes, backslashes, control and non-ASCII."""
    return tuple(WorkerRow.from_json(worker(
        worker_id=i, rank=i, local_rank=i % 8, pid=1000 + i, step=i or None,
        committed_step=i - 1 if i else None, step_time_ms=12.5 if i % 3 else None,
        phase=f'step {i} "all-reduce" \\ ü\n\x00', straggler=None if i % 5 else "slow",
        node=i // 8, host=f"h{i // 8}")) for i in range(n))


def test_the_status_text_is_the_whole_document_encoded_at_once() -> None:
    paces: list[int] = []
    for n in (0, 1, STATUS_PIECE_ROWS, 2 * STATUS_PIECE_ROWS + 3):
        doc = status(faults=[fault(reason='a "quoted" reason', phases_ms={"detected": 1.5})])
        doc = Status.from_json({**doc.to_json(), "workers": [r.to_json() for r in _rows(n)]})
        paces.clear()
        text = status_text(doc, lambda: paces.append(1))
        assert text == json.dumps(doc.to_json())
        assert Status.from_json(json.loads(text)) == doc
        assert len(paces) == -(-n // STATUS_PIECE_ROWS) + 1  # a pause between two pieces


def test_merging_the_nodes_pauses_between_two_nodes() -> None:
    rows = _rows(24)
    nodes = [Node(index=i, host=f"h{i}", pid=i, nproc=8) for i in (1, 2, 3)]

    class Report:
        def __init__(self, node: int) -> None:
            self.workers = rows[8 * (node - 1):8 * node]
            self.snapshot = None

    paces: list[int] = []
    merged = merge_job_status(status(), nodes, {n.index: Report(n.index) for n in nodes}, None,
                              24, "127.0.0.1:1", None, lambda: paces.append(1))
    assert len(paces) == 3 and len(merged.workers) == 24


def test_between_two_status_builds_the_payloads_are_kept_read() -> None:
    """The loop finds the payloads read: a build at 1,024 nodes came every ~6-12 s, and the
    loop, reading them itself once stale, held a fault up to ~0.9 s."""
    from ftrun.cluster.jobnodes import StatusThread

    built: list[float] = []
    refreshed: list[float] = []

    class Store:
        def set(self, key: str, value: str) -> None:
            built.append(time.monotonic())

    thread = StatusThread(lambda: "{}", Store, lambda: refreshed.append(time.monotonic()),
                          lambda: 0.02)
    try:
        deadline = time.monotonic() + WAIT_S
        while len(refreshed) < 5:
            assert time.monotonic() < deadline, "the payloads were not kept read"
            time.sleep(0.02)
        assert len(built) == 1  # the next build is a second away (STATUS_EVERY_S)
        assert all(t > built[0] for t in refreshed)
    finally:
        thread.close()


def test_a_status_build_waits_for_a_publication_to_settle_within_a_bound() -> None:
    """No build starts while a publication settles, unless it has waited
    SETTLE_HOLD_MAX_S: faults a few tenths of a second apart must not stop the status. The
    payloads are kept read meanwhile (a fault's decision would read them itself)."""
    built: list[float] = []
    settles: list[float] = []  # when each settle ends (monotonic)

    class Store:
        def set(self, key: str, value: str) -> None:
            built.append(time.monotonic())

    def settle_left() -> float:
        return max([0.0, *(end - time.monotonic() for end in settles)])

    start = time.monotonic()
    settles.append(start + 0.4)
    refreshed: list[float] = []
    thread = jobnodes.StatusThread(lambda: "{}", Store, lambda: refreshed.append(
        time.monotonic()), lambda: 0.02, settle_left)
    try:
        _wait_for(lambda: len(built) == 1)
        assert built[0] >= start + 0.4  # the first build came after the settle
        assert sum(t < start + 0.4 for t in refreshed) >= 3  # read meanwhile
        settles.append(time.monotonic() + 60.0)  # one that never ends: the bound lets go
        _wait_for(lambda: len(built) == 2)
        held = built[1] - built[0]
        assert jobnodes.SETTLE_HOLD_MAX_S <= held < jobnodes.SETTLE_HOLD_MAX_S + 2.0
    finally:
        thread.close()


def _wait_for(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "not within the test's wait"
        time.sleep(0.02)


FROZEN = """
import gc, sys
sys.path.insert(0, {root!r})
from ftrun.agent.precedence import freeze_heap
held = [{{"n": n}} for n in range(5000)]  # what a process holds: its imports, its tables
before = len(gc.get_objects())
freeze_heap()
later = [[n] for n in range(10)]  # lists: always tracked
print(before > 5000, len(gc.get_objects()) < 100, gc.get_freeze_count() >= before,
      all(gc.is_tracked(d) for d in later))
"""


def test_freezing_the_heap_leaves_what_it_held_out_of_full_collections() -> None:
    """What the agent holds at an attempt's start (torch's ~200,000 objects among it) is no
    longer walked by a full collection, which a fault could wait out; what comes later is
    collected as before. In a fresh process: freezing this one would keep other tests'
    objects from the collector."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", FROZEN.format(root=root)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"] * 4
