"""A coordinator paused past its etcd lease under `--rdzv-backend etcd`: real agents, a real
3-member etcd on loopback (healthy throughout).

The coordinating agent is SIGSTOPped (its workers run on): its lease lapses, a follower is
elected and carries the job on without node 0's rank. When the old coordinator runs again it
is deposed (never two leaders: etcd refuses whatever it would write), says what happened (it
did not run; etcd answers) rather than blaming etcd, stops its workers and joins the job again
as a new node with new workers, as a fenced follower does: the job is back at three nodes,
and every agent ends with the job. Meanwhile `ftrun status` answers on every follower.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from etcdlab import EtcdLab, ensure_all_up, etcd_cluster_fixture  # noqa: F401
from test_multinode import Node, end_soon

from tests.conftest import FIXTURES, pid_alive, wait_for


def job(lab: EtcdLab, end_file: Path) -> list[str]:
    # last call 60 s: the job starts once all three joined (at 1 s, a node that joined late
    # on a busy host entered the running job as a spare, never a third member)
    return ["--nnodes", "2:3", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-conf",
            "last_call_timeout=60", "--rdzv-endpoint", lab.endpoints, "--rdzv-id", "paused",
            "--local-addr",
            "127.0.0.1", "--shutdown-timeout", "5", str(FIXTURES / "ft_train.py"),
            "--steps", "100000", "--step-time", "0.04", "--end-file", str(end_file)]


def members_on(node: Node, agents: list[Node], step: int) -> dict[str, Any] | None:
    """The job at 3 members, one on each of `agents`, all past `step` (as `node` shows it)."""
    doc = node.status()
    if not doc or "nodes" not in doc:
        return None
    pids = {n["node"]: n["pid"] for n in doc["nodes"] if n["alive"]}
    members = [w for w in doc["workers"] if w["role"] == "member"]
    on = sorted(pids.get(w["node"], -1) for w in members)
    if on == sorted(a.proc.pid for a in agents) and all((w["step"] or 0) >= step
                                                        for w in members):
        return doc
    return None


def leading(nodes: list[Node]) -> Node | None:
    for node in nodes:
        doc = node.status()
        if doc and doc.get("control_plane", {}).get("leader_changes") == 1 and \
                doc["control_plane"]["leader"]["host"]:
            return node
    return None


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_coordinator_paused_past_its_lease_rejoins_as_a_follower(
        tmp_path: Path, etcd_cluster: EtcdLab) -> None:
    lab, end_file = etcd_cluster, tmp_path / "end_at"
    args = job(lab, end_file)
    started: list[Node] = []
    try:
        a = Node(tmp_path, "a", args)  # first in line: elected
        started.append(a)
        wait_for(lambda: a.status() is not None, 60, "the first agent serving its status")
        started += [Node(tmp_path, "b", args), Node(tmp_path, "c", args)]
        b, c = started[1], started[2]
        doc = wait_for(lambda: members_on(a, started, 10), 150, "3 members on 3 nodes")
        assert isinstance(doc, dict)
        old_workers = [w["pid"] for w in doc["workers"] if w["node"] == 0]

        os.kill(a.proc.pid, signal.SIGSTOP)  # the agent only: its worker runs on
        try:
            # a follower answers `ftrun status` while its coordinator's store does not
            assert b.status() is not None and c.status() is not None
            new = wait_for(lambda: leading([b, c]), 90, "a follower elected")
            assert isinstance(new, Node)
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        wait_for(lambda: not any(pid_alive(p) for p in old_workers), 60,
                 "the deposed coordinator's old workers stopped")
        back = wait_for(lambda: members_on(new, started, 0), 150,
                        "the job back at 3 nodes, the old coordinator's among them")
        assert a.proc.poll() is None, a.stderr[-3000:]
        top = max(w["step"] or 0 for w in back["workers"])  # type: ignore[index]
        going = wait_for(lambda: members_on(new, started, top + 5), 90, "all three stepping")
        end_soon(end_file, going)
        for node in started:
            assert node.wait(180) == 0, node.stderr[-3000:]
    finally:
        for node in started:
            node.kill()
        ensure_all_up(lab)

    said = a.stderr
    assert "cut off from the etcd majority" not in said, said[-3000:]
    assert "did not run for" in said and "etcd answers" in said, said[-3000:]
    assert "joined the rendezvous at" in said.split("did not run for", 1)[1], said[-3000:]
    assert "Traceback" not in said + b.stderr + c.stderr
