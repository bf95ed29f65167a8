"""The etcd control plane with a real 3-member etcd on loopback: no single point of failure.

One long training run checks, in order: three agents elect a coordinator in etcd; etcd's own
raft leader is killed mid-run and training notices nothing (no fault, no new generation); then
the coordinator's agent and its workers are SIGKILLed together, as a host failure would: a
surviving agent is elected, adopts the running attempt (its workers and the other node's keep
their processes), a spare on another node takes the lost rank, the job finishes with every
step committed once per surviving worker and bitwise-equal replicas, and `ftrun status` shows
the new leader. Beside it, the refused write of a deposed leader is shown by
tests/test_etcd_adapter.py and the fenced generation by tests/test_recovery_core.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from etcdlab import EtcdLab, ensure_all_up, etcd_cluster_fixture  # noqa: F401
from test_multinode import LONG_LAST_CALL, Node, end_soon

from tests.conftest import FIXTURES, wait_for


def etcd_job(lab: EtcdLab, run_id: str, out: Path, end_file: Path) -> list[str]:
    return ["--nnodes", "2:3", "--nproc", "1", "--spares", "1", "--rdzv-backend", "etcd",
            *LONG_LAST_CALL,  # the three nodes start together
            "--rdzv-endpoint", lab.endpoints, "--rdzv-id", run_id, "--local-addr",
            "127.0.0.1", str(FIXTURES / "ft_train.py"), "--steps", "100000",
            "--step-time", "0.04", "--out", str(out), "--end-file", str(end_file)]


def members_stepping(node: Node, step: int) -> dict[str, Any] | None:
    doc = node.status()
    if not doc:
        return None
    members = [w for w in doc["workers"] if w["role"] == "member"]
    if len(members) == 3 and all((w["step"] or 0) >= step for w in members):
        return doc
    return None


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_coordinators_host_dies_and_a_survivor_carries_the_job_on(
        tmp_path: Path, etcd_cluster: EtcdLab) -> None:
    lab = etcd_cluster
    out = tmp_path / "out"
    out.mkdir()
    args = etcd_job(lab, "takeover", out, tmp_path / "end_at")
    started: list[Node] = []
    try:
        a = Node(tmp_path, "a", args)  # first in line: elected
        started.append(a)
        wait_for(lambda: a.status() is not None, 60, "the first agent serving its status")
        started += [Node(tmp_path, "b", args), Node(tmp_path, "c", args)]
        b, c = started[1], started[2]
        doc = wait_for(lambda: members_stepping(a, 15), 150, "3 members on 3 nodes stepping")
        assert isinstance(doc, dict)
        plane = doc["control_plane"]
        assert plane["backend"] == "etcd" and plane["leader"]["node"] == 0
        assert plane["leader_changes"] == 0 and plane["up"]
        assert sorted(plane["endpoints"]) == sorted(lab.endpoints.split(","))

        raft = lab.raft_leader()  # etcd's own leader: training needs no control traffic
        assert raft is not None
        lab.kill(raft)
        gen = doc["generation"]
        step = max(w["step"] or 0 for w in doc["workers"])
        after = wait_for(lambda: members_stepping(a, step + 25), 120,
                         "training going on without one etcd member")
        assert isinstance(after, dict)
        assert after["faults"] == [] and after["generation"] == gen
        lab.restart(raft)

        survivors = {w["worker_id"]: w["pid"] for w in after["workers"]
                     if w["node"] != 0 and w["role"] == "member"}
        assert len(survivors) == 2
        a.kill()  # the coordinator's agent and its workers, together
        led = wait_for(lambda: (d := b.status()) and d.get("control_plane", {}).get(
            "leader_changes") == 1 and d, 90, "a new leader in the status")
        assert isinstance(led, dict) and led["control_plane"]["leader"]["node"] in (1, 2)
        top = max(w["step"] or 0 for w in led["workers"])
        going = wait_for(lambda: members_stepping(b, top + 5), 90,
                         "3 members stepping under the new leader")
        end = end_soon(tmp_path / "end_at", going)
        for node in (b, c):
            assert node.wait(240) == 0, node.stderr
        took_over = [n for n in (b, c) if "coordinates the job now" in n.stderr]
        assert len(took_over) == 1, b.stderr + c.stderr
        assert "Traceback" not in b.stderr + c.stderr
        assert "Exception raised from" not in b.stderr + c.stderr  # no c10d C++ trace
        assert "came over with 2 live workers" in took_over[0].stderr
    finally:
        for node in started:
            node.kill()
        ensure_all_up(lab)

    logs = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}
    committed: set[int] = set()
    for wid, pid in survivors.items():  # same processes from start to end
        assert logs[wid]["pid"] == pid
        steps = [e["step"] for e in logs[wid]["log"] if e["ok"]]
        assert steps == sorted(set(steps)), f"worker {wid} committed a step twice"
        assert len(set(range(end)) - set(steps)) <= 1, f"worker {wid} skipped steps"
        committed |= set(steps)
    assert committed == set(range(end))
    import torch

    finals = [torch.load(out / f"params_{w}.pt") for w in logs]
    assert len(finals) == 3  # two survivors and the spare that took rank 0
    for other in finals[1:]:
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0])
