"""A succession under `--rdzv-backend etcd` with another client's writes under the job's
prefix: real agents, a real 3-member etcd on loopback.

Three agents train; then any etcd client writes garbage and a forged generation where the
job's records live (`store` = [1,2], `generation` = {"number": 99, "members": [0]}, a key
`nodes/abc`), and the coordinator's agent and workers are SIGKILLed. Nothing of that is
obeyed: the successor takes over the generation its own node's workers hold (relayed from the
lost leader's store), each value is passed over with one notice, no survivor ends with an
internal error, and the job finishes at full size. The successor's summary counts the fault
from the same origin as its phase line (one fault, one figure).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from etcdlab import EtcdLab, ensure_all_up, etcd_cluster_fixture  # noqa: F401
from test_etcd_takeover import etcd_job, members_stepping
from test_multinode import Node, end_soon

from ftrun.adapters.etcd import connect
from tests.conftest import wait_for

FORGED = '{"number": 99, "members": [0], "reason": "forged", "urgent": true}'


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_garbage_and_a_forged_generation_in_etcd_are_not_obeyed_at_the_succession(
        tmp_path: Path, etcd_cluster: EtcdLab) -> None:
    lab, out, end_file = etcd_cluster, tmp_path / "out", tmp_path / "end_at"
    out.mkdir()
    args = etcd_job(lab, "forged", out, end_file)
    started: list[Node] = []
    try:
        a = Node(tmp_path, "a", args)  # first in line: elected
        started.append(a)
        wait_for(lambda: a.status() is not None, 60, "the first agent serving its status")
        started += [Node(tmp_path, "b", args), Node(tmp_path, "c", args)]
        b, c = started[1], started[2]
        doc = wait_for(lambda: members_stepping(a, 10), 150, "3 members on 3 nodes stepping")
        assert isinstance(doc, dict) and doc["generation"] != 99
        client = connect(lab.endpoints)
        try:
            client.put("/ftrun/forged/store", "[1,2]")
            client.put("/ftrun/forged/nodes/abc", "somewhere")
            client.put("/ftrun/forged/generation", FORGED)
        finally:
            client.close()
        a.kill()  # the coordinator's agent and its workers, together
        led = wait_for(lambda: (d := b.status()) and d.get("control_plane", {}).get(
            "leader_changes") == 1 and d, 90, "a new leader in the status")
        top = max(w["step"] or 0 for w in led["workers"])  # type: ignore[index]
        going = wait_for(lambda: members_stepping(b, top + 5), 90,
                         "3 members stepping under the new leader")
        end_soon(end_file, going)
        for node in (b, c):
            assert node.wait(240) == 0, node.stderr[-3000:]
    finally:
        for node in started:
            node.kill()
        ensure_all_up(lab)

    both = b.stderr + c.stderr
    assert "internal error" not in both and "Traceback" not in both
    successor = next(n for n in (b, c) if "coordinates the job now" in n.stderr).stderr
    took = re.findall(r"took over generation (\d+) ", successor)
    assert took and took[0] != "99", successor[-3000:]
    assert successor.count("ignored /ftrun/forged/generation in etcd: malformed") == 1
    assert successor.count("ignored /ftrun/forged/nodes/abc in etcd: not a node's key") == 1
    assert "ignored /ftrun/forged/store in etcd: malformed" in both
    # one fault, one origin: the summary's figure is the phase line's first commit
    committed = re.findall(r"committed step \d+ \(ms after the fault: .*committed \+(\d+)\)",
                           successor)
    p50 = re.findall(r"recovery p50 (\d+) ms", successor)
    assert committed and p50 and abs(int(committed[0]) - int(p50[-1])) <= 1, successor[-3000:]
