"""The coordinator cut off by its network under `--rdzv-backend etcd`: real namespaces.

Three agents, each in its own network namespace (tests/netlab.py), and a real 3-member etcd
on this machine's address on the lab's bridge. The coordinator's cable is pulled: the other
two agents lose its store, its lease lapses in etcd, one of them is elected and adopts the
running attempt; a spare takes the lost rank. The old coordinator, alone on its side,
decides a generation for its own worker that it cannot write; when its cable is back, etcd
refuses that write (its leadership ended with its lease), so no worker ever sees it: it says
so in one line, stops its workers, and joins the job again as a new node, as a fenced
follower does; the job finishes on all three.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcdlab import EtcdLab, LabError
from etcdlab import unavailable as etcd_unavailable
from test_multinode import Node

from tests import netlab
from tests.conftest import FIXTURES, pid_alive, wait_for

pytestmark = pytest.mark.slow
# The deposed coordinator stops its workers (SIGTERM, then SIGKILL after this grace) and waits
# for the nodes it still counts (when the cut froze it before it dropped both, it waits for
# one that follows the new leader already: up to grace + 5 s twice, 70 s at the default 30 s)
SHUTDOWN = ("--shutdown-timeout", "5")


@pytest.fixture
def lab() -> Iterator[tuple[netlab.NetLab, EtcdLab]]:
    why = netlab.unavailable() or etcd_unavailable()
    if why is not None:
        pytest.skip(why)
    with netlab.NetLab(3, host_on_bridge=True) as net:
        etcd = EtcdLab(3, host=net.host_addr)
        try:
            etcd.start()
        except LabError as exc:
            pytest.skip(f"etcd on the lab's bridge: {exc}")
        try:
            yield net, etcd
        finally:
            etcd.close()


def leader_changed(node: Node) -> dict[str, Any] | None:
    doc = node.status()
    if doc and doc.get("control_plane", {}).get("leader_changes") == 1:
        return doc
    return None


@pytest.mark.timeout(300)
def test_a_cut_off_coordinator_is_replaced_and_its_late_write_refused(
        tmp_path: Path, lab: tuple[netlab.NetLab, EtcdLab]) -> None:
    net, etcd = lab
    end_file = tmp_path / "end_at"

    def start(i: int) -> Node:
        return Node(tmp_path, f"host{i}", [
            "--nnodes", "1:3", "--nproc", "1", "--spares", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "cut", *SHUTDOWN,
            "--rdzv-conf", "outage_timeout=120,last_call_timeout=60", "--local-addr", net.addr(i),
            str(FIXTURES / "ft_train.py"), "--steps", "100000", "--step-time", "0.04",
            "--end-file", str(end_file)],
            prefix=net.wrap(i, []), env={"GLOO_SOCKET_IFNAME": "eth0"})

    nodes = [start(0)]
    try:
        wait_for(nodes[0].status, 60, "the first agent elected and serving its status")
        nodes += [start(1), start(2)]
        old, b, c = nodes

        def stepping() -> dict[str, Any] | None:
            doc = old.status()
            members = [w for w in (doc or {}).get("workers", []) if w["role"] == "member"]
            return doc if len(members) == 3 and all((w["step"] or 0) >= 10
                                                    for w in members) else None
        doc = wait_for(stepping, 150, "3 members on 3 nodes stepping")
        assert isinstance(doc, dict) and doc["control_plane"]["leader"]["node"] == 0
        old_workers = [w["pid"] for w in doc["workers"] if w["node"] == 0]

        net.cut(0)
        led = wait_for(lambda: leader_changed(b) or leader_changed(c), 60,
                       "a new coordinator elected among the other two")
        assert isinstance(led, dict) and led["control_plane"]["leader"]["node"] in (1, 2)
        net.restore(0)  # the old coordinator reaches etcd again: its write is refused
        wait_for(lambda: "joined the rendezvous" in old.stderr.split("etcd refused it")[-1]
                 and "etcd refused it" in old.stderr, 90,
                 "the old coordinator refused, then joining the new leader's store")
        refused = [ln for ln in old.stderr.splitlines() if "etcd refused it" in ln]
        assert len(refused) == 1, old.stderr[-3000:]
        assert "lost the leadership before generation" in refused[0]
        assert "Traceback" not in old.stderr
        assert "lost the agent" not in old.stderr  # its workers were stopped, in order
        wait_for(lambda: not any(pid_alive(p) for p in old_workers), 30,
                 "the old coordinator's workers stopped")

        new = b if leader_changed(b) else c
        going = wait_for(lambda: (d := new.status()) and len(
            [w for w in d["workers"] if w["role"] == "member" and (w["step"] or 0) > 0]) >= 2
            and d, 120, "training going on under the new coordinator")
        assert isinstance(going, dict)
        record = json.loads(etcd_get(etcd, "/ftrun/cut/generation"))["generation"]
        assert not any(w in record["members"] for w in _ids_on_node(doc, 0)), record
        end_file.write_text(str(max(w["step"] or 0 for w in going["workers"]) + 20))
        for node in (b, c, old):
            assert node.wait(120) == 0, node.stderr[-3000:]
    finally:
        for node in nodes:
            node.kill()


def _ids_on_node(doc: dict[str, Any], node: int) -> list[int]:
    return [w["worker_id"] for w in doc["workers"] if w["node"] == node]


def etcd_get(etcd: EtcdLab, key: str) -> str:
    """One key's value, read with etcd's v3 JSON gateway (the test's own reader)."""
    import base64
    import urllib.request

    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(f"http://{etcd.endpoint(0)}/v3/kv/range", data=body,
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        kvs = json.loads(resp.read()).get("kvs", [])
    assert kvs, f"no {key} in etcd"
    return base64.b64decode(kvs[0]["value"]).decode()
