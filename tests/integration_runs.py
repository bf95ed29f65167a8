"""What the framework integrations' tests share: a fault-free run and a run whose worker 1
SIGKILLs itself inside backward once a hot spare is ready (tests/fixtures/die_in_backward.py),
each worker's final parameters and its log of finished steps."""
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from replicas import params

DIE = str(FIXTURES / "die_in_backward.py")


@dataclass
class Run:
    params: dict[int, dict[str, torch.Tensor]]  # worker id -> final parameters
    logs: dict[int, dict[str, Any]]  # worker id -> {"pid", "rows", "repeats"}
    stderr: str = ""
    pids: dict[int, int] | None = None  # worker id -> pid, seen before the fault
    spare: int = -1  # the spare that took rank 1


def _logs(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}


def fault_free(out: Path, script: str, *args: str) -> Run:
    r = run_ftrun("--nproc", "2", DIE, script, *args, "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    return Run(params(out), _logs(out), r.stderr)


def _status_workers() -> list[dict[str, Any]]:
    r = subprocess.run(ftrun_cmd("status", "--json"), capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)["workers"] if r.returncode == 0 else []


def killed(out: Path, script: str, *args: str, at_step: int) -> Run:
    """Worker 1 dies in the backward of the step after `at_step` optimizer steps, once the
    spare of `--spares 1` is ready."""
    go = out.parent / f"{out.name}.go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_TEST_DIE": f"1:{at_step}:2",
           "FTRUN_TEST_GO": str(go)}
    job = subprocess.Popen(ftrun_cmd("--nproc", "2", "--spares", "1", "--hang-timeout", "150",
                                     DIE, script, *args, "--out", str(out)),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def spare_ready() -> list[dict[str, Any]] | None:
            assert job.poll() is None, job.communicate()[1]
            workers = _status_workers()
            return workers if any(w.get("role") == "spare" for w in workers) else None
        workers = cast(list[dict[str, Any]], wait_for(spare_ready, 240, "a ready spare"))
        go.touch()
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    took = re.search(r"worker 1 \(rank 1\) exited with -9 \(SIGKILL\); spare worker (\d+) "
                     r"takes rank 1", err)
    assert took, err
    return Run(params(out), _logs(out), err, {w["worker_id"]: w["pid"] for w in workers},
               int(took.group(1)))
