"""The etcd majority lost under a running job, with a real 3-member etcd on loopback.

One run: two agents train; two of the three etcd members are SIGKILLed. The workers keep
training (the steady state needs no control traffic), `ftrun status` says the control plane is
down, and a worker killed during the outage is a fault that waits for the majority: once the
two members are back, the coordinator writes the next generation in etcd, publishes it, and
the job finishes with every step committed. A second run: the majority stays away past
`--rdzv-conf outage_timeout=`: every agent stops its workers with one line and the job fails.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from etcdlab import EtcdLab, ensure_all_up, etcd_cluster_fixture  # noqa: F401
from test_multinode import Node

from tests.conftest import FIXTURES, pid_alive, wait_for


def outage_job(lab: EtcdLab, run_id: str, end_file: Path, outage_s: int) -> list[str]:
    return ["--nnodes", "2", "--nproc", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", lab.endpoints, "--rdzv-id", run_id,
            "--rdzv-conf", f"outage_timeout={outage_s}", "--local-addr", "127.0.0.1",
            str(FIXTURES / "ft_train.py"), "--steps", "100000", "--step-time", "0.03",
            "--end-file", str(end_file)]


def stepping(node: Node, members: int, step: int) -> dict[str, Any] | None:
    doc = node.status()
    if not doc:
        return None
    live = [w for w in doc["workers"] if w["role"] == "member"]
    if len(live) == members and all((w["step"] or 0) >= step for w in live):
        return doc
    return None


def top_step(doc: dict[str, Any]) -> int:
    return max(w["step"] or 0 for w in doc["workers"])


def start_pair(tmp: Path, args: list[str]) -> tuple[Node, Node]:
    a = Node(tmp, "a", args)  # first in line: elected
    wait_for(lambda: a.status() is not None, 60, "the first agent serving its status")
    return a, Node(tmp, "b", args)


def kill_majority(lab: EtcdLab) -> list[int]:
    gone = [i for i in range(lab.count) if i != lab.raft_leader()][:2]
    for i in gone:
        lab.kill(i)
    return gone


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_goes_on_without_the_etcd_majority_and_a_fault_waits_for_it(
        tmp_path: Path, etcd_cluster: EtcdLab) -> None:
    lab, end_file = etcd_cluster, tmp_path / "end_at"
    a, b = start_pair(tmp_path, outage_job(lab, "outage", end_file, 60))
    try:
        doc = wait_for(lambda: stepping(a, 4, 10), 150, "4 members on 2 nodes stepping")
        assert isinstance(doc, dict) and doc["control_plane"]["up"]
        gone = kill_majority(lab)
        down = wait_for(lambda: (d := a.status()) and not d["control_plane"]["up"] and d, 30,
                        "the status saying the control plane is down")
        assert isinstance(down, dict)
        during = wait_for(lambda: stepping(a, 4, top_step(down) + 20), 60,
                          "training going on without the etcd majority")
        assert isinstance(during, dict) and during["faults"] == []
        victim = next(w for w in during["workers"] if w["node"] == 1 and w["role"] == "member")
        os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(3)  # the fault is seen; its generation cannot be written yet
        held = a.status()
        assert held is not None and not held["control_plane"]["up"], held
        fault, = held["faults"]
        assert fault["worker"] == victim["worker_id"] and fault["generation"] is None
        assert not fault["recovered"]  # no worker was told of a generation etcd did not take
        for i in gone:
            lab.restart(i)
        after = wait_for(lambda: (d := a.status()) and d["faults"][0]["recovered"]
                         and d["control_plane"]["up"] and d, 60,
                         "the fault recovered once the majority is back")
        assert isinstance(after, dict) and len(after["faults"]) == 1
        back = wait_for(lambda: stepping(a, 4, top_step(after) + 10), 120,
                        "training at full size again")
        assert isinstance(back, dict)
        end_file.write_text(str(top_step(back) + 20))
        assert a.wait(120) == 0, a.stderr
        assert b.wait(60) == 0, b.stderr
        assert "Traceback" not in a.stderr + b.stderr
    finally:
        a.kill()
        b.kill()
        ensure_all_up(lab)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agents_stop_their_workers_when_the_majority_stays_away(
        tmp_path: Path, etcd_cluster: EtcdLab) -> None:
    lab, end_file = etcd_cluster, tmp_path / "end_at"
    a, b = start_pair(tmp_path, outage_job(lab, "lost-majority", end_file, 6))
    try:
        doc = wait_for(lambda: stepping(a, 4, 10), 150, "4 members on 2 nodes stepping")
        assert isinstance(doc, dict)
        pids = [w["pid"] for w in doc["workers"]]
        kill_majority(lab)
        for node in (a, b):
            assert node.wait(90) != 0
        for node in (a, b):
            lines = [ln for ln in node.stderr.splitlines() if "etcd" in ln and "6 s" in ln]
            assert lines, node.stderr[-2000:]
            assert "Traceback" not in node.stderr
        for pid in pids:
            assert not pid_alive(pid), f"worker {pid} outlived its agent"
    finally:
        a.kill()
        b.kill()
        ensure_all_up(lab)

