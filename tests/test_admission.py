"""A node that joins a full job waits in line and enters when the job has room again.

The unit tests decide on plain values; the end-to-end run (real agents on loopback, c10d,
one gloo worker per node) goes through both ways a full job loses a node: a node's agent
SIGKILLed (the waiting 4th node is used), and the coordinator paused past the fence timeout
(every follower fences and rejoins as a new node, while the coordinator still counts the
old ones: the job must come back to its full size once it drops them).
"""
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ftrun.cluster.admission import Waiting, gathered, why_refused, why_wait
from ftrun.core import timeouts
from ftrun.core.node_flags import shared_flags
from ftrun.core.spec import RunSpec
from tests.conftest import FIXTURES, pid_alive, wait_for
from tests.test_multinode import Node, free_port, ft_job, nodes, wait_listening  # noqa: F401


def test_a_node_waits_while_the_job_is_full_and_enters_when_there_is_room() -> None:
    full = why_wait(3, 3, recovers_in_process=True, uses_api=True)
    assert full is not None and "the job is full (3 of --nnodes max 3 nodes)" in full
    assert why_wait(2, 3, recovers_in_process=True, uses_api=True) is None
    restart = why_wait(2, 3, recovers_in_process=False, uses_api=False)
    assert restart is not None and "--on-fault restart" in restart
    early = why_wait(2, 3, recovers_in_process=True, uses_api=False)
    assert early is not None and "ftrun API" in early


def test_an_attempt_starts_with_max_nodes_or_min_after_a_last_call_else_waits_or_fails(
        ) -> None:
    def verdict(count: int, waited_s: float, enough_for_s: float | None) -> bool | str:
        return gathered(count, (2, 4), waited_s, enough_for_s, join_s=60, last_call_s=1)
    assert verdict(4, 0, 0) is True  # MAX: no last call
    assert verdict(3, 5, 0.5) is False and verdict(3, 5, 1.0) is True  # MIN, then a last call
    assert verdict(1, 59, None) is False
    assert verdict(1, 61, None) == "only 1 of 2 nodes joined the rendezvous"
    assert verdict(2, 61, 0.2) is False  # enough in: the last call runs past join_timeout


def test_a_join_is_refused_for_another_job_a_taken_index_or_other_flags_in_that_order(
        ) -> None:
    ours, lost = shared_flags(RunSpec("t.py")), shared_flags(RunSpec("t.py", redo="lost"))

    def refused(joining_rdzv_id: str, joining_flags: str, index_taken: bool) -> str | None:
        return why_refused(rdzv_id="job", flags=ours, joining_rdzv_id=joining_rdzv_id,
                           joining_flags=joining_flags, index=1, index_taken=index_taken)
    assert refused("job", ours, False) is None
    assert refused("job", "", False) is None  # an agent before the check
    assert refused("other", lost, True) == "this store serves --rdzv-id 'job', not 'other'"
    assert refused("job", lost, True) == "node index 1 is taken"
    flags = refused("job", lost, False)
    assert flags is not None and flags.startswith("this node was started with --redo lost")


def test_a_waiting_node_is_told_each_reason_once() -> None:
    told = Waiting()
    assert told.news(4, "full") and not told.news(4, "full") and told.news(5, "full")
    assert told.news(4, "other") and told.news(4, "full")
    told.forget(4)
    assert told.news(4, "full")


def live_nodes(doc: dict[str, Any]) -> dict[int, int]:
    """node index -> its agent's pid, for the nodes alive in the job's table."""
    return {n["node"]: n["pid"] for n in doc["nodes"] if n["alive"]}


def full_size(coord: Node, agents: list[Node], after_generation: int, step: int,
              old: frozenset[int] = frozenset()) -> dict[str, Any] | None:
    """The job at 3 workers again, one on each agent of `agents` (none on the `old` node
    indexes), all past `step`."""
    doc = coord.status()
    if not doc or doc["world_size"] != 3 or doc["generation"] <= after_generation:
        return None
    members = [w for w in doc["workers"] if w["role"] == "member"]
    by_pid = live_nodes(doc)
    on = sorted(by_pid[w["node"]] for w in members if w["node"] in by_pid
                and w["node"] not in old)
    if on == sorted(a.proc.pid for a in agents) and all((w["step"] or 0) >= step
                                                        for w in members):
        return doc
    return None


@pytest.mark.slow
@pytest.mark.timeout(420)  # ~45 s on an idle host; 230 s seen at load 20 on 2 cores
def test_waiting_nodes_enter_when_a_node_is_lost_or_the_coordinator_pauses(
        tmp_path: Path, nodes) -> None:  # noqa: F811
    port, end_file = free_port(), tmp_path / "end_at"
    # a long last call: all three nodes start the job even on a loaded host (a node that
    # comes after the start would wait as a spare: the first world size is what grows back)
    args = ft_job(port, "--rdzv-id", "adm", "--rdzv-conf", "last_call_timeout=120",
                  nnodes="2:3", nproc=1, steps=100000, step_time=0.03) + [
        "--end-file", str(end_file)]
    a = nodes("a", args)
    wait_listening(port, 30)
    followers = [nodes("b", args), nodes("c", args)]
    first = wait_for(lambda: full_size(a, [a, *followers], -1, 5), 150, "3 nodes stepping")
    # node 1 is whichever follower joined first
    b = next(f for f in followers if f.proc.pid == live_nodes(first)[1])
    c = next(f for f in followers if f is not b)

    # a 4th node joins the full job: it waits, and the job stays as it is
    d = nodes("d", args)
    wait_for(lambda: "waits: the job is full (3 of --nnodes max 3 nodes)" in a.stderr, 60,
             "the 4th node told to wait")
    doc = a.status()
    assert doc["world_size"] == 3 and doc["generation"] == first["generation"]
    assert d.proc.pid in live_nodes(doc).values()

    # node 1's agent killed: the 4th node enters, and the job is back at 3 nodes
    b_workers = [w["pid"] for w in doc["workers"] if w["node"] == 1]
    assert live_nodes(doc)[1] == b.proc.pid
    b.kill()
    wait_for(lambda: not any(pid_alive(p) for p in b_workers), 15, "node 1's workers gone")
    grown = wait_for(lambda: full_size(a, [a, c, d], first["generation"] + 1, 1), 120,
                     "the waiting node's worker in the job")

    # the coordinator paused past the fence timeout: both followers fence and rejoin as new
    # nodes while it still counts the old ones; once it drops those, the new ones enter
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "fenced: cut off" in c.stderr and "fenced: cut off" in d.stderr, 60,
                 "both followers fenced")
        # the pause goes on (~5 s in all, as in the report): the kernel still accepts their
        # connections, so once the store has "answered" for NODE_SETTLE_S they join again,
        # and those joins are served the moment the coordinator resumes, before it drops
        # the old nodes (a ping unanswered for 0.3 s)
        time.sleep(timeouts.NODE_SETTLE_S + 1.0)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    old = frozenset(live_nodes(grown)) - {0}
    back = wait_for(lambda: full_size(a, [a, c, d], grown["generation"] + 1, 1, old), 120,
                    "the job back at 3 nodes after the pause")
    assert not old & set(live_nodes(back))  # the followers came back as new nodes

    end_file.write_text(str(max(w["step"] or 0 for w in back["workers"]) + 30))
    for agent in (a, c, d):
        assert agent.wait(120) == 0, agent.stderr
    everything = a.stderr + c.stderr + d.stderr
    assert "Traceback" not in everything
    assert "next restart" not in a.stderr
    assert "enters the running job" in a.stderr


def test_a_node_of_another_rdzv_id_or_other_flags_is_refused_and_the_job_goes_on(
        tmp_path: Path, nodes) -> None:  # noqa: F811
    port = free_port()
    job = ["--nnodes", "1:2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", str(FIXTURES / "behave.py"), "--sleep", "7"]
    a = nodes("a", ["--rdzv-id", "ours", *job])
    wait_listening(port, 30)
    stranger = nodes("b", ["--rdzv-id", "theirs", *job])
    other = nodes("c", ["--rdzv-id", "ours", "--redo", "lost", *job])  # its flags differ
    assert stranger.wait(60) == 1
    assert "the coordinator refused this node: this store serves --rdzv-id 'ours', not " \
           "'theirs'" in stranger.stderr, stranger.stderr
    assert "ended the job" not in stranger.stderr
    assert other.wait(60) == 1
    assert "the coordinator refused this node: this node was started with --redo lost (the " \
           "coordinator's: step); start every node with the same " in other.stderr, other.stderr
    assert a.wait(60) == 0, a.stderr
    assert ") refused: this node was started with --redo lost" in a.stderr, a.stderr


def test_a_fixed_size_job_whose_missing_node_was_refused_says_so_when_it_gives_up(
        nodes) -> None:  # noqa: F811
    port = free_port()
    job = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=4", str(FIXTURES / "behave.py")]
    a = nodes("a", job)
    wait_listening(port, 30)
    other = nodes("b", ["--redo", "lost", *job])
    assert other.wait(60) == 1
    assert "the coordinator refused this node" in other.stderr, other.stderr
    assert a.wait(60) == 1
    assert "only 1 of 2 nodes joined the rendezvous at" in a.stderr, a.stderr
    assert "was refused: this node was started with --redo lost" in a.stderr, a.stderr
    assert "Traceback" not in a.stderr + other.stderr

