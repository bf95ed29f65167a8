"""The control-plane simulation at a small size: a real coordinator, simulated followers that
speak the real protocol, every scenario of `scripts/sim/sim_scale.py` end to end.

One run checks several things at once: the job comes up; a worker's fault reaches every
watching worker through the node relays, gathered from every simulator process; a node lost
after a broken connection and one lost silently are both dropped and named; the job then ends
with exit 0. The etcd case runs the same on a real 3-member etcd: the coordinator elected
there, the simulated nodes finding its store as followers do, and etcd's own request counters
read. No figure is judged here: the script prints them, and its closing note reports them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from etcdlab import unavailable

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sim" / "sim_scale.py"


def run_sim(tmp_path: Path, ranks: int, *extra: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--ranks", str(ranks), "--steady-s", "1",
                           "--timeout-s", "100", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    [row] = json.loads(out.read_text())
    return row, done.stdout


def check_every_scenario(row: dict[str, Any], ranks: int, node_size: int, procs: int) -> None:
    assert row["errors"] == [] and row["exit_code"] == 0
    assert (row["ranks"], row["nodes"], row["watchers"], row["relays"]) == (
        ranks, ranks // node_size, ranks, True)
    assert row["sim_procs"] == procs
    for key in ("up_s", "coord_cpu_pct", "coord_ops_s", "sim_ops_s", "fault_publish_ms",
                "fault_all_ms", "loss_publish_ms", "loss_all_ms", "quiet_loss_publish_ms"):
        assert isinstance(row[key], (int, float)), key
    # the figures are in order: published first, then held by every watching worker
    for case in ("fault", "loss", "quiet_loss"):
        assert 0 <= row[f"{case}_publish_ms"] <= row[f"{case}_p50_ms"] <= row[f"{case}_all_ms"]
    assert "takes rank" in row["fault_reason"]  # a new worker replaced the one that failed
    assert f"lost with {node_size} members" in row["loss_reason"]
    assert f"lost with {node_size} members" in row["quiet_loss_reason"]


@pytest.mark.slow  # 27 s on this 2-core host: two simulator processes each import torch
def test_sim_scale_runs_every_scenario_end_to_end(tmp_path: Path) -> None:
    row, stdout = run_sim(tmp_path, 32, "--sim-procs", "2")
    check_every_scenario(row, 32, 8, 2)
    assert row["backend"] == "c10d" and "etcd_req_s" not in row
    assert "goals at 32 ranks" in stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sim_scale_on_a_real_etcd(tmp_path: Path) -> None:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    row, stdout = run_sim(tmp_path, 16, "--node-size", "4", "--watchers", "4",
                          "--rdzv-backend", "etcd", "--sim-procs", "2")
    check_every_scenario(row, 16, 4, 2)
    assert row["backend"] == "etcd"
    # the followers' lease keep-alives alone are requests etcd counts every second
    assert row["etcd_req_s"] > 0
    assert "backend etcd" in stdout


@pytest.mark.slow  # four simulator processes and a coordinator, each importing torch
@pytest.mark.timeout(150)
def test_the_per_fault_sweep_runs_through_the_tree_end_to_end(tmp_path: Path) -> None:
    """`--per-fault` at 12 nodes, the tree from 4 (the coordinator's FTRUN_RELAY_TREE_FROM):
    every fault's generation reaches every simulated node (each process's arrivals come back,
    the forwarders' two processes last), the burst is published, the job ends with 0."""
    import os

    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--per-fault", "--nodes", "12",
                           "--faults", "2", "--sim-procs", "2", "--timeout-s", "110",
                           "--json", str(out)], capture_output=True, text=True, timeout=145,
                          env={**os.environ, "FTRUN_RELAY_TREE_FROM": "4"})
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    [row] = json.loads(out.read_text())
    assert row["errors"] == [] and row["exit_code"] == 0, row
    assert row["sim_procs"] == 4  # the forwarders (nodes 1, 5, 9) in two of their own
    for sample in row["samples"]:
        assert 0 < sample["publish_ms"] <= sample["median_ms"] <= sample["last_ms"]
        assert len(sample["by_process_ms"]) == 4
        assert all(0 < first <= median <= last <= sample["last_ms"] + 0.1  # rounded
                   for first, median, last in sample["by_process_ms"])
    assert row["generations_for_burst"] >= 1 and row["max_beat_gap_s"] > 0

@pytest.mark.slow  # one relay process importing torch
@pytest.mark.parametrize("tree", [[], ["--tree", "--tree-from", "2"]], ids=["direct", "tree"])
def test_the_fanout_floor_reaches_every_relay_and_prints_its_row(tree: list[str]) -> None:
    """Every relay holds each generation (else the script exits non-zero), pushed to
    directly or, `--tree`, through its forwarder's inbox connection (the forwarders in a
    simulator process of their own, `simscale/placement.py`)."""
    script = SCRIPT.parent / "fanout_floor.py"
    done = subprocess.run([sys.executable, str(script), "--nodes", "6", "--repeat", "2",
                           "--sim-procs", "1", *tree], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    procs = "2" if tree else "1"  # the tree's forwarders play in a process of their own
    [row] = [line.split() for line in done.stdout.splitlines()
             if line.split()[:2] == ["6", procs]]
    assert row[2] == ("yes" if tree else "no")
    last_p50, last_max, first_p50 = float(row[3]), float(row[5]), float(row[6])
    assert 0 < first_p50 <= last_p50 <= last_max  # measured from the push, per relay


def test_the_forwarders_play_apart_as_the_coordinators_plan_picks_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`simscale/placement.py` follows the real `relay_plan`: in a job of 4,096 nodes (4,095
    followers) the lowest of each group of 64 forwards, in processes of their own, the rest
    dealt evenly; below the tree's size, no forwarder and no extra process."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from simscale.placement import forwarders_of, shares

    followers = range(1, 4096)
    apart = forwarders_of(followers, tree_from=64)
    assert apart == set(range(1, 4096, 64))
    parts = shares(followers, 2, apart)
    assert parts[-1] == sorted(apart) and len(parts) == 3
    assert sorted(n for part in parts for n in part) == list(followers)
    assert abs(len(parts[0]) - len(parts[1])) <= 1
    assert forwarders_of(range(1, 64), tree_from=64) == set()
    assert shares(range(1, 64), 2, set()) == [list(range(1, 64, 2)), list(range(2, 64, 2))]
    two = shares(followers, 2, apart, apart_procs=2)  # the forwarders dealt round two
    assert two[:2] == parts[:2] and two[2:] == [sorted(apart)[0::2], sorted(apart)[1::2]]
    assert shares(range(1, 64), 2, set(), apart_procs=2) == shares(range(1, 64), 2, set())


def test_the_simulated_heartbeats_are_spread_over_the_period(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`simscale/beats.py` beats each node once a period, as `link.Heartbeat` does, its
    payload when due; a thread's nodes spread over the period, not all at once (a burst of
    512 held up the faults that came behind it), on a real store."""
    import threading
    import time

    from ftrun.adapters.store import LOOPBACK, HostedStore
    from ftrun.cluster.link import Endpoint, heartbeat_key, payload_key

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from simscale.beats import BEAT_SLICES, Beaters

    class Node:
        def __init__(self, index: int) -> None:
            self.index, self.ended, self.built = index, False, 0

        def payload(self, now: float, started: float) -> str:
            self.built += 1
            return f"node {self.index} at {now - started:.3f}"

    hosted = HostedStore(0, LOOPBACK)
    store = hosted.serve()
    nodes, lock, lost = [Node(i) for i in range(1, 2 * BEAT_SLICES + 1)], threading.Lock(), []
    period = 0.4
    beaters = Beaters(Endpoint(LOOPBACK, hosted.port), period, 0.0, time.time(),
                      lambda: nodes, lock, lost.append)
    beats: dict[int, list[float]] = {n.index: [] for n in nodes}
    try:
        beaters.cover(len(nodes))
        deadline = time.monotonic() + 10 * period
        while time.monotonic() < deadline and min(map(len, beats.values())) < 3:
            for node in nodes:  # when each counter moved, seen every ~5 ms
                count = int(store.add(heartbeat_key(node.index), 0))
                if count > len(beats[node.index]):
                    beats[node.index].append(time.monotonic())
            time.sleep(0.005)
        assert store.get(payload_key(1)).startswith(b"node 1 at ")
    finally:
        beaters.close()
        hosted.close()
    assert lost == [] and all(len(times) >= 3 for times in beats.values())
    assert all(n.built >= 3 for n in nodes)  # payload_s 0: one with every beat
    second = sorted(times[1] for times in beats.values())  # each node's second beat
    assert second[-1] - second[0] > period / 2  # over the period, not in one burst
    gaps = [b - a for times in beats.values() for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < 5 * period  # every node beat again within a few periods
    assert period * 0.8 < beaters.max_gap < 5 * period


def test_the_beats_played_apart_beat_what_the_fleet_told_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`simscale/beats_apart.py`: a fleet's beats from a process of their own, on a real store:
    each node told it beats, its payload naming the workers and the newest generation the
    fleet's process told it; a node ended beats no more; closed, the process is gone."""
    import time

    from ftrun.adapters.store import LOOPBACK, HostedStore
    from ftrun.cluster.link import Endpoint, heartbeat_key, payload_key

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from simscale.beats_apart import BeatsApart

    def counts() -> list[int]:
        return [int(store.add(heartbeat_key(index), 0)) for index in (5, 9)]

    def wait_for(check: Any, what: str) -> None:
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    hosted = HostedStore(0, LOOPBACK)
    store = hosted.serve()
    period = 0.2
    apart = BeatsApart(Endpoint(LOOPBACK, hosted.port), period, 0.0, time.time())
    try:
        for position, index in enumerate((5, 9)):
            apart.node(position, index)
            apart.workers(position, [100 + position, 200 + position])
        apart.holds(0, 3)
        apart.holds(0, 2)  # an older one arriving late: the newest stays 3
        wait_for(lambda: min(counts()) >= 2, "both nodes beat twice")
        wait_for(lambda: b'"generation": 3' in store.get(payload_key(5)), "generation 3 beaten")
        payload = json.loads(store.get(payload_key(5)))
        assert [row["worker_id"] for row in payload["workers"]] == [100, 200]
        assert {live["generation"] for live in payload["liveness"]} == {3}
        assert {live["generation"] for live in json.loads(store.get(payload_key(9)))[
            "liveness"]} == {0}
        apart.workers(1, [201])  # worker 101 exited
        wait_for(lambda: [row["worker_id"] for row in json.loads(
            store.get(payload_key(9)))["workers"]] == [201], "node 9's payload without 101")
        apart.ended(1)
        time.sleep(2 * period)  # a beat under way when it was told ends
        ended_at = counts()[1]
        time.sleep(4 * period)
        after = counts()
        assert after[1] == ended_at and after[0] > 2  # node 9 silent, node 5 beating
        assert 0 < apart.max_gap < 5 * period
        assert apart.errors() == []
    finally:
        apart.close()
        hosted.close()
    assert apart._proc.poll() is not None
