"""Planned leaves on many nodes (#48), end to end: three agents on loopback (one per "node",
one member and one spare each, examples/train_ddp.py), one of them sent SIGTERM (a notice,
--drain-window 30 s). Its member's rank goes to a spare on another node at a step boundary,
the job never stops (no fault, no urgent generation, the world size held), its agent exits
0, and the final replicas are bitwise equal to a fault-free run's. Under c10d the node is a
follower; under etcd (a real 3-member etcd, tests/etcdlab.py) it is the coordinator's own,
whose role moves to another agent: it steps down once its rank is served elsewhere, the next
agent in line adopts the running job and moves the members to its store (a planned
generation). The survivors' step gaps at the swap and at the takeover are printed (`-s`)."""
from __future__ import annotations

import json
import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from etcdlab import EtcdLab, etcd_cluster_fixture  # noqa: F401
from test_multinode import Node, free_port, wait_listening

from ftrun.core.exits import EXIT_REQUEUE
from tests.conftest import run_ftrun, wait_for

TRAIN = str(Path(__file__).parent.parent / "examples" / "train_ddp.py")
STEPS = 400
ARGS = ("--steps", str(STEPS), "--step-time", "0.03")
NOTICE_AT = 20  # every member past this step, every spare ready: the notice is sent


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref")
    r = run_ftrun("--nproc", "3", TRAIN, *ARGS, "--out", str(out), timeout=240)
    assert r.returncode == 0, r.stderr
    return torch.load(out / "params_0.pt")


def job(tmp: Path, name: str, rdzv: list[str]) -> list[str]:
    """One agent's command line: 2:3 nodes (a drained node leaves 2), all three in the first
    attempt (the last call waits for the third), one member and one spare per node."""
    return ["--nnodes", "2:3", "--nproc", "1", "--spares", "1", "--local-addr", "127.0.0.1",
            "--rdzv-conf", "last_call_timeout=60", "--log-dir", str(tmp / f"logs_{name}"),
            *rdzv, TRAIN, *ARGS, "--out", str(tmp / "out")]


def ready(node: Node) -> dict[str, Any] | None:
    """The whole job's status once 3 members step past NOTICE_AT and 3 spares wait."""
    doc = node.status()
    if not doc:
        return None
    rows = doc["workers"]
    members = [w for w in rows if w["role"] == "member"]
    if len(members) == 3 and sum(w["role"] == "spare" for w in rows) == 3 and all(
            (w["step"] or 0) >= NOTICE_AT for w in members):
        return doc
    return None


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for p in (tmp / f"logs_{name}").glob("*/events.jsonl")
            for line in p.read_text().splitlines()]


def logs(out: Path) -> dict[int, list[dict[str, Any]]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text())["log"]
            for p in out.glob("log_*.json")}


def check_run(tmp: Path, leaver: int, reference: dict[str, torch.Tensor]) -> dict[int, list]:
    """Every finisher committed each of its steps once, at world 3 throughout; the two first
    members every step from 0; the spare that took the leaver's rank came in mid-run; every
    final replica bitwise equal to the fault-free run's."""
    runs = logs(tmp / "out")
    assert leaver not in runs  # it left inside ft.steps(): no log of its own
    assert len(runs) == 3, sorted(runs)
    for wid, entries in runs.items():
        steps = [e["step"] for e in entries if e["committed"]]
        assert steps == list(range(steps[0], STEPS)), f"worker {wid}"
        assert all(e["world"] == 3 for e in entries)
    starts = sorted(next(e["step"] for e in log if e["committed"]) for log in runs.values())
    assert starts[:2] == [0, 0] and starts[2] > NOTICE_AT
    for wid in runs:
        params = torch.load(tmp / "out" / f"params_{wid}.pt")
        assert all(torch.equal(params[k], reference[k]) for k in reference), f"worker {wid}"
    return runs


def no_fault(tmp: Path, *names: str) -> list[dict[str, Any]]:
    seen = [e for name in names for e in events(tmp, name)]
    assert not [e for e in seen if e["event"] == "fault"]
    gens = [e for e in seen if e["event"] == "generation"]
    assert gens and not [g for g in gens if g["urgent"]], gens
    return gens


def stalls(runs: dict[int, list], first_members: list[int]) -> list[str]:
    """Each first member's step gap at every generation change, minus its median step gap."""
    out = []
    for wid in first_members:
        entries = [e for e in runs[wid] if e["committed"]]
        gaps = [b["t"] - a["t"] for a, b in zip(entries, entries[1:], strict=False)]
        median = statistics.median(gaps)
        for a, b in zip(entries, entries[1:], strict=False):
            if b["gen"] != a["gen"]:
                out.append(f"worker {wid} gen {a['gen']}->{b['gen']}: "
                           f"{(b['t'] - a['t'] - median) * 1000:+.0f} ms over its median "
                           f"{median * 1000:.0f} ms")
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_followers_notice_hands_its_rank_over_and_the_job_never_stops(
        tmp_path: Path, private_run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    port = free_port()
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "drain-c10d"]
    started: list[Node] = []
    try:
        started.append(Node(tmp_path, "a", job(tmp_path, "a", rdzv)))
        wait_listening(port, 60)
        started += [Node(tmp_path, n, job(tmp_path, n, rdzv)) for n in ("b", "c")]
        a, b, c = started
        doc = wait_for(lambda: ready(a), 180, "3 members stepping and 3 spares ready")
        assert isinstance(doc, dict)
        c_node = next(n["node"] for n in doc["nodes"] if n["pid"] == c.proc.pid)
        leaver = next(w["worker_id"] for w in doc["workers"]
                      if w["node"] == c_node and w["role"] == "member")
        os.kill(c.proc.pid, signal.SIGTERM)  # a notice: node c will be taken
        assert c.wait(120) == 0, c.stderr
        for node in (a, b):
            assert node.wait(240) == 0, node.stderr
    finally:
        for node in started:
            node.kill()
    assert "received SIGTERM: a notice" in c.stderr and "this node drained" in c.stderr
    assert f"node {c_node} (" in a.stderr and "drained; it leaves the job" in a.stderr
    assert "Traceback" not in a.stderr + b.stderr + c.stderr
    runs = check_run(tmp_path, leaver, reference)
    assert len(no_fault(tmp_path, "a")) == 1  # the swap's generation, planned
    print(*stalls(runs, [w for w in runs if runs[w][0]["step"] == 0]), sep="\n")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_etcd_coordinators_notice_moves_its_role_to_another_agent(
        tmp_path: Path, private_run_dir: Path, reference: dict[str, torch.Tensor],
        etcd_cluster: EtcdLab) -> None:
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_cluster.endpoints,
            "--rdzv-id", "drain-etcd"]
    started: list[Node] = []
    try:
        started.append(Node(tmp_path, "a", job(tmp_path, "a", rdzv)))  # first in line
        wait_for(lambda: started[0].status() is not None, 90, "the first agent leading")
        started += [Node(tmp_path, n, job(tmp_path, n, rdzv)) for n in ("b", "c")]
        a, b, c = started
        doc = wait_for(lambda: ready(a), 180, "3 members stepping and 3 spares ready")
        assert isinstance(doc, dict) and doc["control_plane"]["leader"]["node"] == 0
        os.kill(a.proc.pid, signal.SIGTERM)  # a notice to the coordinator's node
        assert a.wait(120) == 0, a.stderr
        for node in (b, c):
            assert node.wait(240) == 0, node.stderr
    finally:
        for node in started:
            node.kill()
    assert "lets go of the coordinator's role" in a.stderr
    took_over = [n for n in (b, c) if "coordinates the job now" in n.stderr]
    assert len(took_over) == 1, b.stderr + c.stderr
    assert "Traceback" not in a.stderr + b.stderr + c.stderr
    runs = check_run(tmp_path, 0, reference)
    gens = no_fault(tmp_path, "a", "b", "c")
    assert any("coordinates the job now" in g["reason"] for g in gens), gens
    print(*stalls(runs, [w for w in runs if runs[w][0]["step"] == 0]), sep="\n")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_c10d_coordinators_notice_requeues_the_whole_job(
        tmp_path: Path, private_run_dir: Path) -> None:
    """Its store goes with it: spares on the other nodes cannot keep the job. Every member
    snapshots and leaves at a step boundary, and every agent exits 75 (none says it failed)."""
    port = free_port()
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "drain-c10d-0", "--snapshot-every", "10"]
    started: list[Node] = []
    try:
        for name in ("a", "b", "c"):
            snaps = ["--snapshot-dir", str(tmp_path / f"snaps_{name}")]
            started.append(Node(tmp_path, name, job(tmp_path, name, [*rdzv, *snaps])))
            if name == "a":
                wait_listening(port, 60)
        a, b, c = started
        wait_for(lambda: ready(a), 180, "3 members stepping and 3 spares ready")
        os.kill(a.proc.pid, signal.SIGTERM)  # a notice to the node serving the store
        codes = [node.wait(120) for node in started]
    finally:
        for node in started:
            node.kill()
    assert codes == [EXIT_REQUEUE] * 3, a.stderr + b.stderr + c.stderr
    assert "the store goes with it" in a.stderr and "snapshot taken, requeue the job" in a.stderr
    for node in (b, c):
        assert "the coordinator ended the job" in node.stderr and "requeue" in node.stderr
    assert "Traceback" not in a.stderr + b.stderr + c.stderr
    assert not logs(tmp_path / "out")  # every member left inside ft.steps()
    assert not [e for e in events(tmp_path, "a") if e["event"] in ("fault", "failure")]
