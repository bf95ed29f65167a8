"""Snapshots across nodes: a multi-node job whose store host dies resumes when relaunched.

Two real agents on loopback (c10d rendezvous, the coordinator serving the TCPStore), two gloo
workers each, every node snapshotting to a directory of its own (its "local disk"). The
coordinator's whole process group is SIGKILLed, as a host failure would take it: the follower
ends by itself. Both nodes are then started again with `--resume <their own directory>`: every
worker loads its node's newest snapshot (not step 0), the members align on the highest
committed step, and the job finishes with bitwise-equal parameters on every worker. In the
second run the nodes resume from different steps (node b's newest snapshot is left unfinished,
as a write cut off by the crash leaves it, unless the two disks differ already): the node
behind heals from the other.
"""
import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

import tests.test_multinode as multinode
from ftrun.protocol.status import Status
from tests.conftest import pid_alive, wait_for
from tests.replicas import bitwise_equal, params
from tests.test_multinode import (
    Node,
    free_port,
    ft_job,
    stepping,
    two_nodes,
    wait_listening,
)

nodes = multinode.nodes  # the fixture: agents started by the test, SIGKILLed at its end

EVERY = 5  # --snapshot-every
FIRST = 10  # the step the newest snapshot of each node must reach before the store host dies
MORE = 10  # steps the relaunched job trains past the newest snapshot
RESUMED = re.compile(r"ftrun: worker (\d+) resumed from step (\d+) \((.+), \d+ ms\)")


def complete_steps(snap_dir: Path) -> list[int]:
    """The steps of the complete disk snapshots under a --snapshot-dir (any node<k>/ below
    it): a step-<n> directory renamed into place, its manifest written."""
    found = snap_dir.glob("node*/step-*/ftrun.json")
    return sorted(int(p.parent.name.split("-")[1]) for p in found)


def visible(snap_dir: Path) -> list[Path]:
    """What a --snapshot-dir holds but the agent's disk slots (`.slots-*`, used when /dev/shm
    has no room, gone with the run)."""
    return [p for p in snap_dir.iterdir() if not p.name.startswith(".slots-")]


def newest_step(snap_dir: Path) -> int:
    return max(complete_steps(snap_dir), default=-1)


def resumed_lines(stderr: str) -> dict[int, tuple[int, str]]:
    """worker id -> (step, source) from the coordinator's `resumed from step` lines."""
    return {int(w): (int(s), src) for w, s, src in RESUMED.findall(stderr)}


def worker_logs(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}


def events(log_dir: Path) -> list[dict[str, Any]]:
    lines = next(log_dir.glob("*/events.jsonl")).read_text().splitlines()
    return [json.loads(line) for line in lines]


def unfinish_newest(snap_dir: Path, writer_pid: int) -> int:
    """Turn the newest complete snapshot back into what a write cut off before its rename
    leaves (a `.step-<n>.tmp-<writer pid>` directory); the step it was."""
    found = sorted(snap_dir.glob("node*/step-*/ftrun.json"))[-1].parent
    found.rename(found.with_name(f".{found.name}.tmp-{writer_pid}"))
    return int(found.name.split("-")[1])


def relaunch(tmp: Path, nodes, name: str, args: list[str]) -> Node:
    """The node started again on "the same machine": its run directory as the SIGKILL left
    it, its first stderr kept aside."""
    (tmp / f"{name}.err").rename(tmp / f"{name}.first.err")
    return nodes(name, args)


@pytest.fixture
def rdzv_id(tmp_path: Path):
    """A job id of the test's own; shared-memory slots named after it are removed afterwards
    should a failing test leave any."""
    ident = f"snapmn-{uuid.uuid4().hex[:8]}"
    yield ident
    for leftover in Path("/dev/shm").glob(f"ftrun-snap-{ident[:16]}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def shows_snapshots(node: Node) -> bool:
    """`ftrun status` (any node answers for the job) lists each node's last disk snapshot."""
    doc = node.status()
    return bool(doc) and len(doc["nodes"]) == 2 and all(
        (n.get("snapshot") or {}).get("step", -1) >= FIRST for n in doc["nodes"])


def first_run(nodes, port: int, rdzv_id: str, snaps: dict[str, Path],
              kept: int) -> tuple[dict[str, int], int]:
    """Two nodes train until each holds `kept` complete snapshots, the oldest at step >=
    FIRST; then the store host is SIGKILLed and the follower must end by itself. The newest
    snapshot step on each node's disk, and the follower agent's pid (gone now)."""
    common = ["--rdzv-id", rdzv_id, "--snapshot-every", str(EVERY)]
    a, b = two_nodes(nodes, port, ft_job(port, *common, "--snapshot-dir", str(snaps["a"])),
                     ft_job(port, *common, "--snapshot-dir", str(snaps["b"])))
    doc = wait_for(lambda: stepping(b, 4, 1), 120, "4 workers stepping (seen from node b)")
    pids = [w["pid"] for w in doc["workers"]]  # node b answers for the whole job
    wait_for(lambda: all(len(s := complete_steps(d)) >= kept and s[-kept] >= FIRST
                         for d in snaps.values()), 120,
             f"{kept} complete snapshot(s) from step {FIRST} on on both nodes")
    assert visible(snaps["a"]) == [snaps["a"] / "node0"]  # the coordinator's
    wait_for(lambda: shows_snapshots(b), 30, "ftrun status showing both nodes' snapshots")
    doc = b.status()  # written snapshots, node by node: as the records say
    assert doc is not None and Status.from_json(doc).to_json() == doc
    assert visible(snaps["b"]) == [snaps["b"] / "node1"]

    a.kill()  # the store host and its workers, as a host failure would take them
    assert b.wait(60) == 1, b.stderr  # 60 s: far above the 10 s a lost store takes to notice
    assert "lost the rendezvous store" in b.stderr and "Traceback" not in b.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), 15, "every first worker gone")
    wait_for(lambda: not list(Path("/dev/shm").glob(f"ftrun-snap-{rdzv_id[:16]}-*")), 15,
             "the SIGKILLed agent's shared-memory slots removed by its guardian, b's by b")
    on_disk = {n: newest_step(d) for n, d in snaps.items()}  # b's may be newer: flushed last
    return on_disk, b.proc.pid


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("one_behind", [False, True], ids=["as-left", "one-node-behind"])
def test_store_host_death_then_relaunch_resumes_every_node_from_its_snapshot(
        tmp_path: Path, nodes, rdzv_id: str, one_behind: bool) -> None:
    port, snaps = free_port(), {"a": tmp_path / "snap_a", "b": tmp_path / "snap_b"}
    on_disk, b_pid = first_run(nodes, port, rdzv_id, snaps, kept=2 if one_behind else 1)
    if one_behind and on_disk["a"] == on_disk["b"]:
        assert unfinish_newest(snaps["b"], b_pid) == on_disk["b"]
        on_disk["b"] = newest_step(snaps["b"])
    assert min(on_disk.values()) >= FIRST, on_disk
    assert (on_disk["a"] != on_disk["b"]) or not one_behind, on_disk
    top = max(on_disk.values())  # the members align on the highest committed step

    steps, out, logs_a = top + MORE, tmp_path / "out", tmp_path / "logs_a"
    out.mkdir()
    again = {n: ft_job(port, "--rdzv-id", rdzv_id, "--snapshot-every", str(EVERY), "--resume",
                       str(snaps[n]), *(["--log-dir", str(logs_a)] if n == "a" else []),
                       steps=steps, out=out) for n in snaps}
    a = relaunch(tmp_path, nodes, "a", again["a"])  # the same endpoint, run directory, disk
    wait_listening(port, 60)
    b = relaunch(tmp_path, nodes, "b", again["b"])
    assert a.wait(180) == 0, a.stderr
    assert b.wait(30) == 0, b.stderr
    assert "Traceback" not in a.stderr + b.stderr

    logs = worker_logs(out)
    assert sorted(logs) == [0, 1, 10_000, 10_001], sorted(logs)
    resumed = resumed_lines(a.stderr)  # the coordinator reports every node's workers
    assert sorted(resumed) == sorted(logs), a.stderr
    for wid, (step, source) in resumed.items():
        node = "a" if wid < 10_000 else "b"
        assert step == on_disk[node] >= FIRST, (wid, step, on_disk)  # its own newest, not 0
        assert source.startswith(str(snaps[node] / "node")), (wid, source)  # its node's disk
    evs = [e for e in events(logs_a) if e["event"] == "resumed"]
    assert {(e["worker"], e["step"]) for e in evs} == {(w, s) for w, (s, _) in resumed.items()}

    for wid, lg in logs.items():
        assert all(e["ok"] for e in lg["log"]), wid
        ran = [e["step"] for e in lg["log"]]
        assert ran[0] >= resumed[wid][0], (wid, ran[:3])  # no step before its snapshot redone
        assert ran == list(range(top, steps)), (wid, ran)  # behind: healed to top; then each once
    finals = params(out)
    assert all(bitwise_equal(finals[0], finals[w]) for w in finals), "replicas differ"
    assert newest_step(snaps["a"]) == newest_step(snaps["b"]) == steps  # the final snapshots
    assert not list(snaps["b"].glob("node*/.step-*")), "a gone writer's leftover kept"

    pids = [lg["pid"] for lg in logs.values()] + [int(p.read_text())
                                                  for p in out.glob("start_*.pid")]
    wait_for(lambda: not any(pid_alive(p) for p in pids), 15, "every relaunched worker gone")
