"""The pure parts of multi-node: node-loss decisions, heartbeat ages and endpoints (Slurm's
allocation: tests/test_slurm_env.py)."""
from dataclasses import replace
from typing import Any

import pytest
from fakestore import MemoryStore
from statusdocs import status

from ftrun.cli.launch_args import parse_run_args
from ftrun.cluster.link import (
    PAYLOAD_READ_CHUNK,
    endpoint_of,
    issue_ids,
    payload_key,
    read_payloads,
)
from ftrun.cluster.nodewatch import BeatTracker, Probe, beats_read_every_s
from ftrun.core.policy import FaultAction, Snapshot, decide_node_loss, find_lost_nodes
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, node_of

MEMBERS = (0, 1, 10_000, 10_001, 20_000, 20_001)


def test_a_lost_node_leaves_in_one_generation() -> None:
    d = decide_node_loss(Snapshot(MEMBERS, faults=1, max_faults=10, nodes_left=2, min_nodes=2),
                         "node 1", (10_000, 10_001))
    assert d.action is FaultAction.SHRINK
    assert d.members == (0, 1, 20_000, 20_001)
    assert "node 1 lost with 2 members" in d.reason and "on 2 nodes" in d.reason


def test_ready_spares_on_other_nodes_take_the_lost_ranks() -> None:
    snap = Snapshot(MEMBERS, (2, 20_002), faults=1, max_faults=10, nodes_left=2, min_nodes=2)
    d = decide_node_loss(snap, "node 1", (10_000, 10_001))
    assert d.action is FaultAction.REPLACE and d.joiners == (2, 20_002)
    assert d.members == (0, 1, 2, 20_002, 20_000, 20_001)  # the lost ranks, kept
    short = decide_node_loss(replace(snap, spares=(2,)), "node 1", (10_000, 10_001))
    assert short.action is FaultAction.SHRINK and short.members == (0, 1, 2, 20_000, 20_001)
    assert "(1 spare used)" in short.reason


@pytest.mark.parametrize("nodes_left, min_nodes, faults, unhealed, restarts, action, needle", [
    (1, 2, 1, frozenset(), 0, FaultAction.FAIL, "below --nnodes minimum 2"),
    (1, 2, 1, frozenset(), 1, FaultAction.RESTART_GROUP, "restarting all workers"),
    (2, 1, 11, frozenset(), 0, FaultAction.FAIL, "fault budget exhausted"),
    (2, 1, 1, frozenset({0, 1, 20_000, 20_001}), 0, FaultAction.FAIL, "no replica left"),
])
def test_node_loss_limits(nodes_left, min_nodes, faults, unhealed, restarts, action,
                          needle) -> None:
    snap = Snapshot(MEMBERS, (), unhealed, faults, 10, restarts, nodes_left=nodes_left,
                    min_nodes=min_nodes)
    d = decide_node_loss(snap, "node 1", (10_000, 10_001))
    assert d.action is action and needle in d.reason


def test_lost_nodes_by_heartbeat_age() -> None:
    assert find_lost_nodes({1: 0.05, 2: 0.4, 3: 6.0}, 5.0) == [(3, "no heartbeat for 6.0 s")]
    assert [n for n, _ in find_lost_nodes({1: 0.05, 2: 0.4}, 0.3)] == [2]
    # after a broken connection: unanswered pings count only with a silent heartbeat too
    lost = find_lost_nodes({1: 0.05, 2: 0.4, 3: 0.1}, 1.0, frozenset({1, 2}), 0.3)
    assert lost == [(2, "no answer to a ping and no heartbeat for 0.4 s")]


def test_a_probe_round_names_the_nodes_that_did_not_answer() -> None:
    probe = Probe()
    seq = probe.start([1, 2, 3], now=10.0)
    assert seq == 1 and probe.start([1], now=10.1) is None  # one round at a time
    probe.answer(1, seq)
    probe.answer(3, seq + 7)  # an answer to another round does not count
    assert probe.silent(now=10.2, wait_s=0.3) == set()  # still waiting
    assert probe.silent(now=10.4, wait_s=0.3) == {2, 3}
    assert probe.start([1], now=10.5) == 2  # the round is over: a new one may start


class FakeCounterStore:
    """The store calls BeatTracker makes, with c10d's semantics: add creates a counter, a
    multi-get of a missing key never answers (here: fails), counters come back as ASCII."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.requests = 0

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 1
        missing = [k for k in keys if k not in self.counts]
        if missing:
            raise TimeoutError(f"wait timeout for {missing}")
        return [str(self.counts[k]).encode() for k in keys]


def test_beat_tracker_ages_reset_when_the_counter_moves() -> None:
    store, beats = FakeCounterStore(), BeatTracker()
    beats.watch(1)
    beats.watch(2)
    assert set(beats.ages(store)) == {1, 2}
    store.add("ftrun/rdzv/node/1/beat", 1)
    ages = beats.ages(store)
    assert ages[1] < 0.01
    assert beats.beaten() == [1]
    beats.forget(2)
    assert set(beats.ages(store)) == {1}


def test_beat_tracker_reads_every_counter_in_one_request() -> None:
    store, beats = FakeCounterStore(), BeatTracker()
    for node in range(1, 301):
        beats.watch(node)
    beats.ages(store)  # the first pass makes each counter once
    before = store.requests
    for _ in range(5):
        beats.ages(store)
    assert store.requests - before == 5


def test_a_busy_loop_reads_the_counters_once_per_interval_and_ages_go_on_between() -> None:
    """The coordinator's loop may pass many times a beat: the counters are read at most every
    `read_every_s` (a fresh read on demand: a ping round's short fuse), and a node's age
    between reads counts from its last change seen, never younger than the truth."""
    store, beats = FakeCounterStore(), BeatTracker(read_every_s=0.05)
    for node in (1, 2):
        beats.watch(node, now=0.0)
    beats.ages(store, now=0.0)
    first = store.requests
    store.add("ftrun/rdzv/node/1/beat", 1)
    ages = beats.ages(store, now=0.03)  # within the interval: not read, node 1's beat unseen
    assert store.requests == first + 1 and ages == {1: 0.03, 2: 0.03}
    assert beats.ages(store, now=0.06)[1] == 0.0 and store.requests == first + 2  # read
    assert beats.ages(store, now=0.07, fresh=True) == {1: pytest.approx(0.01),
                                                       2: pytest.approx(0.07)}
    assert store.requests == first + 3
    assert beats_read_every_s(0.1) == 0.05 and beats_read_every_s(2.0) == 1.0  # half a beat



class CountedStore(MemoryStore):
    """A store connection that counts its multi-gets' sizes."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s=timeout_s)
        self.sizes: list[int] = []

    def multi_get(self, keys: Any) -> list[bytes]:
        self.sizes.append(len(keys))
        return super().multi_get(keys)


def test_the_payloads_are_read_a_chunk_a_request_and_a_failed_one_ends_the_read() -> None:
    """The store's server answers a request whole before any other: 4,096 payloads in one
    held a generation's publication up to 83 ms. A failed request (a node's key missing
    blocks a multi-get until the timeout) leaves its payloads and the rest unread, b"",
    never one timeout a chunk."""
    store = CountedStore(timeout_s=0.2)
    nodes = list(range(1, 2 * PAYLOAD_READ_CHUNK + 11))
    for node in nodes:
        store.set(payload_key(node), f"payload {node}")
    paused: list[int] = []
    got = read_payloads(store, nodes, lambda: paused.append(len(store.sizes)))
    assert got == [f"payload {n}".encode() for n in nodes]
    assert store.sizes == [PAYLOAD_READ_CHUNK, PAYLOAD_READ_CHUNK, 10]
    assert paused == [0, 1, 2]  # the pause comes before each request
    late = 10_000  # never beaten: a request with its key waits out the timeout
    assert read_payloads(store, [late] + nodes) == [b""] * (len(nodes) + 1)
    got = read_payloads(store, nodes[:PAYLOAD_READ_CHUNK + 5] + [late] + nodes[-5:])
    assert got[:PAYLOAD_READ_CHUNK] == [f"payload {n}".encode()
                                        for n in nodes[:PAYLOAD_READ_CHUNK]]
    assert got[PAYLOAD_READ_CHUNK:] == [b""] * 11  # its chunk and the rest
    assert store.sizes[3:] == [PAYLOAD_READ_CHUNK, PAYLOAD_READ_CHUNK, 11]  # one timeout each
    assert read_payloads(store, []) == []

def test_worker_ids_name_their_node() -> None:
    assert node_of(3) == 0 and node_of(WORKER_ID_STRIDE + 7) == 1


def test_pytorchjob_environment() -> None:
    env = {"PET_NNODES": "1:3", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-0:23456"}
    spec = parse_run_args(["t.py"], env=env)
    assert (spec.nnodes_min, spec.nnodes_max) == (1, 3)
    ep = endpoint_of(spec)
    assert (ep.host, ep.port) == ("job-0", 23456)


def test_endpoint_defaults() -> None:
    c10d = parse_run_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           "head", "t.py"], env={})
    assert (endpoint_of(c10d).host, endpoint_of(c10d).port) == ("head", 29400)
    static = parse_run_args(["--nnodes", "2", "--master-addr", "head", "t.py"], env={})
    assert (endpoint_of(static).host, endpoint_of(static).port) == ("head", 29500)


def test_a_node_rejoining_under_its_index_gets_fresh_worker_ids() -> None:
    issued: dict[int, int] = {}
    assert issue_ids(1, 2, issued) == [10000, 10001]
    assert issue_ids(2, 1, issued) == [20000]
    assert issue_ids(1, 2, issued) == [10002, 10003]  # the lost node's ids are gone for good
    assert issued == {1: 10004, 2: 20001}


def test_the_job_status_pairs_a_generation_with_its_own_members() -> None:
    """The coordinator reads its own node's status, then every node's payload (store reads):
    a generation published in between must not pair the old number with the new members (a
    CI run saw world_size 4 with generation 0 right after a node was lost)."""
    from ftrun.agent.jobview import merge_job_status
    from ftrun.core.membership import Membership

    ms = Membership((0, 1, 2, 3, 4, 5))
    doc = status(generation=ms.generation, world_size=len(ms.members))
    ms.publish((0, 1, 2, 3))  # the lost node's members leave while the payloads are read
    merged = merge_job_status(doc, [], {}, ms, 6, "127.0.0.1:1", 7)
    assert (merged.generation, merged.world_size) == (1, 4)
    plain = merge_job_status(status(generation=0), [], {}, None, 6, "127.0.0.1:1", 7)
    assert (plain.generation, plain.world_size) == (0, 6)
