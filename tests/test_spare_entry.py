"""#51 item 3: the spare chosen to replace a lost rank is SIGKILLed right after the fault, before
it entered. Under --redo lost the job stayed a rank short for good with spares idle; under
--redo step the survivors waited out the dead entrant's connect (10.1 s) when it died after
publishing its reconfigure handle. Real agents, real workers (examples/train_ddp.py), the pids
read through `ftrun status --json`; the handle race itself through the native group's own
code, with a store in memory."""
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import ftrun_cmd, wait_for
from fakestore import MemoryStore
from jobstatus import job_status

from ftrun.protocol.rendezvous import Generation
from ftrun.worker.exchange import value_key
from ftrun.worker.joining import BUSY, NativeGroup

TRAIN = str(Path(__file__).parent.parent / "examples" / "train_ddp.py")


def status(run_id: str) -> dict | None:
    return job_status(run_id=run_id)


def published(out: Path, number: int) -> bool:
    for log in (out / "logs").glob("*/events.jsonl"):
        for line in log.read_text().splitlines():
            if '"generation"' in line and json.loads(line).get("generation") == number:
                return True
    return False


def kill_rank_then_its_spare(redo: str, out: Path) -> tuple[subprocess.CompletedProcess[str],
                                                              list[dict]]:
    run_id = f"spare-entry-{redo}"
    proc = subprocess.Popen(
        ftrun_cmd("--nproc", "3", "--spares", "1", "--redo", redo, "--rdzv-id", run_id,
                  "--log-dir", str(out / "logs"), TRAIN, "--steps", "150", "--step-time",
                  "0.03", "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        def ready() -> list[dict] | None:
            doc = status(run_id)
            if doc is None:
                return None
            rows = doc["workers"]
            spare = any(w["role"] == "spare" for w in rows)
            return rows if spare and max((w["step"] or 0) for w in rows) >= 10 else None

        rows = wait_for(ready, 120, "a ready spare and step 10")
        assert isinstance(rows, list)
        victim = next(w for w in rows if w["rank"] == 1)
        spare = next(w for w in rows if w["role"] == "spare")
        os.kill(victim["pid"], signal.SIGKILL)
        # the spare is chosen once generation 1 is published; killed then, before it entered
        # (the make-up, or its heal, takes tens of ms more): read from the event log at once
        wait_for(lambda: published(out, 1), 30, "generation 1 in the event log")
        os.kill(spare["pid"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in
              next((out / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), events


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_redo_lost_the_next_replacement_enters(tmp_path: Path,
                                                     private_run_dir: Path) -> None:
    r, events = kill_rank_then_its_spare("lost", tmp_path)
    assert r.returncode == 0, r.stderr
    logs = [json.loads(p.read_text()) for p in tmp_path.glob("log_*.json")]
    last = max((entry for log in logs for entry in log["log"] if entry["committed"]),
               key=lambda e: e["step"])
    assert last["world"] == 3, r.stderr  # back to its size, not 2 for the rest of the run
    assert len(logs) == 3  # the two survivors and the worker that took the rank at the end


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_under_redo_step_the_next_replacement_enters(tmp_path: Path,
                                                     private_run_dir: Path) -> None:
    r, events = kill_rank_then_its_spare("step", tmp_path)
    assert r.returncode == 0, r.stderr
    logs = [json.loads(p.read_text()) for p in tmp_path.glob("log_*.json")]
    assert len(logs) == 3 and all(log["log"][-1]["world"] == 3 for log in logs), r.stderr


def test_a_member_whose_abandoned_reconfigure_still_runs_says_busy_at_once() -> None:
    """The stall's cause: a generation's reconfigure held by a dead member's connect (up to
    RECONFIGURE_CONNECT_S) made the next generation wait for it. Now this member publishes
    BUSY for the next one at once, and every member builds a fresh group."""
    group = NativeGroup.__new__(NativeGroup)  # its state only: no default group is needed
    group.worker_id, group._newest = 0, -1
    group._turn, group._running = threading.Lock(), threading.Lock()
    store = MemoryStore()
    gen = Generation(2, (0, 4, 2))
    prefix = f"{gen.pg_prefix}handle/"
    for rank in (1, 2):  # the others published theirs (handles or BUSY: any)
        store.set(value_key(prefix, rank), b"a-handle")
    held = threading.Event()
    release = threading.Event()

    def abandoned_reconfigure() -> None:  # generation 1's, re-forming: connecting to the dead spare
        with group._running:
            held.set()
            release.wait(30)

    threading.Thread(target=abandoned_reconfigure, daemon=True).start()
    held.wait(5)
    try:
        assert group.reconfigure(store, gen, 5.0, threading.Event()) is None  # a fresh group
        assert store.get(value_key(prefix, 0)) == BUSY.encode()
    finally:
        release.set()
