"""Snapshots across nodes: a multi-node job whose store host dies resumes when relaunched.

Two real agents on loopback (c10d rendezvous, the coordinator serving the TCPStore), two gloo
workers each, every node snapshotting to a directory of its own (its "local disk"). The
coordinator's whole process group is SIGKILLed, as a host failure would take it: the follower
ends by itself. Both nodes are then started again with `--resume <their own directory>`: every
worker loads its node's newest snapshot (not step 0), the members align on the highest
committed step, and the job finishes with bitwise-equal parameters on every worker.
"""
import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

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

EVERY = 5  # --snapshot-every
FIRST = 10  # the step the newest snapshot of each node must reach before the store host dies
MORE = 10  # steps the relaunched job trains past the newest snapshot
RESUMED = re.compile(r"ftrun: worker (\d+) resumed from step (\d+) \((.+), \d+ ms\)")


def complete_steps(snap_dir: Path) -> list[int]:
    """The steps of the complete disk snapshots under a --snapshot-dir (any node<k>/ below
    it): a step-<n> directory renamed into place, its manifest written."""
    found = snap_dir.glob("node*/step-*/ftrun.json")
    return sorted(int(p.parent.name.split("-")[1]) for p in found)


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


def relaunch(tmp: Path, nodes, name: str, args: list[str]) -> Node:
    """The node started again on "the same machine": its run directory as the SIGKILL left
    it, its first stderr kept aside."""
    (tmp / f"{name}.err").rename(tmp / f"{name}.first.err")
    return nodes(name, args)


@pytest.fixture
def rdzv_id(tmp_path: Path):
    """A job id of the test's own; the shared-memory slots the SIGKILLed agent could not
    remove (named after it) are removed afterwards."""
    ident = f"snapmn-{uuid.uuid4().hex[:8]}"
    yield ident
    for leftover in Path("/dev/shm").glob(f"ftrun-snap-{ident[:16]}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_store_host_death_then_relaunch_resumes_every_node_from_its_snapshot(
        tmp_path: Path, nodes, rdzv_id: str) -> None:
    port, snaps = free_port(), {"a": tmp_path / "snap_a", "b": tmp_path / "snap_b"}
    common = ["--rdzv-id", rdzv_id, "--snapshot-every", str(EVERY)]
    a, b = two_nodes(nodes, port, ft_job(port, *common, "--snapshot-dir", str(snaps["a"])),
                     ft_job(port, *common, "--snapshot-dir", str(snaps["b"])))
    doc = wait_for(lambda: stepping(b, 4, 1), 120, "4 workers stepping (seen from node b)")
    first_pids = [w["pid"] for w in doc["workers"]]
    wait_for(lambda: all(newest_step(d) >= FIRST for d in snaps.values()), 120,
             f"a complete snapshot of step >= {FIRST} on both nodes")
    assert list((snaps["a"]).glob("node*")) == [snaps["a"] / "node0"]  # the coordinator
    assert list((snaps["b"]).glob("node*")) == [snaps["b"] / "node1"]

    a.kill()  # the store host and its workers, as a host failure would take them
    assert b.wait(60) == 1, b.stderr
    assert "lost the rendezvous store" in b.stderr and "Traceback" not in b.stderr
    wait_for(lambda: not any(pid_alive(p) for p in first_pids), 15, "every first worker gone")

    on_disk = {n: newest_step(d) for n, d in snaps.items()}  # b may have flushed a newer one
    assert min(on_disk.values()) >= FIRST, on_disk
    steps, out, logs_a = max(on_disk.values()) + MORE, tmp_path / "out", tmp_path / "logs_a"
    out.mkdir()
    again = {"a": ft_job(port, "--rdzv-id", rdzv_id, "--snapshot-every", str(EVERY), "--resume",
                         str(snaps["a"]), "--log-dir", str(logs_a), steps=steps, out=out),
             "b": ft_job(port, "--rdzv-id", rdzv_id, "--snapshot-every", str(EVERY), "--resume",
                         str(snaps["b"]), steps=steps, out=out)}
    a2 = relaunch(tmp_path, nodes, "a", again["a"])
    wait_listening(port, 60)
    b2 = relaunch(tmp_path, nodes, "b", again["b"])
    assert a2.wait(180) == 0, a2.stderr
    assert b2.wait(30) == 0, b2.stderr
    assert "Traceback" not in a2.stderr + b2.stderr

    logs = worker_logs(out)
    assert sorted(logs) == [0, 1, 10_000, 10_001], sorted(logs)
    resumed = resumed_lines(a2.stderr)  # the coordinator reports every node's workers
    assert sorted(resumed) == sorted(logs), a2.stderr
    for wid, (step, source) in resumed.items():
        node = "a" if wid < 10_000 else "b"
        assert step == on_disk[node] >= FIRST, (wid, step, on_disk)  # its own newest, not 0
        assert source.startswith(str(snaps[node])), (wid, source)  # from its node's disk
    evs = [e for e in events(logs_a) if e["event"] == "resumed"]
    assert {(e["worker"], e["step"]) for e in evs} == {(w, s) for w, (s, _) in resumed.items()}

    top = max(on_disk.values())  # the members align on the highest committed step
    for wid, lg in logs.items():
        ran = [e["step"] for e in lg["log"] if e["ok"]]
        assert ran[0] >= resumed[wid][0], (wid, ran[:3])  # no step before its snapshot redone
        assert ran == list(range(top, steps)), (wid, ran)  # then every step, once
    finals = params(out)
    assert all(bitwise_equal(finals[0], finals[w]) for w in finals), "replicas differ"
    assert newest_step(snaps["a"]) == newest_step(snaps["b"]) == steps  # the final snapshot

    pids = [lg["pid"] for lg in logs.values()]
    pids += [int(p.read_text()) for p in out.glob("start_*.pid")]
    wait_for(lambda: not any(pid_alive(p) for p in pids), 15, "every relaunched worker gone")
