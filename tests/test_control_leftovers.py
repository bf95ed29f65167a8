"""What a run SIGKILLed with its whole process tree (its guardian too) leaves behind, removed by
the next run of the same user, snapshotting or not, or by `ftrun status` (issue #51): its run
files (`<id>.json`, `<id>.sock`) and its shared-memory snapshot slots. Real launchers."""
import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for

from ftrun.adapters import control
from ftrun.core.errors import FtrunError

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
needs_shm = pytest.mark.skipif(SHM is None, reason="no /dev/shm here")


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (the agent's workers are its children: a subreaper)."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def kill_tree(pid: int) -> None:
    """Stopped first, all of them, so that none cleans up after another: then SIGKILL."""
    procs = tree(pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)


def snapshot_in_shm() -> object:
    try:
        doc = control.status(control.find_run(None))
    except FtrunError:
        return None
    return doc if doc.snapshot and doc.snapshot.shm_step else None


def run_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.suffix in (".json", ".sock"))


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@needs_shm
@pytest.mark.timeout(180)
def test_ftrun_status_removes_what_a_sigkilled_tree_left(tmp_path, private_run_dir) -> None:
    job = subprocess.Popen(ftrun_cmd("--nproc", "1", "--rdzv-id", f"leftover{os.getpid()}",
                                     "--snapshot-every", "2", str(FIXTURES / "ft_train.py"),
                                     "--steps", "1000000", "--step-time", "0.05"),
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"),  # noqa: SIM115
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for(snapshot_in_shm, 120, "a snapshot in shared memory")
        slots = list(SHM.glob(f"ftrun-snap-*-{job.pid}-*"))
        files = run_files(private_run_dir)
        assert len(slots) == 1 and len(files) == 2, (slots, files)
    finally:
        kill_tree(job.pid)
        job.wait(30)
    assert slots[0].exists() and run_files(private_run_dir) == files
    r = run_ftrun("status")
    assert r.returncode == 1 and "no ftrun job is running" in r.stderr, r.stderr
    assert run_files(private_run_dir) == [] and not slots[0].exists()


@needs_shm
def test_any_later_run_removes_what_dead_runs_left(tmp_path, private_run_dir) -> None:
    private_run_dir.mkdir(mode=0o700)
    gone = dead_pid()
    doc = {"run_id": "dead", "pid": gone, "script": "x.py", "started_at": 1.0,
           "socket": str(private_run_dir / "dead.sock"), "log_dir": None}
    (private_run_dir / "dead.json").write_text(json.dumps(doc))
    (private_run_dir / "dead.sock").write_text("")
    slots = SHM / f"ftrun-snap-dead-{gone}-abcdefgh"
    slots.mkdir()
    try:
        (slots / "slot0.bin").write_bytes(b"x" * 4096)
        r = run_ftrun("--nproc", "1", str(FIXTURES / "behave.py"))  # no snapshots
        assert r.returncode == 0, r.stderr
        assert not slots.exists()
        assert run_files(private_run_dir) == []  # its own are gone with it too
    finally:
        if slots.exists():
            for p in slots.iterdir():
                p.unlink()
            slots.rmdir()
