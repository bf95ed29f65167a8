"""Snapshots: what a total loss (no live replica) resumes from.

Unit tests of the slot and disk formats, the policy and the options run without processes;
the training runs are real (2 gloo workers, a real agent) and compared bitwise with one
fault-free run of the same script, whose inputs draw from torch's generator (--noise), so a
resume that lost the random streams would show."""
import importlib.util
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, run_ftrun, wait_for
from replicas import bitwise_equal, params

from ftrun.adapters import snapshot_io
from ftrun.agent.journal import Journal
from ftrun.agent.snapshots import SnapshotKeeper
from ftrun.cli.launch_args import parse_run_args
from ftrun.core.errors import UsageError
from ftrun.core.events import Event
from ftrun.core.policy import FaultAction, Snapshot, decide_fault
from ftrun.core.spec import RunSpec
from ftrun.protocol import snapshots as snap
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE

SCRIPT = str(FIXTURES / "ft_train.py")
STEPS = 24


# ---------------------------------------------------------------- formats, no processes
def _state() -> dict:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "ftrun.step": 7}


def _publish(shm: Path, slot: int, state: dict, step: int) -> snap.SlotRecord:
    data, record = snap.slot_paths(str(shm), slot)
    writer = snapshot_io.Slot(data)
    try:
        rec = writer.write(state, step, worker=0, generation=0)
        rec2 = writer.write(state, step, worker=0, generation=0)  # the kept mapping, reused
        assert rec2.total_bytes == rec.total_bytes
    finally:
        writer.close()
    Path(record).write_text(rec.to_json())
    return rec


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_slot_and_a_disk_snapshot_give_back_the_state_exactly(tmp_path: Path) -> None:
    state = _state()
    rec = _publish(tmp_path, 0, state, 7)
    back = snapshot_io.read_slot(snap.slot_paths(str(tmp_path), 0)[0], rec, owned=True)
    assert _same(back, state)  # integer keys, tuples and non-tensor values included
    disk = tmp_path / "d"
    disk.mkdir()
    snapshot_io.save_disk(back, str(disk))
    snap.write_manifest(str(disk), 7, rec.taken_at, {})
    assert snap.verify(str(disk)) is None
    assert _same(snapshot_io.load_disk(str(disk)), state)


def test_slots_alternate_and_an_unpublished_slot_is_never_read(tmp_path: Path) -> None:
    assert snap.newest_slot(str(tmp_path)) is None and snap.slot_to_fill(str(tmp_path)) == 0
    _publish(tmp_path, 0, _state(), 4)
    assert snap.slot_to_fill(str(tmp_path)) == 1
    _publish(tmp_path, 1, _state(), 8)
    assert snap.newest_slot(str(tmp_path))[0] == 1 and snap.slot_to_fill(str(tmp_path)) == 0
    os.unlink(snap.slot_paths(str(tmp_path), 1)[1])  # a writer died mid-copy: no record
    assert snap.newest_slot(str(tmp_path))[1].step == 4


def test_a_reserved_slot_is_sized_ahead_and_a_published_one_keeps_its_bytes(tmp_path: Path
                                                                             ) -> None:
    state = _state()
    size = snapshot_io.reserved_size(state)
    assert size % (1 << 20) == 0 and size > snapshot_io.Plan(state).total_bytes
    data, record = snap.slot_paths(str(tmp_path), 1)
    fresh = snapshot_io.Slot(data)
    try:
        fresh.reserve(size, record)  # an unpublished slot: sized and its pages written
        assert os.path.getsize(data) == size
        mapped = fresh._mapping(1)
        rec = fresh.write(state, 3, worker=0, generation=0)
        assert fresh._mapping(1) is mapped  # the copy went into the reserved mapping
    finally:
        fresh.close()
    assert rec.total_bytes < size  # the record, not the file's size, says what to read
    Path(record).write_text(rec.to_json())
    again = snapshot_io.Slot(data)
    try:
        again.reserve(size * 2, record)  # published: mapped as it is, never zeroed nor resized
    finally:
        again.close()
    assert os.path.getsize(data) == size
    assert _same(snapshot_io.read_slot(data, rec, owned=True), state)


def test_who_snapshots_and_when() -> None:
    node1 = WORKER_ID_STRIDE  # node 1's first worker id
    members = (3, node1 + 1, 0, node1)
    assert snap.snapshots_this_node(members, 3) and not snap.snapshots_this_node(members, 0)
    assert snap.snapshots_this_node(members, node1 + 1)
    assert [s for s in range(13) if snap.is_due(4, 0, s, 0, 0.0, 0.0)] == [4, 8, 12]
    assert not snap.is_due(4, 0, 8, 8, 0.0, 0.0)  # already taken at this step
    assert snap.is_due(0, 30.0, 3, 0, 100.0, 130.0) and not snap.is_due(0, 30.0, 3, 0, 100.0, 129.0)


def test_a_partial_or_corrupt_disk_snapshot_is_told_apart(tmp_path: Path) -> None:
    node = tmp_path / "node0"
    for step in (4, 8, 12):
        d = Path(snap.step_dir(str(node), step))
        d.mkdir(parents=True)
        (d / snap.SKELETON).write_bytes(b"skeleton")
        (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 10)
        snap.write_manifest(str(d), step, 0.0, {"run": "r"})
    dead = node / f".step-000000016.tmp-{2**22 + 7}"  # a write that never finished, by a pid
    dead.mkdir()  # that no process has: never listed, pruned
    assert [s for s, _ in snap.disk_snapshots(str(tmp_path))] == [12, 8, 4]
    newest = Path(snap.step_dir(str(node), 12)) / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[100] ^= 1
    newest.write_bytes(bytes(data))
    assert snap.verify(str(newest.parent)) == "__0_0.distcp fails its checksum"
    manifest = Path(snap.step_dir(str(node), 8)) / snap.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])  # cut short (issue #51)
    assert snap.verify(snap.step_dir(str(node), 8)) == \
        "its manifest is truncated or corrupt (40 bytes, not JSON)"
    os.unlink(manifest)
    assert snap.verify(snap.step_dir(str(node), 8)) == "no manifest (a partial write)"
    assert snap.prune(str(node), keep=1, run="r") == [snap.step_dir(str(node), 4), str(dead)]
    assert snap.root_of(snap.step_dir(str(node), 12)) == str(tmp_path)  # --resume of one


@pytest.mark.parametrize("writer", ["job7/0123abcd", "other/0123abcd"])
def test_a_launch_names_an_earlier_run_of_its_job_and_how_to_continue_it(tmp_path: Path,
                                                                        writer: str) -> None:
    """Issue #51: a job SIGKILLed and launched again with its --rdzv-id found its own
    snapshots called another run's; how to continue from them is said in full."""
    d = Path(snap.step_dir(str(tmp_path / "node0"), 6))
    d.mkdir(parents=True)
    (d / snap.SKELETON).write_bytes(b"skeleton")
    snap.write_manifest(str(d), 6, 0.0, {"run": writer})
    notices: list[str] = []
    spec = RunSpec(script="x.py", snapshot_every=4, snapshot_dir=str(tmp_path))
    keeper = SnapshotKeeper(spec, "job7", 0, lambda kind, f: notices.append(str(f["text"])))
    keeper.close()
    whose = "an earlier run of this job (--rdzv-id job7)" if writer.startswith("job7/") \
        else "another run"
    assert notices == [f"{tmp_path} holds snapshots of {whose} (the newest of step 6): this run "
                       "starts afresh and keeps them, never loading nor overwriting them; "
                       f"`ftrun --resume {tmp_path} ...` continues that run from them"]


def test_the_agent_writes_a_published_slot_to_disk_or_says_why_not(tmp_path: Path) -> None:
    events: list[tuple[Event, dict]] = []
    spec = RunSpec(script="x.py", snapshot_every=4, snapshot_dir=str(tmp_path / "snaps"))
    keeper = SnapshotKeeper(spec, "unit", 0, lambda kind, f: events.append((kind, dict(f))))
    try:
        _publish(Path(keeper.shm), 0, _state(), 4)
        wait_for(lambda: keeper.drain() or events, 60, "the snapshot written to disk")
        kind, fields = events[0]
        assert kind is Event.SNAPSHOT and fields["step"] == 4 and fields["bytes"] > 0
        assert snap.verify(fields["path"]) is None and keeper.resumable() == (4, 0)
        (tmp_path / "file").write_text("")
        keeper.bind_node(0)
        keeper.disk = str(tmp_path / "file" / "node0")  # not a directory: the write fails
        _publish(Path(keeper.shm), 1, _state(), 8)
        wait_for(lambda: keeper.drain() or len(events) > 1, 60, "the failed write reported")
        kind, fields = events[1]
        assert kind is Event.SNAPSHOT_FAILED and fields["step"] == 8 and fields["error"]
        described = keeper.describe(time.time())
        assert described is not None and described.failed == 1
    finally:
        keeper.close()
    assert not os.path.exists(keeper.shm or "/nonexistent")


# ---------------------------------------------------------------- decisions and options
def test_a_total_loss_restarts_from_the_newest_snapshot_unless_it_loops() -> None:
    base = Snapshot(members=(0, 1), unhealed=frozenset({1}), max_faults=10, faults=1)
    no_snap = decide_fault(base, 0, "exited with -9", 2)
    assert no_snap.action is FaultAction.FAIL and "no replica left" in no_snap.reason
    d = decide_fault(Snapshot(**{**base.__dict__, "snapshot_step": 8}), 0, "exited", 2)
    assert d.action is FaultAction.RESTART_GROUP
    assert d.reason.endswith("restarting all workers from the snapshot of step 8")
    looping = Snapshot(**{**base.__dict__, "snapshot_step": 8, "snapshot_resumes": 3})
    d = decide_fault(looping, 0, "exited", 2)
    assert d.action is FaultAction.FAIL and "last 3 restarts from the snapshot" in d.reason


def test_snapshot_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    spec = parse_run_args(["--snapshot-every", "50", "--snapshot-dir", str(tmp_path), "t.py"])
    assert spec.snapshots and spec.snapshot_keep == 2 and spec.snapshot_dir == str(tmp_path)
    bad = [(["--snapshot-every", "5", "--snapshot-interval", "30"], "cannot be used together"),
           (["--snapshot-every", "-1"], "must be >= 0"),
           (["--snapshot-keep", "0", "--snapshot-every", "5"], "must be >= 1"),
           (["--resume", str(tmp_path)], "holds no complete snapshot"),
           (["--resume", str(tmp_path / "nope")], "no such directory"),
           (["--snapshot-every", "5", "--on-fault", "restart"], "need in-process recovery")]
    for args, message in bad:
        with pytest.raises(UsageError, match=message):
            parse_run_args([*args, "t.py"])


def test_the_journal_counts_only_what_a_resumed_restart_recomputed() -> None:
    j = Journal(lambda kind, f: None)
    j.emit(Event.FAULT, {"worker": 0, "rank": 0, "why": "exit", "decision": "replace",
                         "reason": "r", "detected_at": time.time(), "committed_before": 10})
    j.emit(Event.FAULT, {"worker": 1, "rank": 1, "why": "exit", "decision": "restart-group",
                         "reason": "r", "detected_at": time.time(), "committed_before": 10})
    j.emit(Event.RESTART, {"reason": "r", "attempt": 1})
    j.emit(Event.STARTED, {"attempt": 1})
    j.emit(Event.RESUMED, {"worker": 0, "step": 8, "source": "shm", "taken_at": time.time() - 1,
                           "loaded_at": time.time(), "load_ms": 2.0})
    # one restart answered both faults: its 2 recomputed steps are counted once
    assert [(r.recovered, r.lost_steps, r.resumed_step) for r in j.faults] == [(True, 2, 8),
                                                                                (True, 0, 8)]
    assert all(r.phases_ms["resumed"] >= r.phases_ms["restarted"] for r in j.faults)


# ---------------------------------------------------------------- training runs
def run(out: Path, *flags: str, script_args: tuple[str, ...] = (), env=None, steps=STEPS):
    out.mkdir(exist_ok=True)
    return run_ftrun("--nproc", "2", *flags, SCRIPT, "--out", str(out), "--noise", "--steps",
                     str(steps), *script_args, timeout=150, env=env)


def events(log_dir: Path) -> list[dict]:
    lines = next(log_dir.glob("*/events.jsonl")).read_text().splitlines()
    return [json.loads(line) for line in lines]


def first_steps(out: Path) -> dict[int, int]:
    """Each final worker's first step (the fixture logs the steps its process ran)."""
    logs = [json.loads(p.read_text()) for p in out.glob("log_*.json")]
    return {lg["wid"]: lg["log"][0]["step"] for lg in logs}


def example_model() -> torch.nn.Module:
    """The fixture's model (examples/train_ddp.py, width 64, depth 2)."""
    path = FIXTURES.parent.parent / "examples" / "train_ddp.py"
    spec = importlib.util.spec_from_file_location("train_ddp_for_snapshots", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_model(64, 2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run(out)
    assert r.returncode == 0, r.stderr
    ps = params(out)
    assert sorted(ps) == [0, 1] and bitwise_equal(ps[0], ps[1])
    return ps[0]


@pytest.mark.slow
def test_every_worker_killed_resumes_from_the_newest_snapshot(reference, tmp_path) -> None:
    r = run(tmp_path / "o", "--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "s"),
            "--log-dir", str(tmp_path / "logs"), script_args=("--die-all-at", "10"))
    assert r.returncode == 0, r.stderr
    assert "no replica left to heal from: restarting all workers from the snapshot of step 8" \
        in r.stderr
    assert re.search(r"worker \d resumed from step 8 \(shared memory slot \d", r.stderr)
    assert "2 committed steps recomputed" in r.stderr
    ps = params(tmp_path / "o")
    assert bitwise_equal(ps[0], reference) and bitwise_equal(ps[1], reference)
    assert first_steps(tmp_path / "o") == {0: 8, 1: 8}  # nothing before the snapshot redone
    evs = events(tmp_path / "logs")
    written = [e for e in evs if e["event"] == "snapshot"]
    assert written and all(e["bytes"] > 0 and e["blocking_ms"] >= 0 and e["write_ms"] > 0
                           for e in written)
    assert {e["step"] for e in evs if e["event"] == "resumed"} == {8}


@pytest.mark.slow
def test_a_kill_during_a_snapshot_write_resumes_from_the_one_before(reference, tmp_path) -> None:
    r = run(tmp_path / "o", "--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "s"),
            script_args=("--die-all-at", "8"), env={"FTRUN_DRILL_KILL_MID_SNAPSHOT": "0:8"})
    assert r.returncode == 0, r.stderr
    assert "restarting all workers from the snapshot of step 4" in r.stderr
    assert re.search(r"worker \d resumed from step 4 ", r.stderr)
    ps = params(tmp_path / "o")
    assert bitwise_equal(ps[0], reference) and bitwise_equal(ps[1], reference)


@pytest.mark.timeout(330)  # two runs of ftrun: over the default 120 s on a busy host
@pytest.mark.slow
def test_a_relaunch_resumes_skipping_a_corrupt_snapshot_and_dcp_loads_one(reference,
                                                                           tmp_path) -> None:
    snaps = tmp_path / "s"
    # two on disk whatever the host's load: a run that ends at step 8 (its last snapshot is
    # always written), then one resumed from it that ends at 12 (under -n 2 the agent's writer
    # could start only after steps 4 and 8, and it writes only the newest slot)
    keep = ("--snapshot-every", "4", "--snapshot-keep", "3", "--snapshot-dir", str(snaps))
    first = run(tmp_path / "a", *keep, steps=8)
    assert first.returncode == 0, first.stderr
    first = run(tmp_path / "a", *keep, "--resume", str(snaps), steps=12)
    assert first.returncode == 0, first.stderr
    found = snap.disk_snapshots(str(snaps))
    assert found[0][0] == 12 and len(found) >= 2, found  # the final step is always kept
    import torch.distributed.checkpoint as dcp

    state = {"model": example_model().state_dict()}
    dcp.load(state, checkpoint_id=found[0][1], no_dist=True)  # torch's own loader
    assert bitwise_equal(state["model"], params(tmp_path / "a")[0])
    newest = Path(found[0][1]) / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    again = run(tmp_path / "b", "--resume", str(snaps))
    assert again.returncode == 0, again.stderr
    skipped = [line for line in again.stderr.splitlines() if "skipping snapshot" in line]
    assert skipped and all(line.endswith("__0_0.distcp fails its checksum") for line in skipped)
    resumed = {int(s) for s in re.findall(r"resumed from step (\d+)", again.stderr)}
    assert resumed == {found[1][0]}, again.stderr
    ps = params(tmp_path / "b")
    assert bitwise_equal(ps[0], reference) and bitwise_equal(ps[1], reference)
