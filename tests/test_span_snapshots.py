"""Snapshots of replica groups that span nodes (`--shard-size` a multiple of `--nproc`): each
node's ranks of its group copy their shards, each node's agent writes the part it holds, and
the group's ranks agree on a step every one of them can load.

The format tests run without processes. The training runs are real: two agents on loopback
("nodes", c10d) of 2 gloo workers each, `--shard-size 4` (one group, shards 0-1 on node 0,
2-3 on node 1), FSDP2 inside it, compared bitwise with a fault-free run of the same shape: a
total loss resumes from shared memory; a rank killed halfway through its copy leaves its
node's part of that step incomplete and the whole group resumes from the step before (the
other node, which holds the newer part, must not use it); `--resume` of node-local disks,
one of which lacks the newer part; `--resume` of a directory holding every node's part on
another shape (one node, a group of 2; plain replicas); a node-local part alone on another
shape is refused with one line."""
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_ftrun
from test_sharded_snapshots import SCRIPT, _publish, resumed_steps, same, states
from test_sharded_snapshots import two_nodes as sharded_two_nodes
from torch.distributed.tensor import Shard

from ftrun.adapters import sharded_io
from ftrun.adapters.snapshot_io import LocalShard
from ftrun.agent.snapshots import SnapshotKeeper
from ftrun.cli.launch_args import parse_run_args
from ftrun.core.spec import RunSpec
from ftrun.protocol import shard_sets
from ftrun.protocol import snapshots as snap
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE
from ftrun.worker import sharded_snapshot
from ftrun.worker.aligning import STREAMS

RESUMED = re.compile(r"ftrun: worker (\d+) resumed from step (\d+) \((.+), \d+ ms\)")
MULTI = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
N1 = WORKER_ID_STRIDE  # node 1's first worker id


# ---------------------------------------------------------------- formats, no processes
def test_the_cli_takes_snapshots_by_steps_and_by_time_and_resume_for_spanning_groups() -> None:
    span = ["--nproc", "2", "--nnodes", "2", *MULTI, "--shard-size", "4"]
    assert parse_run_args([*span, "--snapshot-every", "5", "t.py"]).snapshot_every == 5
    assert parse_run_args([*span, "--snapshot-interval", "30", "t.py"]).snapshot_interval == 30


def test_after_a_restart_every_first_worker_of_a_spanning_group_enters_the_agreement(
        tmp_path: Path) -> None:
    """A node holding no part still sends its ranks into the group's step agreement (its
    peers would wait for them the collective timeout); a --resume run's DIR stays what a
    node without a snapshot of its own resumes from (else it would start from step 0)."""
    def keeper(**extra: object) -> SnapshotKeeper:
        spec = RunSpec(script="x.py", nproc=2, shard_size=4, nnodes_min=2, nnodes_max=2,
                       snapshot_every=4, snapshot_dir=str(tmp_path / "s"), **extra)
        return SnapshotKeeper(spec, "unit", 0, lambda kind, f: None)

    plain, resumed = keeper(), keeper(resume=str(tmp_path / "old"))
    try:
        assert not plain.worker_fields(0, attempt=0).get("resume")  # a fresh start
        told = plain.worker_fields(0, attempt=1)  # nothing held on this node
        assert (told.get("resume"), told.get("resume_run"), told.get("resume_step", -1)) == \
            (True, plain.run, -1)
        told = resumed.worker_fields(1, attempt=1)
        assert (told.get("resume"), told.get("resume_dir"), told.get("resume_run", "")) == \
            (True, str(tmp_path / "old"), "")
        assert not plain.worker_fields(2, attempt=1).get("resume")  # a replacement heals
    finally:
        plain.close()
        resumed.close()


def test_a_node_holds_a_part_of_its_spanning_group_and_its_parts_are_complete_per_step(
        tmp_path: Path) -> None:
    members = (0, 1, N1, N1 + 1)  # one group of 4 over nodes 0 and 1
    assert [shard_sets.snapshot_shard(members, w, 4, spans=True) for w in members] == \
        [0, 1, 2, 3]
    assert shard_sets.snapshot_shard(members, 0, 4) is None  # the inside-one-node rule
    shm = tmp_path / "shm"
    for shard, step in ((2, 8), (3, 8), (2, 12)):  # shard 3 died copying step 12
        _publish(Path(shard_sets.shard_dir(str(shm), shard)), 0 if step == 8 else 1, step)
    parts = shard_sets.complete_sets((str(shm),), 4, per_node=2)
    assert [(p.step, p.first, p.of, len(p.parts)) for p in parts] == [(8, 2, 4, 2)]
    assert parts[0].holds(3) and not parts[0].holds(1) and parts[0].shards == 4
    assert shard_sets.complete_sets((str(shm),), 4) == []  # no whole set on this node


def _write_part(base: Path, node: int, step: int, first: int, full: torch.Tensor,
                run: str = "job/abc") -> Path:
    """Node `node`'s part (shards `first`, `first`+1 of 4) of `full`, as its agent writes it."""
    cuts = [(0, 3), (3, 6), (6, 8), (8, 10)]
    shards = [{"model": {"w": LocalShard(full[a:b], (10, 4), (a, 0), (Shard(0),))},
               STREAMS: {"torch": torch.full((4,), k, dtype=torch.uint8)}, "ftrun.step": step}
              for k, (a, b) in enumerate(cuts)][first:first + 2]
    path = Path(snap.step_dir(snap.node_dir(str(base), node), step))
    path.mkdir(parents=True, mode=0o700)
    sharded_io.save_shard_set(shards, str(path), STREAMS, first)
    snap.write_manifest(str(path), step, 0.0, {"run": run, "shards": 2, "first": first,
                                               "of": 4})
    return path


def test_parts_of_a_set_read_together_when_every_shard_is_beside_them(tmp_path: Path) -> None:
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    mine = _write_part(tmp_path / "shared", 1, 8, 2, full)
    assert sharded_snapshot.part_of(str(mine)) == (2, 2, 4, "job/abc")
    alone = sharded_snapshot.disk_parts(str(mine), {})  # no mesh: every shard is needed
    assert isinstance(alone, str) and "shard 0 is not beside it" in alone
    other = _write_part(tmp_path / "shared", 0, 8, 0, full, run="job/def")  # another agent
    _write_part(tmp_path / "shared", 0, 4, 0, full)  # another step: never mixed in
    both = sharded_snapshot.disk_parts(str(mine), {})
    assert both == [str(other), str(mine)]
    state = sharded_io.load_parts(both, lambda p, shape, dtype, pl: torch.zeros(shape,
                                                                                 dtype=dtype))
    assert torch.equal(state["model"]["w"], full)  # each part filled its own rows
    assert sorted(state[sharded_io.SHARDS]) == ["0", "1", "2", "3"]
    half = sharded_io.load_parts([str(mine)], lambda p, shape, dtype, pl: torch.zeros(
        shape, dtype=dtype))
    assert not half["model"]["w"][:6].any()  # why a part alone is never read on its own
    _write_part(tmp_path / "elsewhere", 0, 8, 0, full, run="other-job/x")
    assert isinstance(sharded_snapshot.disk_parts(str(_write_part(
        tmp_path / "elsewhere", 1, 8, 2, full)), {}), str)  # another job's part: no pair


def test_a_part_keeps_its_shards_streams_for_the_same_group_size() -> None:
    state = {sharded_io.SHARDS: {"2": "two", "3": "three"}, sharded_snapshot.SHARDS_OF: 4,
             STREAMS: "first"}
    sharded_snapshot.own_streams(state, {}, STREAMS)  # no mesh here: shard 0's, if held
    assert state == {STREAMS: "first"}
    state = {sharded_io.SHARDS: {"0": "zero", "1": "one"}, STREAMS: "x"}
    sharded_snapshot.own_streams(state, {}, STREAMS)
    assert state == {STREAMS: "zero"}


# ---------------------------------------------------------------- training runs
def two_nodes(tmp: Path, out: Path, flags: tuple[list[str], list[str]], steps: int = 16,
              script_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              check: bool = True) -> list[str]:
    """Two agents on loopback (c10d), 2 workers each, one replica group of 4 over both
    (node-specific flags: `flags[0]` for the coordinator, node 0); their stderr."""
    return sharded_two_nodes(tmp, out, "--shard-size", "4", steps=steps, rdzv_id="span4",
                             per_node=flags, script_args=script_args, env=env, timeout=300,
                             check=check)


def both(flags: list[str]) -> tuple[list[str], list[str]]:
    return flags, flags


def parts(snap_dir: Path) -> dict[tuple[int, int], dict]:
    """(node, step) -> manifest of every finished part under a --snapshot-dir."""
    found = {}
    for man in snap_dir.glob("node*/step-*/ftrun.json"):
        doc = snap.read_manifest(str(man.parent)) or {}
        found[(int(man.parent.parent.name[4:]), int(doc["step"]))] = doc
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A fault-free run of the shape under test, snapshotting every 4 steps into one
    directory (a shared filesystem): its final state, and the directory."""
    tmp = tmp_path_factory.mktemp("span_ref")
    two_nodes(tmp, tmp / "out", both(["--snapshot-every", "4", "--snapshot-keep", "5",
                                      "--snapshot-dir", str(tmp / "snaps")]))
    found = states(tmp / "out")
    assert sorted(found) == [0, 1, N1, N1 + 1]
    assert all(same(found[0], s) for s in found.values())
    written = parts(tmp / "snaps")
    assert {(n, d["first"], d["of"], d["shards"]) for (n, s), d in written.items()
            if s == 16} == {(0, 0, 4, 2), (1, 2, 4, 2)}
    assert all(snap.verify(str(p.parent)) is None for p in (tmp / "snaps").glob(
        "node*/step-*/ftrun.json"))
    return found[0], tmp / "snaps"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_total_loss_of_a_spanning_group_resumes_from_a_step_every_node_holds(
        reference: tuple[dict, Path], tmp_path: Path) -> None:
    want, _ = reference
    flags = both(["--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "s")])
    stderr = "".join(two_nodes(tmp_path, tmp_path / "o", flags, script_args=("--die-all-at",
                                                                              "10")))
    assert "restarting all workers from the snapshot of step 8" in stderr, stderr[-3000:]
    resumed = {int(w): (int(s), where) for w, s, where in RESUMED.findall(stderr)}
    assert sorted(resumed) == [0, 1, N1, N1 + 1], stderr[-3000:]
    assert all(s == 8 and where.startswith("shared memory") for s, where in resumed.values())
    assert all(same(s, want) for s in states(tmp_path / "o").values())
    # worker 1 (shard 1, node 0) dies halfway through its copy of step 8, then every worker
    # dies: node 0's part of step 8 is incomplete, node 1's is not; the group takes step 4
    stderr = "".join(two_nodes(tmp_path / "k", tmp_path / "ko", both(
        ["--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "sk")]),
        script_args=("--die-all-at", "8"), env={"FTRUN_DRILL_KILL_MID_SNAPSHOT": "1:8"}))
    assert resumed_steps(stderr) == {4}, stderr[-3000:]
    assert all(same(s, want) for s in states(tmp_path / "ko").values())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_snapshots_by_time_are_taken_at_one_boundary_by_every_node_of_the_group(
        reference: tuple[dict, Path], tmp_path: Path) -> None:
    """Shard 0's clock (node 0) names the boundary; node 1's shards hear it in the group's
    generation check. Without that, node 1 would hold no part (or parts of other steps) and
    the total loss at step 12 could not resume."""
    want, _ = reference
    flags = both(["--snapshot-interval", "0.3", "--snapshot-keep", "10", "--snapshot-dir",
                  str(tmp_path / "s")])
    stderr = "".join(two_nodes(tmp_path, tmp_path / "o", flags, script_args=(
        "--die-all-at", "12", "--step-sleep", "0.1")))
    steps = resumed_steps(stderr)
    # a snapshot of step 12 is the state before step 12 runs: the clock may name that
    # boundary, and the loss inside step 12 then resumes from it
    assert len(steps) == 1 and 0 < min(steps) <= 12, stderr[-3000:]
    by_node: dict[int, set[int]] = {0: set(), 1: set()}
    for node, step in parts(tmp_path / "s"):
        by_node[node].add(step)
    # steps both nodes wrote: some before the loss (the writer may skip one the slots still
    # hold, so not necessarily the one resumed from) and the final one
    assert len(by_node[0] & by_node[1]) >= 2 and 16 in by_node[1], by_node
    assert all(same(s, want) for s in states(tmp_path / "o").values())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restart_starts_over_when_no_node_holds_a_part_and_ends_when_one_lacks_it(
        reference: tuple[dict, Path], tmp_path: Path) -> None:
    """Every rank of the group enters the agreement after a restart, one whose node holds
    nothing included: none held anywhere (a loss before the first snapshot) is step 0 for
    all. A node started with another --snapshot-every (which would leave it without its
    part) is refused at its join, with one line, and the job that lacks it ends naming it."""
    want, _ = reference
    stderr = "".join(two_nodes(tmp_path / "z", tmp_path / "zo", both(
        ["--snapshot-every", "8", "--snapshot-dir", str(tmp_path / "zs"), "--max-restarts",
         "1"]),
        script_args=("--die-all-at", "4")))
    assert "restarting all workers" in stderr and not RESUMED.findall(stderr), stderr[-3000:]
    assert all(same(s, want) for s in states(tmp_path / "zo").values())
    # node 1 started to snapshot too seldom to hold a part of step 8: since the join checks
    # the shared flags it is refused at once, and the job that lacks it says why
    ends = two_nodes(tmp_path / "m", tmp_path / "mo", (
        ["--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "ms"), "--rdzv-conf",
         "join_timeout=5"],
        ["--snapshot-every", "100", "--snapshot-dir", str(tmp_path / "ms")]),
        script_args=("--die-all-at", "10"), check=False)
    said = "".join(ends)
    assert "only 1 of 2 nodes joined" in said and "was refused: this node was started with " \
        "--snapshot-every 100 (the coordinator's: 4)" in said, said[-3000:]
    assert "Traceback" not in said and not states(tmp_path / "mo")
    # node 1's first worker dies halfway through its copy of step 4, the first snapshot, 2 s
    # after it got there: node 0 holds its part of step 4 (it copied it meanwhile; without
    # the pause a loaded host could restart node 0's workers before they had, and with no
    # part anywhere the job rightly started over), node 1 lacks one. A restart (one allowed:
    # whether node 0's part is on disk when the fault is decided, which makes it a restart
    # from that snapshot, is a race) has every rank agree, and the agreement ends the job
    ends = two_nodes(tmp_path / "p", tmp_path / "po", both(
        ["--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "ps"), "--max-restarts",
         "1"]),
        script_args=("--die-all-at", "6"), env={"FTRUN_DRILL_KILL_MID_SNAPSHOT": f"{N1}:4:2"},
        check=False)
    said = "".join(ends)
    assert "no step that every rank of its replica group holds" in said, said[-3000:]
    assert "Traceback" not in said and not states(tmp_path / "po")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_from_node_local_parts_and_from_every_part_on_another_shape(
        reference: tuple[dict, Path], tmp_path: Path) -> None:
    want, snaps = reference
    # node-local disks: node 0's holds its parts of steps 8 and 12, node 1's only of step 8
    local = (tmp_path / "disk_a", tmp_path / "disk_b")
    for node, steps in ((0, (8, 12)), (1, (8,))):
        for step in steps:
            src = Path(snap.step_dir(snap.node_dir(str(snaps), node), step))
            shutil.copytree(src, local[node] / f"node{node}" / src.name)
    stderr = two_nodes(tmp_path / "n", tmp_path / "no", (["--resume", str(local[0])],
                                                          ["--resume", str(local[1])]))
    assert resumed_steps("".join(stderr)) == {8}, stderr[0][-3000:]
    found = states(tmp_path / "no")
    assert len(found) == 4 and all(same(s, want) for s in found.values())
    # every part beside the others: one node, one group of 2 / plain replicas, at step 16
    for name, args, extra in (("g2", ["--shard-size", "2"], ()), ("dp", [], ("--plain",))):
        (tmp_path / name).mkdir()
        r = run_ftrun("--nproc", "2", *args, "--resume", str(snaps), SCRIPT, "--out",
                      str(tmp_path / name), "--noise", "--steps", "16", *extra, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert resumed_steps(r.stderr) == {16}
        assert all(same(s, want) for s in states(tmp_path / name).values())
    # a node-local part alone on another shape: one line, nothing trained
    (tmp_path / "alone").mkdir()
    r = run_ftrun("--nproc", "2", "--shard-size", "2", "--resume", str(local[1]), SCRIPT,
                  "--out", str(tmp_path / "alone"), "--steps", "16", timeout=240)
    assert r.returncode != 0
    assert "shard 0 is not beside it" in r.stderr, r.stderr[-3000:]
    assert not states(tmp_path / "alone")
