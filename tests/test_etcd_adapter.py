"""The etcd adapter against a real 3-member etcd cluster on loopback: elections and
takeovers, fenced writes refused once the writer is deposed, a member lost (nothing changes),
the majority lost (clear errors within the timeout, then recovery), watches in order.
Each test works under a key prefix of its own; one that kills members brings them back."""

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import FIXTURES, wait_for
from etcdlab import (
    EtcdLab,
    ensure_all_up,
    etcd_cluster_fixture,  # noqa: F401 (the etcd_cluster fixture)
    unavailable,
)
from ports import free_port

from ftrun.adapters.etcd import EtcdClient, EtcdError, connect, preflight
from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.adapters.etcd_election import Election, LeaseLost
from ftrun.adapters.etcd_lease import Lease, grant
from ftrun.adapters.etcd_watch import Watch

TAKEOVER_S = 20.0  # a lapsed 2 s lease seen by the next candidate, on a loaded machine


@pytest.fixture
def prefix() -> str:
    return f"/test/{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def client(etcd_cluster: EtcdLab) -> Iterator[EtcdClient]:
    c = connect(etcd_cluster.endpoints)
    yield c
    c.close()


def _candidate(client: EtcdClient, prefix: str, node: str) -> tuple[Election, Lease]:
    lease = grant(client)
    return Election(client, prefix + "leader/", lease, node, f"host-{node}"), lease


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if ready:
            return proc.stdout.readline().strip()
    raise AssertionError(f"no line from pid {proc.pid} within {timeout} s")


def test_election_a_resigned_leader_is_followed_and_can_no_longer_write(
        client: EtcdClient, prefix: str) -> None:
    a, lease_a = _candidate(client, prefix, "a")
    b, lease_b = _candidate(client, prefix, "b")
    try:
        assert a.campaign(timeout=5) and a.leading
        assert not b.campaign(timeout=0.3)  # a leads: b waits in line
        who = b.leader()
        assert who is not None and (who.node, who.host, who.since) == ("a", "host-a", a.since)
        assert a.write({prefix + "gen/1": "from a"}) and not b.write({prefix + "gen/1": "b"})
        assert a.resign()
        assert b.campaign(timeout=5) and b.leading
        who = a.leader()
        assert who is not None and (who.node, who.lease) == ("b", lease_b.id)
        assert not a.write({prefix + "gen/2": "from a"})  # resigned: refused
        assert b.write({prefix + "gen/2": "from b"}, deletes=[prefix + "gen/1"])
        assert [kv.key for kv in client.get_prefix(prefix + "gen/")] == [prefix + "gen/2"]
    finally:
        lease_a.revoke()
        lease_b.revoke()


def test_a_frozen_leader_is_deposed_when_its_lease_lapses_and_its_late_write_refused(
        etcd_cluster: EtcdLab, client: EtcdClient, prefix: str) -> None:
    """The leader's agent freezes (SIGSTOP: a GC pause, a cut link): its lease lapses, the
    next candidate takes over; woken, the old leader still believes it leads, and etcd
    refuses its write."""
    old = subprocess.Popen([sys.executable, str(FIXTURES / "etcd_candidate.py"),
                            etcd_cluster.endpoints, prefix + "leader/", "old"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    new, lease = _candidate(client, prefix, "new")
    try:
        assert _line(old, 30) == "leading"
        assert not new.campaign(timeout=0.2)
        old.send_signal(signal.SIGSTOP)
        assert new.campaign(timeout=TAKEOVER_S)
        who = new.leader()
        assert who is not None and who.node == "new"
        old.send_signal(signal.SIGCONT)
        assert old.stdin is not None
        old.stdin.write(prefix + "gen/late\n")
        old.stdin.flush()
        assert _line(old, 30) == "refused"
        assert client.get(prefix + "gen/late") is None  # nothing of the old leader landed
        assert new.write({prefix + "gen/next": "new"})
    finally:
        old.kill()
        old.wait(10)
        lease.revoke()


def test_a_lapsed_candidate_cannot_campaign(client: EtcdClient, prefix: str) -> None:
    e, lease = _candidate(client, prefix, "x")
    lease.revoke()  # etcd deletes whatever the lease held
    with pytest.raises(LeaseLost):
        e.campaign(timeout=1)


def test_one_member_lost_changes_nothing(etcd_cluster: EtcdLab, client: EtcdClient,
                                         prefix: str) -> None:
    """etcd's own raft leader killed: reads and writes go on, and so does the leadership:
    while etcd elects a new raft leader no keep-alive is acknowledged (the holder may see
    its lease as lapsed for a moment), but etcd extends every lease then, and the
    refreshes bring it back."""
    a, lease_a = _candidate(client, prefix, "a")
    b, lease_b = _candidate(client, prefix, "b")
    try:
        assert a.campaign(timeout=5)
        health = client.health()
        assert all(h.up for h in health) and sum(h.is_leader for h in health) == 1
        raft_leader = etcd_cluster.raft_leader()
        assert raft_leader is not None
        etcd_cluster.kill(raft_leader)
        assert a.write({prefix + "gen/1": "after the loss"})
        assert client.get(prefix + "gen/1") is not None
        wait_for(lambda: not lease_a.lapsed, 10, "a keep-alive acknowledged again")
        assert not b.campaign(timeout=lease_a.ttl * 1.5)  # a's lease outlived the loss
        assert a.leading and not lease_a.lost
        health = client.health()
        down = [h for h in health if not h.up]
        assert [h.endpoint for h in down] == [etcd_cluster.endpoint(raft_leader)]
        assert down[0].error == "connection refused"
        assert sum(h.is_leader for h in health) == 1
        assert a.resign() and b.campaign(timeout=5)
    finally:
        ensure_all_up(etcd_cluster)
        lease_a.revoke()
        lease_b.revoke()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_majority_lost_fails_with_a_clear_error_then_recovers(
        etcd_cluster: EtcdLab, prefix: str) -> None:
    """Two members of three killed: every operation fails within its timeout with one line;
    the leader knows its lease may have lapsed. Members back: operations succeed, and the
    leader still leads (etcd extended its lease when its new raft leader took over)."""
    client = connect(etcd_cluster.endpoints, timeout=1.0)
    a, lease = _candidate(client, prefix, "a")
    b, lease_b = _candidate(client, prefix, "b")
    try:
        assert a.campaign(timeout=5)
        etcd_cluster.kill(1)
        etcd_cluster.kill(2)
        with pytest.raises(EtcdError, match=r"etcd did not answer within 1 s .*"
                           r"connection refused") as failed:
            client.put(prefix + "k", "v")
        assert "majority" in failed.value.hint
        with pytest.raises(EtcdError, match="no leader|did not answer"):
            preflight(EtcdConf(tuple(etcd_cluster.endpoints.split(","))), timeout=2)
        assert lease.wait_lapsed(timeout=30) and not a.leading
        with pytest.raises(EtcdError):
            a.write({prefix + "gen/1": "x"})
        ensure_all_up(etcd_cluster)
        assert client.put(prefix + "k", "v") > 0
        wait_for(lambda: not lease.lapsed, 10, "a keep-alive acknowledged again")
        assert a.leading and a.write({prefix + "gen/1": "after the outage"})
        assert not b.campaign(timeout=0.3)
        assert a.resign() and b.campaign(timeout=5)
    finally:
        ensure_all_up(etcd_cluster)
        lease.revoke()
        lease_b.revoke()
        client.close()


def test_watch_delivers_every_change_in_order_across_a_member_loss(
        etcd_cluster: EtcdLab, client: EtcdClient, prefix: str) -> None:
    watch = Watch(client, prefix, prefix=True, idle_s=120)  # only a loss ends a stream
    try:
        assert watch.wait_started(10)
        for i in range(20):
            client.put(f"{prefix}k{i:02d}", str(i))
        client.delete(prefix + "k00")
        serving = watch.member
        assert serving is not None
        etcd_cluster.kill(etcd_cluster.endpoints.split(",").index(serving))
        for i in range(20, 30):
            client.put(f"{prefix}k{i:02d}", str(i))
        seen: list[Any] = []
        while len(seen) < 31:
            event = watch.get(timeout=30)
            assert event is not None, f"{len(seen)} events came, then none ({watch.broken})"
            seen.append(event)
        revisions = [e.revision for e in seen]
        assert revisions == sorted(set(revisions))  # in order, none twice
        assert [e.value.decode() for e in seen if e.kind == "put"] == [str(i) for i in range(30)]
        assert [e.key for e in seen if e.kind == "delete"] == [prefix + "k00"]
        assert watch.member not in (None, serving) and watch.get(timeout=0.2) is None
        watch.stop()  # cuts the open stream under its blocked reader
        assert not watch.running
    finally:
        watch.stop()
        ensure_all_up(etcd_cluster)


def test_a_quiet_watch_is_reopened_and_misses_nothing(client: EtcdClient, prefix: str) -> None:
    """A stream silent for `idle_s` is taken for a frozen member's and opened again, from the
    revision after the last event: a change between two streams is still delivered, once."""
    client.put(prefix + "before", "0")
    watch = Watch(client, prefix, prefix=True, idle_s=0.3)
    try:
        assert watch.wait_started(10)
        wait_for(lambda: watch.streams >= 3, 30, "the quiet stream opened again twice")
        revision = client.put(prefix + "after", "1")
        event = watch.get(timeout=10)
        assert event is not None and (event.key, event.revision) == (prefix + "after", revision)
        wait_for(lambda: watch.streams >= 5, 30, "two more quiet streams")
        assert watch.get(timeout=0.1) is None  # the reopened streams repeated nothing
    finally:
        watch.stop()


def test_preflight_names_an_unreachable_cluster(etcd_cluster: EtcdLab) -> None:
    health = preflight(EtcdConf(tuple(etcd_cluster.endpoints.split(","))))
    assert [h.up for h in health] == [True] * 3 and len({h.raft_term for h in health}) == 1
    port = free_port()
    with pytest.raises(EtcdError, match=f"etcd is unreachable at 127.0.0.1:{port} "
                       r"\(connection refused\)"):
        preflight(EtcdConf((f"127.0.0.1:{port}",)))


def test_no_member_process_outlives_the_lab() -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    lab = EtcdLab(1).start()
    pids = [p.pid for p in lab.procs if p is not None]
    lab.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_frozen_member_never_holds_the_coordinators_status(etcd_cluster: EtcdLab,
                                                             prefix: str) -> None:
    """The members' health (in `ftrun status`) is asked from a thread of the plane's own: a
    frozen member costs its timeout there, while the coordinator's loop, which publishes the
    status and decides faults, gets the last answer at once."""
    from ftrun.cluster.plane import EtcdPlane

    conf = EtcdConf.parse(tuple(etcd_cluster.endpoints.split(",")), {}, prefix.strip("/"))
    plane = EtcdPlane(conf, "health-probe", "127.0.0.1")
    frozen = etcd_cluster.procs[2]
    assert frozen is not None
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        assert plane.describe().members == ()  # asked, not answered yet: no wait here
        rows = wait_for(lambda: plane.describe().members, 15, "the members' health")
        assert isinstance(rows, tuple)
        assert [r.up for r in rows] == [True, True, False]
        assert rows[2].endpoint == etcd_cluster.endpoint(2) and rows[2].error
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
        plane.close()
        ensure_all_up(etcd_cluster)
