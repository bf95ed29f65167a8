"""What the framework integrations' tests share: a fault-free run and a run whose worker 1
SIGKILLs itself inside backward once a hot spare is ready (tests/fixtures/die_in_backward.py),
each worker's final parameters and its log of finished steps."""
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from jobstatus import job_status
from replicas import bitwise_equal, params

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
    doc = job_status()
    return doc["workers"] if doc else []


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


def check_a_kill_heals_bitwise(tmp: Path, script: str, args: tuple[str, ...], killed_at: int,
                               positions: Callable[[list[dict[str, Any]]], list[Any]]) -> None:
    """A fault-free run, then the same run with worker 1 killed mid-backward after `killed_at`
    steps: the spare takes its rank; the run ends bit for bit where the fault-free one ends
    (CPU, gloo, world size held, random streams healed), the survivor keeps its process and
    runs the broken step once more, and no step is repeated or skipped: the survivor logs
    every step once, the spare goes on from the step after the last committed one at the
    position (`positions`: step, epoch, batch as the framework counts) rank 1 had."""
    ref = fault_free(tmp / "ref", script, *args)
    assert sorted(ref.params) == [0, 1] and bitwise_equal(ref.params[0], ref.params[1])
    total = len(ref.logs[0]["rows"])
    assert [r["step"] for r in ref.logs[0]["rows"]] == list(range(1, total + 1))

    run = killed(tmp / "o", script, *args, at_step=killed_at)
    assert sorted(run.params) == [0, run.spare]
    assert all(bitwise_equal(p, ref.params[0]) for p in run.params.values())
    survivor, joiner = run.logs[0], run.logs[run.spare]
    assert run.pids is not None and survivor["pid"] == run.pids[0]  # kept its process
    assert survivor["repeats"] == 1 and joiner["repeats"] == 0  # the broken step ran again
    assert positions(survivor["rows"]) == positions(ref.logs[0]["rows"])
    assert positions(joiner["rows"]) == positions(ref.logs[1]["rows"])[killed_at:]
