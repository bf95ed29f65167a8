"""Snapshots' safety rules (issue #38): a snapshot is never loaded into the wrong run, never
destroyed by a run that did not write it, never unpickled unless this user wrote it, and
neither a small /dev/shm nor a full disk stops a run or its writer.

Real agents and gloo workers (tests/fixtures/ft_train.py); the root-only cases (a small
tmpfs mounted in a mount namespace of their own, a second uid through setpriv) are skipped
where that is not possible."""
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd

from ftrun.adapters import snapshot_io
from ftrun.agent.snapshots import SnapshotKeeper, default_dir
from ftrun.core.spec import RunSpec, WorkerEnv
from ftrun.protocol import snapshots as snap
from ftrun.worker.snapshots import STEP, Snapshots

SCRIPT = str(FIXTURES / "ft_train.py")
PLANTER = 1234  # the other user's uid


def run(out: Path, *flags: str, steps: int = 16, script_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None, inside: list[str] | None = None,
        timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """ftrun with 2 workers of the fixture; `inside`: a command prefix (a mount namespace)."""
    out.mkdir(exist_ok=True)
    argv = [*(inside or []), *ftrun_cmd("--nproc", "2", *flags, SCRIPT, "--out", str(out),
                                        "--steps", str(steps), *script_args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def first_steps(out: Path) -> dict[int, int]:
    logs = [json.loads(p.read_text()) for p in out.glob("log_*.json")]
    return {lg["wid"]: lg["log"][0]["step"] for lg in logs}


def tree(path: Path) -> list[tuple[str, int, int, int]]:
    """Every file and directory under `path`: name, size, mtime, mode."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns,
                   p.stat().st_mode) for p in path.rglob("*"))


def _can_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m ftrun-probe /mnt"], capture_output=True)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(not _can_mount(), reason="needs root and mount namespaces")


def namespace(*mounts: str) -> list[str]:
    """A command prefix: a mount namespace of its own with `mounts` (a tmpfs each, as
    `OPTIONS:TARGET`) mounted, gone with the process."""
    script = " && ".join(f"mount -t tmpfs -o {m.split(':', 1)[0]} ftrun-test {m.split(':', 1)[1]}"
                         for m in mounts)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{script} && exec "$@"',
            "sh"]


# ---------------------------------------------------------------- 1: runs never cross
@pytest.mark.timeout(330)  # two runs of ftrun (one in the /dev/shm case) on a busy host
@pytest.mark.slow
def test_two_runs_sharing_an_id_and_a_directory_never_load_or_destroy_each_other(tmp_path
                                                                                   ) -> None:
    env = {"TMPDIR": str(tmp_path)}
    flags = ("--rdzv-id", "jobJ", "--snapshot-every", "4")
    a = run(tmp_path / "a", *flags, env=env)
    assert a.returncode == 0, a.stderr
    node = Path(default_dir("jobJ").replace(tempfile.gettempdir(), str(tmp_path), 1)) / "node0"
    kept = {p.name: (p / snap.MANIFEST).read_text() for p in node.glob("step-*")}
    # the writer copies the newest slot at each poll, so on a busy host step 12 may be passed
    # over for 16; the newest is always flushed at the end, and no more than --snapshot-keep
    assert "step-000000016" in kept and set(kept) <= {"step-000000012", "step-000000016"}, kept

    b = run(tmp_path / "b", *flags, env=env, script_args=("--die-all-at", "10"))
    assert b.returncode == 0, b.stderr
    assert "restarting all workers from the snapshot of step 8" in b.stderr
    assert set(re.findall(r"resumed from step (\d+)", b.stderr)) == {"8"}, b.stderr
    assert first_steps(tmp_path / "b") == {0: 8, 1: 8}  # not run A's step 16
    for name, manifest in kept.items():  # run A's, neither pruned nor overwritten by B
        assert (node / name / snap.MANIFEST).read_text() == manifest
    assert "holds snapshots of an earlier run of this job (--rdzv-id jobJ) (the newest of " \
           "step 16): this run starts afresh and keeps them" in b.stderr
    assert "holds another run's snapshot: not overwritten" in b.stderr


def test_the_agent_tells_a_restart_the_exact_step_and_run_it_chose(tmp_path) -> None:
    spec = RunSpec(script="x.py", nproc=2, snapshot_every=4, snapshot_dir=str(tmp_path / "s"))
    keeper = SnapshotKeeper(spec, "unit", 0, lambda kind, f: None)
    try:
        data, record = snap.slot_paths(keeper.shm, 0)
        writer = snapshot_io.Slot(data)
        try:
            rec = writer.write({"m": {"w": torch.ones(3)}, STEP: 4}, 4, worker=0, generation=0)
        finally:
            writer.close()
        Path(record).write_text(rec.to_json())
        assert not keeper.worker_fields(0, attempt=0).get("resume")  # a fresh start
        told = keeper.worker_fields(1, attempt=1)  # no restarting() call: as on a follower
        assert told.get("resume_dir") == keeper.disk  # this node's, not every node's and run's
        assert (told["resume"], told.get("resume_step"), told.get("resume_run")) \
            == (True, 4, keeper.run)
        assert keeper.run.startswith("unit/") and not keeper.worker_fields(2, 1).get("resume")
    finally:
        keeper.close()


# ---------------------------------------------------------------- 2: --resume that cannot load
@pytest.mark.timeout(330)  # two runs of ftrun (one in the /dev/shm case) on a busy host
@pytest.mark.slow
def test_a_resume_that_cannot_load_is_one_error_and_leaves_the_directory_unchanged(tmp_path
                                                                                    ) -> None:
    snaps = tmp_path / "s"
    first = run(tmp_path / "a", "--snapshot-every", "4", "--snapshot-dir", str(snaps), steps=8)
    assert first.returncode == 0, first.stderr
    before = tree(snaps)
    again = run(tmp_path / "b", "--snapshot-every", "4", "--resume", str(snaps),
                script_args=("--width", "32"))  # the model changed since
    assert again.returncode != 0, again.stderr
    errors = [ln for ln in again.stderr.splitlines() if "cannot resume" in ln]
    assert errors and all(ln.startswith("ftrun: error: cannot resume from --resume") and
                          "model.0.weight has shape (64, 32) in the snapshot, (32, 32) here"
                          in ln for ln in errors), again.stderr
    assert "Traceback" not in again.stderr and "skipping" not in again.stderr
    assert not list((tmp_path / "b").glob("log_*.json"))  # no step was trained
    assert tree(snaps) == before  # nothing pruned, overwritten or added


def test_a_snapshot_whose_optimizer_does_not_fit_loads_nothing(tmp_path, capsys) -> None:
    """All or none: the model must not keep the snapshot's weights when the optimizer's
    state cannot be loaded (the worker would otherwise train from them at step 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # two parameters in its group
    d = Path(snap.step_dir(str(tmp_path / "node0"), 4))
    d.mkdir(parents=True, mode=0o700)
    snapshot_io.save_disk({"model": model.state_dict(), "optimizer": opt.state_dict(),
                           STEP: 4}, str(d))
    snap.write_manifest(str(d), 4, 0.0, {"run": "r"})
    fresh = torch.nn.Linear(4, 2)
    before = fresh.weight.detach().clone()
    objects = {"model": fresh, "optimizer": torch.optim.SGD([fresh.weight], lr=0.1)}
    with pytest.raises(SystemExit) as ended:
        Snapshots(_worker_env(resume=True, resume_dir=str(tmp_path))).resume(objects)
    assert torch.equal(fresh.weight, before)  # nothing loaded
    assert ended.value.code == snap.EXIT_CANNOT_RESUME
    assert capsys.readouterr().err.splitlines() == [
        f"ftrun: error: cannot resume from --resume {tmp_path}: no snapshot fits (the newest, "
        f"{d}: optimizer.param_groups.0.params has 2 entries in the snapshot, 1 here)"]


# ---------------------------------------------------------------- 3: a small /dev/shm
@needs_mounts
@pytest.mark.timeout(330)  # two runs of ftrun (one in the /dev/shm case) on a busy host
@pytest.mark.slow
def test_a_small_dev_shm_snapshots_to_disk_instead_of_crashing(tmp_path) -> None:
    r = run(tmp_path / "o", "--snapshot-every", "4", "--snapshot-dir", str(tmp_path / "s"),
            "--max-faults", "3", script_args=("--width", "512", "--die-all-at", "10"),
            inside=namespace("size=4m:/dev/shm"))  # 2 slots of this state need ~6 MiB
    assert r.returncode == 0, r.stderr
    assert "SIGBUS" not in r.stderr
    said = [ln for ln in r.stderr.splitlines() if "snapshotting to disk only" in ln]
    assert said and all(re.fullmatch(r"ftrun: /dev/shm has \d+ MiB free, snapshots need 2 x "
                                     r"\d+ MiB: snapshotting to disk only \(.+\)", ln)
                        for ln in said), r.stderr
    assert re.search(r"resumed from step 8 \(disk slot \d", r.stderr), r.stderr
    assert first_steps(tmp_path / "o") == {0: 8, 1: 8}
    assert not list((tmp_path / "s").glob(".slots-*"))  # the disk slots go with the run


# ---------------------------------------------------------------- 4: a full disk
WRITER = """
import json, os, sys, time, torch
from ftrun.adapters import snapshot_io
from ftrun.agent.snapshots import SnapshotKeeper
from ftrun.core.spec import RunSpec
from ftrun.protocol import snapshots as snap
events = []
spec = RunSpec(script="x.py", snapshot_every=4, snapshot_dir=sys.argv[1])
keeper = SnapshotKeeper(spec, "full", 0, lambda kind, f: events.append((str(kind), dict(f))))
def publish(slot, numel, step):
    data, record = snap.slot_paths(keeper.shm, slot)
    writer = snapshot_io.Slot(data)
    rec = writer.write({"model": {"w": torch.ones(numel)}, "ftrun.step": step}, step, 0, 0)
    writer.close()
    with open(record, "w") as f:
        f.write(rec.to_json())
def wait(n):
    deadline = time.monotonic() + 30
    while len(events) < n and time.monotonic() < deadline:
        keeper.drain()
        time.sleep(0.02)
publish(0, 1 << 20, 4)  # 4 MiB: more than the disk holds
wait(1)
left = sorted(os.listdir(keeper.disk)) if os.path.isdir(keeper.disk) else []
publish(1, 1024, 8)  # the next one fits
wait(2)
keeper.close()
print(json.dumps({"events": events, "left_after_failure": left,
                  "node": sorted(os.listdir(keeper.disk))}))
"""


@needs_mounts
def test_a_full_disk_is_reported_and_the_writer_goes_on(tmp_path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    r = subprocess.run([*namespace(f"size=1m:{disk}"), sys.executable, "-c", WRITER,
                        str(disk)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    kinds = [(k, f.get("step")) for k, f in doc["events"]]
    assert kinds[:2] == [("snapshot_failed", 4), ("snapshot", 8)], doc
    assert doc["events"][0][1]["error"].endswith("; 1 MiB free there, 5 MiB needed"), doc
    assert doc["left_after_failure"] == []  # its temporary directory did not keep the disk full
    assert doc["node"] == ["step-000000008"]
    end = doc["events"][-1]
    assert end[0] == "notice" and "snapshots: 1 could not be written" in end[1]["text"]
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- 5: another user's snapshot
class _Payload:
    """Unpickling this creates `marker`: what a planted pickle could do as the victim."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def _plant(stage: Path, marker: str) -> None:
    """A step-999999999 snapshot whose checksums are right and whose pickles run code."""
    stage.mkdir()
    payload = pickle.dumps(_Payload(marker))
    files = {}
    for name in (".metadata", snap.SKELETON):
        (stage / name).write_bytes(payload)
        files[name] = {"bytes": len(payload), "crc32": zlib.crc32(payload)}
    doc = {"format": snap.FORMAT, "step": 999999999, "taken_at": 0.0, "files": files}
    (stage / snap.MANIFEST).write_text(json.dumps(doc))
    for p in [stage, *stage.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.mark.timeout(330)  # two runs of ftrun (one in the /dev/shm case) on a busy host
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv for a second uid")
def test_a_snapshot_planted_by_another_user_is_never_unpickled(tmp_path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="ftrun-shared-tmp-"))  # like /tmp: 1777
    try:
        shared.chmod(0o1777)
        marker = tmp_path / "pwned"
        _plant(shared / "stage", str(marker))
        planted = shared / "ftrun-snapshots" / "jobP"  # the old default directory of jobP
        as_other = ["setpriv", f"--reuid={PLANTER}", f"--regid={PLANTER}", "--clear-groups"]
        subprocess.run([*as_other, "sh", "-c", f"mkdir -p {planted}/node0 && cp -r "
                        f"{shared}/stage {planted}/node0/step-999999999"], check=True)
        assert (planted / "node0" / "step-999999999").stat().st_uid == PLANTER

        r = run(tmp_path / "o", "--rdzv-id", "jobP", "--snapshot-every", "4",
                env={"TMPDIR": str(shared)}, script_args=("--die-all-at", "10"))
        assert r.returncode == 0, r.stderr
        assert set(re.findall(r"resumed from step (\d+)", r.stderr)) == {"8"}, r.stderr
        assert not marker.exists(), "a planted pickle ran"
        own = shared / f"ftrun-snapshots-{os.getuid()}"
        assert own.stat().st_mode & 0o777 == 0o700
        files = [p for p in own.rglob("*") if p.is_file()]
        assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)

        named = run(tmp_path / "p", "--resume", str(planted))  # even when --resume names it
        assert named.returncode == 2, named.stderr
        assert f"belongs to uid {PLANTER}, not to you: never read" in named.stderr
        assert "Traceback" not in named.stderr and not marker.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_nothing_of_another_users_snapshot_is_unpickled_even_with_a_matching_manifest(
        tmp_path) -> None:
    """The check itself, without processes: a file of another uid, or one that others may
    write, is refused before any pickle in it is read."""
    marker = tmp_path / "pwned"
    _plant(tmp_path / "step-000000001", str(marker))
    path = str(tmp_path / "step-000000001")
    assert snap.verify(path) is None  # the checksums are right: they are no authentication
    (Path(path) / ".metadata").chmod(0o666)
    assert re.search(r"\.metadata is writable by other users \(mode 666\): never read",
                     _refusal(path, marker))
    if os.geteuid() == 0:
        for p in [Path(path), *Path(path).iterdir()]:
            p.chmod(0o700 if p.is_dir() else 0o600)
            os.chown(p, PLANTER, PLANTER)
        assert f"belongs to uid {PLANTER}, not to you: never read" in _refusal(path, marker)


def _refusal(path: str, marker: Path) -> str:
    """Why loading the snapshot at `path` was refused; fails if its pickle ran."""
    try:
        snapshot_io.load_disk(path)
    except Exception as exc:
        assert not marker.exists(), "the planted pickle ran"
        assert type(exc).__name__ == "Unreadable", exc
        return str(exc)
    raise AssertionError("another user's snapshot was loaded")


# ---------------------------------------------------------------- 6: medium and low
def _worker_env(**changes: object) -> WorkerEnv:
    required = {f.name: (0 if f.type == "int" else False if f.type == "bool" else "")
                for f in fields(WorkerEnv) if f.default is MISSING}
    return WorkerEnv(**{**required, **changes})  # type: ignore[arg-type]


def test_a_manifest_with_a_wrong_typed_field_is_skipped_for_the_older_snapshot(
        tmp_path, capsys) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    node = tmp_path / "node0"
    for step in (4, 8):
        d = Path(snap.step_dir(str(node), step))
        d.mkdir(parents=True, mode=0o700)
        with torch.no_grad():
            model.weight.fill_(step)
        snapshot_io.save_disk({"model": model.state_dict(), STEP: step}, str(d))
        snap.write_manifest(str(d), step, 0.0, {"run": "r"})
    newest = Path(snap.step_dir(str(node), 8)) / snap.MANIFEST
    newest.write_text(newest.read_text().replace('"step": 8', '"step": "sixty"'))
    fresh = torch.nn.Linear(4, 2)
    got = Snapshots(_worker_env(resume=True, resume_dir=str(tmp_path))).resume({"model": fresh})
    assert got.step == 4 and bool((fresh.weight == 4).all())
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ftrun: skipping snapshot {newest.parent}: its manifest's step is 'sixty', "
                   "not a step number"]


def test_shared_memory_left_by_a_killed_agent_is_removed_by_the_next(tmp_path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    stale = root / f"ftrun-snap-unit-{gone.pid}-abcdefgh"
    alive = root / f"ftrun-snap-unit-{os.getppid()}-abcdefgh"
    for d in (stale, alive):
        d.mkdir()
        (d / "slot0.bin").write_bytes(b"x" * 4096)
    keeper = None
    try:
        spec = RunSpec(script="x.py", snapshot_every=4, snapshot_dir=str(tmp_path / "s"))
        keeper = SnapshotKeeper(spec, "unit", 0, lambda kind, f: None)
        assert not stale.exists() and alive.exists()
        assert Path(keeper.shm).name.startswith(f"ftrun-snap-unit-{os.getpid()}-")
    finally:
        if keeper is not None:
            keeper.close()
        for d in (stale, alive):
            shutil.rmtree(d, ignore_errors=True)


@needs_mounts
def test_a_read_only_snapshot_dir_is_refused_at_launch(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    r = run(tmp_path / "o", "--snapshot-every", "4", "--snapshot-dir", str(ro / "snaps"),
            steps=8, inside=namespace(f"ro,size=1m:{ro}"), timeout=60)
    assert r.returncode != 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "snapshot-dir" in ln]
    assert lines == [f"ftrun: error: --snapshot-dir: cannot write to {ro / 'snaps'} (Read-only "
                     "file system) (give a --snapshot-dir you can write to)"], r.stderr
    assert not list((tmp_path / "o").glob("start_*.pid"))  # no worker was started
