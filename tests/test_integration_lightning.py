"""ftrun.integrations.lightning.FaultTolerantStrategy: an unchanged LightningModule and
DataModule (examples/lightning_train.py) survive a worker killed mid-backward under
`ftrun --spares 1`, and end bit for bit where the fault-free run ends."""
import json
import os
import re
import subprocess
from pathlib import Path
from typing import cast

import pytest
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from replicas import bitwise_equal, params

pytest.importorskip("lightning")

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "lightning_train.py")
DIE = str(FIXTURES / "die_in_backward.py")
ARGS = ("--epochs", "2", "--samples", "192", "--batch", "8")  # 12 steps an epoch, 24 in all
KILLED_AT = 15  # optimizer steps done when worker 1 dies: epoch 1, its 4th batch


def batch_log(out: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}


def positions(rows: list[dict]) -> list[tuple[int, int, int]]:
    return [(r["step"], r["epoch"], r["batch"]) for r in rows]


def status_workers() -> list[dict]:
    r = subprocess.run(ftrun_cmd("status", "--json"), capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)["workers"] if r.returncode == 0 else []


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs, each worker importing Lightning on 2 shared cores
def test_lightning_kill(tmp_path: Path, private_run_dir: Path) -> None:
    ref = tmp_path / "ref"
    r = run_ftrun("--nproc", "2", DIE, EXAMPLE, *ARGS, "--out", str(ref), timeout=300)
    assert r.returncode == 0, r.stderr
    reference, ref_logs = params(ref), batch_log(ref)
    assert sorted(reference) == [0, 1] and bitwise_equal(reference[0], reference[1])
    total = len(ref_logs[0]["rows"])
    assert [r["step"] for r in ref_logs[0]["rows"]] == list(range(1, total + 1))

    out, go = tmp_path / "o", tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_TEST_DIE": f"1:{KILLED_AT}:2",
           "FTRUN_TEST_GO": str(go)}
    job = subprocess.Popen(ftrun_cmd("--nproc", "2", "--spares", "1", "--hang-timeout", "150",
                                     DIE, EXAMPLE, *ARGS, "--out", str(out)),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def spare_ready() -> list[dict] | None:
            assert job.poll() is None, job.communicate()[1]
            workers = status_workers()
            return workers if any(w.get("role") == "spare" for w in workers) else None
        workers = cast(list[dict], wait_for(spare_ready, 240, "a ready spare"))
        pids = {w["worker_id"]: w["pid"] for w in workers}
        go.touch()
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    spare = re.search(r"worker 1 \(rank 1\) exited with -9 \(SIGKILL\); spare worker (\d+) "
                      r"takes rank 1", err)
    assert spare, err
    spare_id = int(spare.group(1))

    ps, logs = params(out), batch_log(out)
    assert sorted(ps) == [0, spare_id]
    assert all(bitwise_equal(p, reference[0]) for p in ps.values())  # CPU: deterministic
    survivor, joiner = logs[0], logs[spare_id]
    assert survivor["pid"] == pids[0]  # the survivor kept its process
    assert survivor["repeats"] == 1 and joiner["repeats"] == 0  # the broken step ran again
    # no step repeated or skipped: the survivor logged every step once, the spare went on
    # from the step after the last committed one, at the same epoch and batch as rank 1 did
    assert positions(survivor["rows"]) == positions(ref_logs[0]["rows"])
    assert positions(joiner["rows"]) == positions(ref_logs[1]["rows"])[KILLED_AT:]
