"""Replica groups that span nodes, end to end: four agents on loopback ("nodes", one gloo
worker each, c10d), `--shard-size 2`, so each replica group is two nodes; a fifth node joins
the full job and waits. One run checks at once: a node SIGKILLed takes its group out, the
other group goes on in the same processes without waiting, the lost group's rank on the
surviving node is stopped and started again, the waiting node enters for the lost rank, the
fresh group heals and the job is back at two full groups; every step is committed once per
worker, the groups end bitwise equal, and nothing is left behind. The decisions case by case
are in test_replica_groups_nodes.py."""
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.conftest import FIXTURES, pid_alive, wait_for
from tests.test_multinode import Node, free_port, nodes, wait_listening  # noqa: F401

END_MARGIN_STEPS = 20  # ~1 s of steps between the end's setting and any worker reaching it


def job(port: int, end_file: Path, out: Path) -> list[str]:
    return ["--nnodes", "2:4", "--nproc", "1", "--shard-size", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "span", "--rdzv-conf",
            "last_call_timeout=120", str(FIXTURES / "hsdp_nodes.py"), "--end-file",
            str(end_file), "--out", str(out)]


def members(node: Node, size: int, step: int) -> dict[str, Any] | None:
    """`node`'s status when `size` members are past `step` (asked every 0.5 s at most: each
    ask reads the job's status documents and their heartbeats, in this process)."""
    time.sleep(0.5)
    doc = node.status()
    if not doc or doc["world_size"] != size:
        return None
    ms = [w for w in doc["workers"] if w["role"] == "member"]
    return doc if len(ms) == size and all((w["step"] or 0) >= step for w in ms) else None


def doc_when(cond: Callable[[], dict[str, Any] | None | bool], timeout: float,
             what: str) -> dict[str, Any]:
    return cast(dict[str, Any], wait_for(cond, timeout, what))


def seen(out: Path) -> dict[int, list[dict[str, Any]]]:
    return {int(p.stem.split("_")[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in out.glob("seen_*.jsonl")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_node_takes_its_group_out_and_the_groups_return_to_full_size(
        tmp_path: Path, nodes: Callable[..., Node]) -> None:  # noqa: F811
    port, end_file, out = free_port(), tmp_path / "end_at", tmp_path / "out"
    out.mkdir()
    args = job(port, end_file, out)
    a = nodes("a", ["--log-dir", str(tmp_path / "logs_a"), *args],
              env={"FTRUN_RELAY_TREE_FROM": "2"})  # generations through a node's relay
    wait_listening(port, 60)
    followers = [nodes(name, args) for name in ("b", "c", "d")]
    first = doc_when(lambda: members(a, 4, 3), 240, "4 nodes of 1 worker stepping")
    agents = {n["node"]: n["pid"] for n in first["nodes"] if n["alive"]}
    by_rank = {w["rank"]: w for w in first["workers"]}
    assert len({by_rank[r]["node"] for r in range(4)}) == 4  # a rank per node
    spare = nodes("e", args)  # the job is full: it waits for a lost node
    wait_for(lambda: "waits: the job is full (4 of --nnodes max 4 nodes)" in a.stderr, 240,
             "the fifth node told to wait")

    # the node of rank 3 is lost: group 1 (ranks 2, 3) is out, rank 2's worker stopped
    victim = next(f for f in followers if f.proc.pid == agents[by_rank[3]["node"]])
    partner = next(f for f in followers if f.proc.pid == agents[by_rank[2]["node"]])
    live = {by_rank[r]["worker_id"]: by_rank[r]["pid"] for r in (0, 1)}
    victim.kill()
    wait_for(lambda: not pid_alive(by_rank[3]["pid"]), 15, "the lost node's worker gone")
    wait_for(lambda: not pid_alive(by_rank[2]["pid"]), 60, "its partner's worker stopped")
    back = doc_when(lambda: (d := members(a, 4, 0)) and d["generation"] >= 2 and d,
                    240, "two full groups again")
    fresh = {w["worker_id"]: w for w in back["workers"] if w["worker_id"] not in live}
    waited = next(n["node"] for n in back["nodes"] if n["pid"] == spare.proc.pid)
    assert {w["node"] for w in fresh.values()} == {by_rank[2]["node"], waited}
    assert all(w["rank"] in (2, 3) for w in fresh.values())
    doc_when(lambda: members(a, 4, max(w["step"] or 0 for w in back["workers"]) + 3), 120,
             "the fresh group committing")
    # the end is set from the steps committed now, not from the status (seconds old on a
    # loaded host): a worker already past it would end alone and leave its peers in a sync
    end_file.write_text(str(max(e["step"] for lines in seen(out).values() for e in lines)
                            + END_MARGIN_STEPS))

    for agent in (a, *(f for f in followers if f is not victim), spare):
        assert agent.wait(180) == 0, agent.stderr[-3000:]
    everything = a.stderr + partner.stderr + spare.stderr
    assert "replica group 1 out (1 rank on other nodes stopped), continuing with 1 group " \
           "of 2" in a.stderr, a.stderr[-3000:]
    assert "replica groups back in service" in a.stderr
    assert "Traceback" not in everything, everything[-3000:]
    events = [json.loads(line) for line in
              next((tmp_path / "logs_a").glob("*/events.jsonl")).read_text().splitlines()]
    assert max(e["forwarded"] for e in events if e["event"] == "generation") >= 1

    logs = seen(out)
    end = int(end_file.read_text())
    for wid, pid in live.items():  # the live group: same processes, never waited for
        steps = [e["step"] for e in logs[wid]]
        assert {e["pid"] for e in logs[wid]} == {pid}
        assert steps == sorted(set(steps)), f"worker {wid} committed a step twice"
        assert len(set(range(end)) - set(steps)) <= 1, f"worker {wid} skipped steps"
        worlds = [e["world"] for e in logs[wid]]
        assert worlds[0] == 4 and 2 in worlds and worlds[-1] == 4
    for wid in fresh:
        assert logs[wid][0]["step"] > 0 and logs[wid][-1]["step"] == end - 1
    finals = {w: torch.load(out / f"params_{w}.pt") for w in (*live, *fresh)}
    ref = finals[0]
    assert ref and all(torch.equal(ref[k], p[k]) for p in finals.values() for k in ref)
    assert not (out / f"params_{by_rank[2]['worker_id']}.pt").exists()  # stopped, no end
    workers = [w["pid"] for w in (*first["workers"], *back["workers"])]
    wait_for(lambda: not any(pid_alive(p) for p in workers), 30, "every worker ended")
