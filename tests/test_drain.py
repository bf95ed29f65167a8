"""Planned leaves end to end (#48): real agents, real workers (examples/train_ddp.py), the
drain asked for with `ftrun drain` or sent as a notice (SIGTERM to the agent). A swap lands at
a step boundary: no step repeated, no fault counted, the final replicas bitwise equal to the
fault-free run's; with nowhere to go the job snapshots, exits 75 and `--resume` continues it
bitwise."""
import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ftrun_cmd, run_ftrun, wait_for
from jobstatus import job_status

from ftrun.core.exits import EXIT_REQUEUE

TRAIN = str(Path(__file__).parent.parent / "examples" / "train_ddp.py")
STEPS = 300
ARGS = ("--steps", str(STEPS), "--step-time", "0.03")


def status(run_id: str) -> dict | None:
    return job_status(run_id=run_id)


def start(run_id: str, out: Path, *flags: str, args: tuple[str, ...] = ARGS
          ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ftrun_cmd("--rdzv-id", run_id, "--log-dir", str(out / "logs"), *flags, TRAIN, *args,
                  "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def at_step(run_id: str, step: int, spare: bool) -> dict:
    def ready() -> dict | None:
        doc = status(run_id)
        if doc is None:
            return None
        rows = doc["workers"]
        steps = [w["step"] or 0 for w in rows if w["role"] == "member"]
        spares = not spare or any(w["role"] == "spare" for w in rows)
        return doc if spares and steps and min(steps) >= step else None

    doc = wait_for(ready, 120, f"step {step}")
    assert isinstance(doc, dict)
    return doc


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def logs(out: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text())["log"]
            for p in out.glob("log_*.json")}


def params(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem.split("_")[1]): torch.load(p) for p in out.glob("params_*.pt")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref")
    r = run_ftrun("--nproc", "3", TRAIN, *ARGS, "--out", str(out), timeout=240)
    assert r.returncode == 0, r.stderr
    return params(out)[0]


def bitwise(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ftrun_drain_hands_a_rank_to_a_spare_at_a_step_boundary(
        tmp_path: Path, private_run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    proc = start("drain-rank", tmp_path, "--nproc", "3", "--spares", "1")
    try:
        at_step("drain-rank", 30, spare=True)
        r = run_ftrun("drain", "--rank", "1", "--run-id", "drain-rank", timeout=120)
    finally:
        code, err = finish(proc)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "hands over to spare worker 3" in lines[1] and "done" in lines[-1], r.stdout
    assert code == 0, err
    runs = logs(tmp_path)
    assert set(runs) == {0, 2, 3}  # the leaver left inside ft.steps(): no log of its own
    for wid, entries in runs.items():  # no step repeated, none skipped
        steps = [e["step"] for e in entries if e["committed"]]
        assert steps == list(range(steps[0], STEPS)) and (wid == 3 or steps[0] == 0)
    assert runs[3][0]["step"] > 30  # the spare came in mid-run
    assert all(bitwise(p, reference) for p in params(tmp_path).values())
    events = [json.loads(line) for line in
              next((tmp_path / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    assert not [e for e in events if e["event"] == "fault"]
    exits = {e["pid"]: e["returncode"] for e in events if e["event"] == "exit"}
    assert all(code == 0 for code in exits.values() if code is not None), exits


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_drain_nothing_can_serve_is_refused_in_one_line(tmp_path: Path,
                                                           private_run_dir: Path) -> None:
    proc = start("drain-refused", tmp_path, "--nproc", "2", "--on-fault", "shrink",
                 "--min-nproc", "2")
    try:
        at_step("drain-refused", 5, spare=False)
        r = run_ftrun("drain", "--rank", "1", "--run-id", "drain-refused", timeout=120)
    finally:
        code, err = finish(proc)
    assert r.returncode == 1, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "refused" in line and "below --min-nproc 2" in line, line
    assert code == 0, err  # the job went on, whole


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_notice_with_nowhere_to_go_snapshots_requeues_and_resumes_bitwise(
        tmp_path: Path, private_run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    snaps = tmp_path / "snaps"
    flags = ("--nproc", "3", "--snapshot-every", "10", "--snapshot-dir", str(snaps))
    proc = start("notice", tmp_path / "a", *flags)
    try:
        at_step("notice", 25, spare=False)
        # the node will be taken: the drill sends the agent SIGTERM, as a scheduler would
        drill = run_ftrun("inject-fault", "--kind", "preempt", "--run-id", "notice",
                          timeout=120)
    finally:
        code, err = finish(proc)
    assert drill.returncode == EXIT_REQUEUE, drill.stdout + drill.stderr
    assert "got its notice (SIGTERM)" in drill.stdout and "requeue" in drill.stdout
    assert code == EXIT_REQUEUE, err
    assert "snapshot taken, requeue the job" in err and "received SIGTERM: a notice" in err
    left = max(e["step"] for log in logs(tmp_path / "a").values() for e in log) \
        if logs(tmp_path / "a") else -1
    assert left == -1  # every member left inside ft.steps(): the loop ended for none
    r = run_ftrun(*flags, "--resume", str(snaps), TRAIN, *ARGS, "--out",
                  str(tmp_path / "b"), timeout=240)
    assert r.returncode == 0, r.stderr
    assert "resum" in r.stderr
    assert all(bitwise(p, reference) for p in params(tmp_path / "b").values())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_gpu_whose_memory_wears_out_hands_its_rank_to_a_spare(
        tmp_path: Path, private_run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    # NVML's counters are read every GPU_POLL_S (5 s): the run must outlast the first poll
    # after the injection, which comes once the spare is ready (at 0.03 s steps it sometimes
    # ended first, with no drain at all); the step time only sleeps, the result is the same
    slower = ("--steps", str(STEPS), "--step-time", "0.06")
    proc = start("drain-gpu", tmp_path, "--nproc", "3", "--spares", "1", "--gpu-backend",
                 "sim", "--drain-on", "degraded", args=slower)
    try:
        at_step("drain-gpu", 30, spare=True)
        r = run_ftrun("inject-fault", "--gpu", "1", "--kind", "ecc", "--run-id", "drain-gpu",
                      timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        code, err = finish(proc)
    assert code == 0, err
    events = [json.loads(line) for line in
              next((tmp_path / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    drains = [e for e in events if e["event"] == "drain"]
    assert drains[-1]["state"] == "done" and drains[-1]["leavers"] == [1], drains[-1]
    assert drains[-1]["what"].startswith("gpu 1 (degraded: corrected ECC errors rising")
    assert not [e for e in events if e["event"] == "fault"]
    assert set(logs(tmp_path)) == {0, 2, 3}
    assert all(bitwise(p, reference) for p in params(tmp_path).values())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_notice_signal_sent_to_every_process_of_the_step_reaches_the_agent_alone(
        tmp_path: Path, private_run_dir: Path) -> None:
    """Slurm's --signal reaches every process of the job step: with --drain-signal SIGUSR1
    the workers start with it ignored (its default action would end them), and the agent
    takes it as its notice."""
    import psutil

    proc = start("notice-all", tmp_path, "--nproc", "2", "--drain-signal", "SIGUSR1")
    try:
        doc = at_step("notice-all", 5, spare=False)
        pids = [proc.pid, *(w["pid"] for w in doc["workers"])]
        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        for pid in set(pids):  # the agent, its workers, the zygote: as Slurm signals a step
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    finally:
        code, err = finish(proc)
    assert code == EXIT_REQUEUE, err
    assert "received SIGUSR1: a notice" in err and "-10" not in err
    events = [json.loads(line) for line in
              next((tmp_path / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    assert not [e for e in events if e["event"] == "fault"]
