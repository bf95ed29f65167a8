"""`ftrun inject-fault --chaos` against a real job (gloo, CPU, 3 workers and a hot spare): every
fault it sends is recovered, the summary is printed, the job finishes, and the run's event
log holds each chaos drill and its fault."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, wait_for
from jobstatus import job_status

KINDS = ("kill", "exception", "exit", "segv", "comm")
COUNT = 6


@pytest.mark.slow
def test_chaos_on_a_running_job(tmp_path: Path, private_run_dir: Path) -> None:
    end_file = tmp_path / "end"
    job = subprocess.Popen(
        ftrun_cmd("--nproc", "3", "--spares", "1", "--log-dir", str(tmp_path / "logs"),
                  str(FIXTURES / "ft_train.py"), "--steps", "1000000", "--step-time", "0.01",
                  "--end-file", str(end_file)),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        def training() -> bool:
            doc = job_status()
            members = [w for w in (doc or {}).get("workers", []) if w["role"] == "member"]
            return len(members) == 3 and all((w["step"] or 0) > 5 for w in members)

        wait_for(training, 90, "a job with 3 members training")
        r = subprocess.run(
            # the plan's kinds and ranks are drawn from the seed alone; each fault waits for
            # the one before to settle and the job to be whole again, whatever --every says
            ftrun_cmd("inject-fault", "--chaos", "--every", "0.3", "--count", str(COUNT),
                      "--seed", "5", "--kinds", ",".join(KINDS)),
            capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        sent = [line for line in r.stdout.splitlines() if line.startswith("ftrun: chaos ")
                and f"/{COUNT} (" in line]
        assert len(sent) == COUNT, r.stdout
        head = next(x for x in r.stdout.splitlines() if " drills in " in x)
        assert head.endswith(f"{COUNT} faults, {COUNT} recovered"), r.stdout
        assert "goodput 0." in r.stdout and "committed steps lost 0" in r.stdout
        doc = job_status()
        assert doc is not None
        faults = doc["faults"]
        assert len(faults) == COUNT and all(f["recovered"] and f["injected"] for f in faults)
        assert {f["kind"] for f in faults} <= set(KINDS)
        end_file.write_text(str(max(w["step"] or 0 for w in doc["workers"]) + 30))
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            job.terminate()
        _, err = job.communicate(timeout=60)
    assert f"survived {COUNT}/{COUNT} faults" in err
    events = next((tmp_path / "logs").iterdir()) / "events.jsonl"
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    drills = [x for x in lines if x["event"] == "drill"]
    assert [d["kind"] for d in drills] == [f["kind"] for f in faults]
    assert [d["chaos"] for d in drills] == list(range(1, COUNT + 1))  # tagged, numbered
    assert sum(x["event"] == "fault" for x in lines) == COUNT
