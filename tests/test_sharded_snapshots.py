"""Snapshots of sharded state (--shard-size): every shard of a node's first replica group
copies its local shards; the agent writes a complete set as one DCP checkpoint; a total loss
resumes from the newest complete set; a snapshot resumes on another shape through DCP.

The format tests run without processes; the training runs are real (4 gloo workers, FSDP2
inside groups of 2, a real agent) and compared bitwise: with a fault-free run of the same
shape, and, for another shape, by resuming at the snapshot's own step (nothing trained after
the load, so the state dumped whole must be the snapshot's bit for bit)."""
import json
import os
import re
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from ports import free_port
from torch.distributed.tensor import Shard

from ftrun.adapters import sharded_io, snapshot_io
from ftrun.adapters.snapshot_io import LocalShard
from ftrun.cli.launch_args import parse_run_args
from ftrun.core.spec import WorkerEnv
from ftrun.protocol import shard_sets
from ftrun.protocol import snapshots as snap
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, Generation
from ftrun.worker.aligning import STREAMS
from ftrun.worker.snapshots import Snapshots

SCRIPT = str(FIXTURES / "sharded_snap.py")


# ---------------------------------------------------------------- formats, no processes
def _publish(slots: Path, slot: int, step: int) -> None:
    data, record = snap.slot_paths(str(slots), slot)
    slots.mkdir(parents=True, exist_ok=True)
    writer = snapshot_io.Slot(data)
    try:
        rec = writer.write({"w": torch.ones(3) * step}, step, worker=0, generation=0)
    finally:
        writer.close()
    Path(record).write_text(rec.to_json())


def test_a_set_is_complete_only_with_every_shard_and_one_group_per_node_takes_it(
        tmp_path: Path) -> None:
    shm, spill = tmp_path / "shm", tmp_path / "spill"
    for shard in (0, 1):
        _publish(Path(shard_sets.shard_dir(str(shm), shard)), 0, 4)
    _publish(Path(shard_sets.shard_dir(str(shm), 0)), 1, 8)  # shard 1 died copying step 8
    _publish(Path(shard_sets.shard_dir(str(spill), 1)), 0, 12)  # shard 1's on disk: no pair
    sets = shard_sets.complete_sets((str(shm), str(spill)), 2)
    assert [s.step for s in sets] == [4] and len(sets[0].parts) == 2
    assert shard_sets.shard_count((str(shm),)) == 2
    node1 = WORKER_ID_STRIDE
    members = (0, 1, node1, node1 + 1, 2, 3)  # groups of 2: node 0's, node 1's, node 0's
    assert [shard_sets.snapshot_shard(members, w, 2) for w in (0, 1, 2, 3)] == [0, 1, None,
                                                                                None]
    assert shard_sets.snapshot_shard(members, node1 + 1, 2) == 1


def test_every_shard_of_a_group_takes_a_timed_snapshot_at_the_same_boundary(
        tmp_path: Path) -> None:
    """By time, shard 0's clock names the next boundary, which the group's generation check
    at that step's start carries to every shard (here: handed over as api.py does); the
    other shards never follow their own clocks (a set split between two steps is never
    complete)."""
    def shard(worker: int) -> Snapshots:
        env = SimpleNamespace(snapshot_shm=str(tmp_path), snapshot_spill="", resume_run="",
                              resume_step=-1, snapshot_every=0, snapshot_interval=10.0,
                              resume_dir="", resume=False, worker_id=worker, shard_size=2,
                              local_world_size=4)
        taker = Snapshots(cast(WorkerEnv, env))
        taker._last_at = 0.0
        return taker

    first, second = shard(0), shard(1)
    gen = Generation(number=0, members=(0, 1, 2, 3), reason="start")
    assert first._where(gen) == "shard0" and second._where(gen) == "shard1"
    assert shard(2)._where(gen) is None  # the node's second group leaves it to the first
    assert not second._due(5, 100.0, "shard1")  # its own clock says due: not its call
    assert second.proposed == -1
    assert not first._due(5, 100.0, "shard0")  # due: names the next boundary
    assert first.proposed == 6
    first.agreed_due = second.agreed_due = max(first.proposed, second.proposed)
    assert first._due(6, 100.5, "shard0") and second._due(6, 100.5, "shard1")


def test_shards_are_written_as_one_checkpoint_that_torch_loads_whole(tmp_path: Path) -> None:
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    shards = [{"model": {"w": LocalShard(full[a:b], (10, 3), (a, 0), (Shard(0),)),
                         "b": torch.ones(3)},
               STREAMS: {"torch": torch.full((4,), k, dtype=torch.uint8)}, "ftrun.step": 8}
              for k, (a, b) in enumerate([(0, 4), (4, 10)])]
    path = tmp_path / "s"
    path.mkdir()
    sharded_io.save_shard_set(shards, str(path), STREAMS)
    shapes = sharded_io.saved_shapes(str(path))
    assert tuple(shapes["model"]["w"].shape) == (10, 3) and shapes["ftrun.step"] == 8
    whole = snapshot_io.load_disk(str(path))  # the data-parallel reader: chunks put together
    assert torch.equal(whole["model"]["w"], full) and torch.equal(whole["model"]["b"],
                                                                   torch.ones(3))
    assert [int(s["torch"][0]) for s in whole[sharded_io.SHARDS].values()] == [0, 1]
    import torch.distributed.checkpoint as dcp

    mine = {"model": {"w": torch.zeros(10, 3), "b": torch.zeros(3)}}
    dcp.load(mine, checkpoint_id=str(path), no_dist=True)  # torch's own loader
    assert torch.equal(mine["model"]["w"], full)
    part = sharded_io.load_resharded(str(path), lambda p, shape, dtype, pl: torch.empty(
        shape, dtype=dtype))
    assert torch.equal(part["model"]["w"], full)


def test_snapshot_options_are_accepted_with_shard_size(tmp_path: Path) -> None:
    spec = parse_run_args(["--nproc", "4", "--shard-size", "2", "--snapshot-interval", "30",
                           "--snapshot-dir", str(tmp_path), "t.py"])
    assert spec.shard_size == 2 and spec.snapshots


# ---------------------------------------------------------------- training runs
def run(out: Path, *flags: str, nproc: int = 4, steps: int = 16,
        env: dict[str, str] | None = None,
        script_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    return run_ftrun("--nproc", str(nproc), *flags, SCRIPT, "--out", str(out), "--noise",
                     "--steps", str(steps), *script_args, timeout=240, env=env)


def states(out: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): torch.load(p) for p in out.glob("state_*.pt")}


def same(a: dict, b: dict) -> bool:
    """Parameters and optimizer state, gathered whole, bit for bit."""
    return all(a[part].keys() == b[part].keys() and
               all(torch.equal(a[part][k], b[part][k]) for k in a[part])
               for part in ("params", "optimizer"))


def resumed_steps(stderr: str) -> set[int]:
    return {int(s) for s in re.findall(r"resumed from step (\d+)", stderr)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run(out, "--shard-size", "2")
    assert r.returncode == 0, r.stderr
    found = states(out)
    assert sorted(found) == [0, 1, 2, 3] and all(same(found[0], s) for s in found.values())
    return found[0]


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_a_total_loss_of_every_group_resumes_from_the_newest_complete_set(
        reference: dict, tmp_path: Path) -> None:
    r = run(tmp_path / "o", "--shard-size", "2", "--snapshot-every", "4", "--snapshot-dir",
            str(tmp_path / "s"), script_args=("--die-all-at", "10"))
    assert r.returncode == 0, r.stderr
    assert "restarting all workers from the snapshot of step 8" in r.stderr
    assert len(re.findall(r"resumed from step 8 \(shared memory slots of 2 shards",
                          r.stderr)) == 4
    assert all(same(s, reference) for s in states(tmp_path / "o").values())
    firsts = [json.loads(p.read_text())["first"] for p in (tmp_path / "o").glob("first_*")]
    assert firsts == [8] * 4  # nothing before the snapshot redone
    written = snap.disk_snapshots(str(tmp_path / "s"))
    assert written[0][0] == 16 and snap.verify(written[0][1]) is None
    assert (snap.read_manifest(written[0][1]) or {}).get("shards") == 2
    # shard 1 of the snapshotting group dies halfway through its copy of step 8, then every
    # worker dies: step 8 has no complete set, the one of step 4 serves
    r = run(tmp_path / "k", "--shard-size", "2", "--snapshot-every", "4", "--snapshot-dir",
            str(tmp_path / "sk"), script_args=("--die-all-at", "8"),
            env={"FTRUN_DRILL_KILL_MID_SNAPSHOT": "1:8"})
    assert r.returncode == 0, r.stderr
    assert "restarting all workers from the snapshot of step 4" in r.stderr
    assert resumed_steps(r.stderr) == {4}
    assert all(same(s, reference) for s in states(tmp_path / "k").values())


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def two_nodes(tmp: Path, out: Path, *flags: str, steps: int, rdzv_id: str = "shards2x2",
              per_node: tuple[list[str], list[str]] = ([], []), script_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None, timeout: float = 240,
              check: bool = True) -> list[str]:
    """Two agents on loopback (c10d), 2 workers each; their stderr once both ended (both
    with 0, when `check`). `per_node`: flags for the coordinator (node 0) and for the other
    node, after `flags`."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for node, own in zip(("a", "b"), per_node, strict=True):
        cmd = ftrun_cmd("--nnodes", "2", "--nproc", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                        *flags, *own, SCRIPT, "--out", str(out), "--noise", "--steps",
                        str(steps), *script_args)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "FTRUN_RUN_DIR": str(tmp / f"run_{node}"), **(env or {})}
        procs.append(subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
        if node == "a":  # it binds the endpoint and coordinates: node 0
            wait_for(lambda: listening(port), 60, "the coordinator listening")
    try:
        ends = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    if check:
        assert [p.returncode for p in procs] == [0, 0], [e[1][-3000:] for e in ends]
    return [e[1] for e in ends]


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_a_snapshot_resumes_on_another_shape(tmp_path: Path) -> None:
    """2 groups of 2 -> 1 group of 4 -> 2 nodes of 2 groups of 2 -> 4 plain replicas (which
    snapshot) -> 2 groups of 2 again, each resumed at the snapshot's step; then a different
    model is refused."""
    first = tmp_path / "s22"
    r = run(tmp_path / "a", "--shard-size", "2", "--snapshot-every", "4", "--snapshot-dir",
            str(first), steps=12)
    assert r.returncode == 0, r.stderr
    want = states(tmp_path / "a")[0]
    stderr = two_nodes(tmp_path / "nodes", tmp_path / "n", "--shard-size", "2", "--resume",
                       str(first), steps=12)
    assert resumed_steps("".join(stderr)) == {12}
    found = states(tmp_path / "n")
    assert len(found) == 4 and all(same(s, want) for s in found.values())
    one_group = run(tmp_path / "b", "--shard-size", "4", "--resume", str(first), steps=12)
    assert one_group.returncode == 0, one_group.stderr
    assert resumed_steps(one_group.stderr) == {12}
    assert all(same(s, want) for s in states(tmp_path / "b").values())
    plain = run(tmp_path / "c", "--resume", str(first), "--snapshot-every", "4",
                "--snapshot-dir", str(tmp_path / "s41"), steps=14, script_args=("--plain",))
    assert plain.returncode == 0, plain.stderr
    assert resumed_steps(plain.stderr) == {12}
    want = states(tmp_path / "c")[0]
    assert all(same(s, want) for s in states(tmp_path / "c").values())
    back = run(tmp_path / "d", "--shard-size", "2", "--resume", str(tmp_path / "s41"),
               steps=14)
    assert back.returncode == 0, back.stderr
    assert resumed_steps(back.stderr) == {14}
    assert all(same(s, want) for s in states(tmp_path / "d").values())
    wider = run(tmp_path / "e", "--shard-size", "2", "--resume", str(first), steps=14,
                script_args=("--width", "48"))
    assert wider.returncode != 0
    lines = [ln for ln in wider.stderr.splitlines() if "cannot resume" in ln]
    assert lines and all(ln.endswith("model.0.norm.weight has shape (32,) in the snapshot, "
                                     "(48,) here)") for ln in lines), wider.stderr
    assert not os.path.exists(tmp_path / "e" / "state_0.pt")
