"""The fencing rule's pure parts, the coordinator's node watch on a clock of the test's own,
and the net-down drill's refusals (a job on one node; a node in the host's own namespace)."""
import errno
import os
import subprocess

import pytest

from ftrun.cluster.nodewatch import NodeWatch
from ftrun.core.fencing import Next, cut_off, quiet_nodes, rejoin_step
from ftrun.core.policy import find_lost_nodes
from tests.conftest import FIXTURES, ftrun_cmd, wait_for
from tests.test_multinode import free_port, two_nodes
from tests.test_multinode import nodes as nodes  # noqa: F401  (the fixture)
from tests.test_multinode_units import FakeCounterStore


def test_quiet_nodes_and_the_fence() -> None:
    assert quiet_nodes({1: 0.1, 2: 0.7, 3: 2.0}, 0.7) == [2, 3]
    assert cut_off(2.9, 3.0) is None
    assert cut_off(3.2, 3.0) == "no answer from the store for 3.2 s"


@pytest.mark.parametrize("reached, err, stable, elapsed, action, needle", [
    (False, None, 0.0, 1.0, Next.RETRY, "unreachable"),
    (False, errno.ENETUNREACH, 0.0, 1.0, Next.RETRY, "unreachable"),
    (True, None, 0.4, 1.0, Next.RETRY, "settling"),  # a blink of the link is not a return
    (True, None, 1.0, 4.0, Next.JOIN, "answered for 1.0 s"),
    (False, errno.ECONNREFUSED, 0.0, 0.5, Next.END, "coordinating agent has ended"),
    (False, None, 0.0, 10.0, Next.END, "did not answer steadily again within 10 s"),
    (True, None, 0.5, 10.0, Next.END, "within 10 s"),
])
def test_what_a_fenced_follower_does_next(reached, err, stable, elapsed, action,
                                          needle) -> None:
    step = rejoin_step(reached, err, stable, elapsed, 10.0, 1.0)
    assert step.action is action and needle in step.reason


def test_rejoining_can_be_turned_off() -> None:
    step = rejoin_step(True, None, 5.0, 0.0, 0.0, 1.0)
    assert step.action is Next.END and "rejoin_timeout=0" in step.reason


class Counters(FakeCounterStore):
    """The node watch's store (one fake, c10d's semantics), with a node's beat."""

    def beat(self, node: int) -> None:
        self.add(f"ftrun/rdzv/node/{node}/beat", 1)


def run_watch(silent: dict[int, tuple[float, float]], until: float,
              answers: set[int] = frozenset(), cut_s: float = 1.3
              ) -> tuple[dict[int, float], list[tuple[int, list[int]]]]:
    """Nodes 1-3 beat every 0.1 s on a 0.1 s tick, except in their `silent` window (from, to
    in s); nodes in `answers` answer every ping. Returns when each node was lost, and the
    ping rounds."""
    store, watch = Counters(), NodeWatch(5.0, 1.0, 0.7, cut_s)
    for n in (1, 2, 3):
        watch.watch(n, now=0.0)
    lost_at: dict[int, float] = {}
    rounds = []
    for tick in range(1, int(until * 10) + 1):
        now = tick / 10
        for n in (1, 2, 3):
            start, end = silent.get(n, (1e9, 1e9))
            if not start <= now < end:
                store.beat(n)
        verdict = watch.check(store, lambda: [n for n in (1, 2, 3) if n not in lost_at],
                              now=now)
        if verdict.ping is not None:
            rounds.append(verdict.ping)
            for n in answers & set(verdict.ping[1]):
                watch.answer(n, verdict.ping[0])
        for n, _, _ in verdict.lost:
            lost_at[n] = now
            watch.forget(n)
    return lost_at, rounds


def test_a_cut_node_is_lost_after_the_cut_timeout_and_its_peers_are_not() -> None:
    lost_at, rounds = run_watch({2: (1.0, 1e9)}, until=4.0, answers={1, 3})
    assert list(lost_at) == [2]
    assert 0.9 + 1.3 <= lost_at[2] <= 0.9 + 1.3 + 0.1  # its last beat at 0.9: lost 1.3 s later
    assert rounds and all(nodes == [1, 2, 3] for _, nodes in rounds[:1])  # everyone is asked


def test_a_blink_shorter_than_the_cut_timeout_costs_nothing() -> None:
    lost_at, rounds = run_watch({2: (1.0, 2.1)}, until=5.0, answers={1, 3})
    assert not lost_at and rounds  # a 1.1 s silence: pinged, and forgiven when it beat again
    lost_late, _ = run_watch({2: (1.0, 2.4)}, until=5.0, answers={1, 3})
    assert list(lost_late) == [2]  # 1.4 s: lost


def test_a_node_that_answers_pings_is_lost_only_after_the_node_timeout() -> None:
    lost_at, _ = run_watch({2: (1.0, 1e9)}, until=7.0, answers={1, 2, 3})
    assert 0.9 + 5.0 <= lost_at[2] <= 0.9 + 5.0 + 0.1  # its agent lives: node_timeout


def test_nodes_cut_together_are_lost_together() -> None:
    lost_at, _ = run_watch({n: (1.0, 1e9) for n in (1, 2, 3)}, until=4.0)
    assert len(set(lost_at.values())) == 1 and len(lost_at) == 3


def test_after_a_broken_connection_a_silent_node_is_lost_at_once() -> None:
    store, watch = Counters(), NodeWatch(5.0, 1.0, 0.7, 1.3)
    watch.watch(1, now=0.0)
    store.beat(1)
    watch.check(store, lambda: [1], now=0.1)
    assert watch.suspect([1], now=0.2) is not None
    assert watch.check(store, lambda: [1], now=0.45).lost == []
    (lost,) = watch.check(store, lambda: [1], now=0.55).lost
    assert lost[0] == 1 and lost[1].startswith("no answer to a ping and no heartbeat for")
    assert find_lost_nodes({1: 0.4}, 1.0, frozenset({1}), 1.3) == []  # a blink: not yet


def test_between_reads_nothing_is_judged_and_a_ping_round_reads_every_pass() -> None:
    """A busy loop passes many times between two reads of the counters: those passes judge
    nothing and ask for no node list (at 4,096 nodes that was ~2 ms a pass); a loss is still
    found within one read interval of its timeout, and while a ping round runs every pass
    reads (its fuse, `NODE_PING_S`, is shorter than the interval)."""
    store, watch = Counters(), NodeWatch(5.0, 1.0, 0.7, 1.3, read_every_s=0.5)
    asked: list[float] = []

    def nodes() -> list[int]:
        asked.append(now)
        return [1, 2]

    for n in (1, 2):
        watch.watch(n, now=0.0)
    reads, lost_at, rounds = 0, None, []
    for tick in range(1, 80):  # a pass every 0.1 s; node 2 falls silent at 1.0 s
        now = tick / 10
        store.beat(1)
        if now < 1.0:
            store.beat(2)
        before = store.requests
        verdict = watch.check(store, nodes, now=now)
        reads += store.requests > before
        rounds += [now] if verdict.ping else []
        if verdict.lost and lost_at is None:
            lost_at = verdict.lost[0][2], now
    assert rounds and all(t in asked for t in rounds) and len(asked) == len(rounds)
    assert lost_at is not None and 1.3 <= lost_at[0] <= 1.3 + 0.5 + 0.1  # cut: within a read
    assert reads < 79  # not every pass read


def test_net_down_is_refused_for_a_job_on_one_node(private_run_dir) -> None:
    env = dict(os.environ)  # FTRUN_RUN_DIR: a short path (a socket path holds 107 bytes)
    job = subprocess.Popen(ftrun_cmd("--nproc", "1", str(FIXTURES / "behave.py"), "--sleep",
                                     "30"), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        drill = wait_for(lambda: (r := subprocess.run(
            ftrun_cmd("inject-fault", "--node", "0", "--kind", "net-down", "--duration", "1"),
            env=env, capture_output=True, text=True, timeout=30)) and "no ftrun job" not in
            r.stderr and r, 30, "the job's control socket")
        assert drill.returncode == 1
        assert "this job runs on one node" in drill.stderr and drill.stderr.count("\n") == 1
    finally:
        job.kill()
        job.wait(10)


def test_net_down_is_refused_where_the_node_shares_the_host_network(tmp_path, nodes) -> None:
    """Agents on loopback, in the host's own namespace: cutting a link would cut the host."""
    port = free_port()
    args = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", str(FIXTURES / "behave.py"), "--sleep", "30"]
    a, _ = two_nodes(nodes, port, args)
    wait_for(lambda: (d := a.status()) and len(d["nodes"]) == 2, 60, "both nodes joined")
    for node in ("0", "1"):
        drill = subprocess.run(ftrun_cmd("inject-fault", "--node", node, "--kind", "net-down",
                                         "--duration", "1"), env=a.env, capture_output=True,
                               text=True, timeout=30)
        assert drill.returncode == 1, drill.stdout
        assert f"node {node} cannot take its link down" in drill.stderr
        assert drill.stderr.count("\n") == 1
    missing = subprocess.run(ftrun_cmd("inject-fault", "--node", "7", "--kind", "net-down",
                                       "--duration", "1"), env=a.env, capture_output=True,
                             text=True, timeout=30)
    assert "no live node 7 in this job (nodes: 0, 1)" in missing.stderr
