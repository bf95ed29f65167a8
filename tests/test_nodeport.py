"""The port the agent's helpers reach their node through (`agent.nodeport.NodePort`): a
question about a worker goes to this node's workers or, for another node's, to the cluster;
the routing exists once, for the agent and for `tests/fakes.FakeNode` alike (#49)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from fakes import FakeNode
from statusdocs import status

from ftrun.agent.cluster import Local, NoOtherNodes
from ftrun.agent.ports import AgentPort
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, node_of


class NodeOne(NoOtherNodes):
    """This node is 0; node 1's workers are the directory's to start, read and kill."""

    def __init__(self) -> None:
        self.placed: list[tuple[int, int]] = []
        self.killed: list[int] = []

    def other_nodes(self) -> list[int]:
        return [1]

    def relay_inboxes(self) -> dict[int, str]:
        return {1: "10.0.0.2:4000"}

    def allocate_id(self, node: int) -> int:
        return node * WORKER_ID_STRIDE + 7

    def peek_id(self, node: int) -> int:
        return node * WORKER_ID_STRIDE + 7

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        self.placed.append((worker_id, rank))

    def highest_committed(self, worker_ids: Iterable[int]) -> int:
        return 41 if any(node_of(w) == 1 for w in worker_ids) else -1  # node 1's say

    def kill_remote(self, worker_id: int) -> bool:
        self.killed.append(worker_id)
        return True


class WithNodeOne(Local):
    def __init__(self) -> None:
        self.others = NodeOne()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[FakeNode]:
    n = FakeNode(RunSpec("train.py", nproc=2, gpu_backend="none", log_dir=str(tmp_path)))
    n.attach(WithNodeOne())
    yield n
    n.close()


def test_a_question_about_another_nodes_worker_goes_to_the_cluster(node: FakeNode) -> None:
    port: AgentPort = node.port  # mypy: the agent's port fits every helper's protocol
    cluster = node.cluster.others
    assert isinstance(cluster, NodeOne)
    here = port.allocate_id(0)
    port.place(here, rank=0, local_rank=0, spare=False)
    there = port.allocate_id(1)
    assert node_of_ids(here, there) == (0, 1) and port.peek_id(1) == there
    port.place(there, rank=1, local_rank=0, spare=False)
    assert [w.worker_id for w in node.workers.all] == [here] and cluster.placed == [(there, 1)]
    assert port.live_nodes() == [0, 1] and port.relay_inboxes() == {1: "10.0.0.2:4000"}
    assert port.highest_committed([here, there]) == 41 and port.highest_committed([here]) == -1
    assert port.kill_worker(there) and cluster.killed == [there]
    assert port.kill_worker(here) and cluster.killed == [there]  # this node's own
    assert port.initial_members() == (0, 1)  # the cluster names none: this node's nproc


def test_members_are_this_nodes_live_workers_in_rank_order(node: FakeNode) -> None:
    port = node.port
    ids = {}
    for rank in (1, 0):
        ids[rank] = port.allocate_id(0)
        port.place(ids[rank], rank=rank, local_rank=rank, spare=False)
    assert [w.rank for w in port.live_members()] == [0, 1]
    node.fake_workers.end(ids[0], 0)
    assert [w.rank for w in port.live_members()] == [1]
    assert not port.uses_api() and port.control_name() == "units"
    shown = port.decorate_status(status())
    assert shown.snapshot is None and shown.zygote is None  # snapshots off; no zygote here


def test_the_status_gets_this_nodes_snapshots_as_a_record(tmp_path: Path) -> None:
    node = FakeNode(RunSpec("train.py", nproc=1, gpu_backend="none", log_dir=str(tmp_path),
                            snapshot_every=5))
    try:
        shown = node.port.decorate_status(status(generation=3))
        assert shown.snapshot is not None and shown.snapshot.every == 5 and shown.generation == 3
        assert shown.snapshot.dir == node.services.snapshots.disk
    finally:
        node.close()


def node_of_ids(*ids: int) -> tuple[int, ...]:
    return tuple(i // WORKER_ID_STRIDE for i in ids)
