"""ftrun under a real Slurm (tests/slurmlab.py: Debian's slurmctld and one slurmd per node, each
node its own network and UTS namespace), through the sbatch scripts users copy
(examples/slurm/): one ftrun per node under srun, with no rendezvous flags.

- a 2-node job trains and exits 0, everything it needs read from the allocation;
- one node's ftrun SIGKILLed mid-run: the step goes on (srun --no-kill --kill-on-bad-exit=0)
  and the spare node (3 allocated, --nnodes 2) takes the lost rank in-process;
- a node that fails (its link cut): Slurm sets it DOWN, and the --no-kill job it would have
  ended trains on with the spare node and ends 0;
- Slurm's notice (what --signal=B:TERM@120 sends), relayed by examples/slurm/requeue.sbatch
  to every node's ftrun: with nowhere to go the job snapshots and exits 75, the script
  requeues it, and the next run resumes from the snapshot;
- a notice to one node: its rank is handed over at a step boundary, and the job ends 0.
Skipped in one line where Slurm cannot be installed or started.
"""
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netlab, slurmlab
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
TRAIN = str(EXAMPLES / "train_ddp.py")
JOB_S = 240.0  # one job from submission to its end, on a busy 2-core machine
EXIT_REQUEUE = 75  # ftrun.core.exits.EXIT_REQUEUE, spelled as the sbatch script spells it


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmlab.SlurmLab]:
    why = slurmlab.unavailable()
    if why is not None:
        pytest.skip(f"no Slurm lab here: {why}")
    try:
        lab = slurmlab.SlurmLab(3, tmp_path_factory.mktemp("slurm"))
    except netlab.LabError as exc:
        pytest.skip(f"no Slurm lab here: {str(exc)[:160]}")
    try:
        lab.start()
    except (slurmlab.LabError, OSError) as exc:
        lab.close()
        pytest.skip(f"Slurm did not start here: {str(exc)[:160]}")
    yield lab
    lab.close()


@pytest.fixture
def job_env(private_run_dir: Path) -> dict[str, str]:
    """What the jobs run: this checkout's ftrun with this python, one thread per worker."""
    return {"FTRUN": f"{sys.executable} -m ftrun", "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(private_run_dir)}


def output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def worker_logs(out: Path) -> dict[str, list[dict[str, Any]]]:
    """train_ddp.py's --out logs, by worker id: each worker's steps of its last run."""
    return {p.stem.removeprefix("log_"): json.loads(p.read_text())["log"]
            for p in out.glob("log_*.json")}


def committed(log: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in log if e["committed"]]


def ended(lab: slurmlab.SlurmLab, job: str) -> dict[str, str]:
    return lab.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"],
                        JOB_S)


@pytest.mark.timeout(300)  # ~25 s
def test_a_two_node_job_without_rendezvous_flags_trains(slurm: slurmlab.SlurmLab,
                                                        job_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "res"
    job = slurm.sbatch(EXAMPLES / "slurm" / "train.sbatch", ["--nodes=2", f"--output={log}"],
                       [TRAIN, "--steps", "40", "--out", str(out)], env=job_env)
    state = ended(slurm, job)
    text = output(log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-2000:]
    said = re.findall(rf"ftrun: Slurm job {job}: (.*)", text)
    assert len(said) == 2, text  # one line per node
    assert all(f"--rdzv-id {job} (SLURM_JOB_ID), --nnodes 2 (SLURM_STEP_NUM_NODES)" in s
               and "--rdzv-backend c10d" in s and "--rdzv-endpoint node0:" in s for s in said)
    assert sorted(re.findall(r"--node-rank (\d) \(SLURM_NODEID\)", text)) == ["0", "1"]
    logs = worker_logs(out)
    assert len(logs) == 2, text
    for steps in logs.values():
        assert committed(steps) == list(range(40))
        assert {e["world"] for e in steps} == {2}


@pytest.mark.timeout(300)  # ~35 s
def test_a_killed_nodes_ranks_go_to_the_spare_node_and_the_step_goes_on(
        slurm: slurmlab.SlurmLab, job_env: dict[str, str], tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "res"
    steps = 200
    job = slurm.sbatch(EXAMPLES / "slurm" / "train.sbatch", [f"--output={log}"],
                       ["--nnodes", "2", TRAIN, "--steps", str(steps), "--step-time", "0.05",
                        "--out", str(out)], env=job_env)
    waits = re.compile(r"\((node\d)\) waits: the job is full")
    slurm.wait_for(lambda: waits.search(output(log)) and "step 40 " in output(log), JOB_S,
                   "the spare node waiting and the job at step 40")
    text = output(log)
    assert "1 spare node: 3 in the step, --nnodes 2" in text
    spare = re.findall(waits, text)[0]
    victim = next(i for i in (1, 2) if f"node{i}" != spare)  # node0 serves the store
    tasks = slurm.step_pids(f"{job}.0", victim, tasks_only=True)
    assert len(tasks) == 1, tasks
    os.kill(tasks[0], signal.SIGKILL)
    state = ended(slurm, job)
    text = output(log)
    assert state["JobState"] != "CANCELLED", text[-2000:]  # the step was not ended for it
    assert re.search(rf"srun: error: node{victim}: task \d: Killed", text), text[-2000:]
    assert f"(node{victim}) lost with 1 member" in text
    assert f"({spare}) enters the running job" in text
    assert "survived 1/1 faults" in text
    logs = worker_logs(out)
    assert len(logs) == 2, text  # the coordinator's worker and the spare node's
    for worker in logs.values():
        assert committed(worker)[-1] == steps - 1 and worker[-1]["world"] == 2
    first = next(w for w in logs.values() if committed(w)[0] == 0)
    assert committed(first) == list(range(steps))  # no committed step lost or repeated


@pytest.mark.timeout(360)  # ~60 s: two runs and Slurm's requeue delay
def test_a_notice_with_nowhere_to_go_requeues_and_resumes(slurm: slurmlab.SlurmLab,
                                                          job_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    log, out, snaps = tmp_path / "job.out", tmp_path / "res", tmp_path / "snapshots"
    steps = 150
    env = {**job_env, "SNAPSHOTS": str(snaps), "SNAPSHOT_EVERY": "10"}  # ftrun's own exit 75
    job = slurm.sbatch(EXAMPLES / "slurm" / "requeue.sbatch", [f"--output={log}"],
                       [TRAIN, "--steps", str(steps), "--step-time", "0.05", "--out", str(out)],
                       env=env)
    slurm.wait_for(lambda: "step 40 " in output(log) and any(snaps.glob("node*/step-*")),
                   JOB_S, "a snapshot on disk and the job at step 40")
    slurm.run("scancel", "--signal=TERM", "--batch", job)  # what --signal=B:TERM@120 sends
    slurm.wait_for(lambda: slurm.job(job).get("Restarts") == "1", JOB_S, "the job requeued")
    state = ended(slurm, job)
    text = output(log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-2000:]
    assert f"ftrun asked for a requeue (exit {EXIT_REQUEUE})" in text
    assert len(re.findall(rf"ftrun: Slurm job {job} \(restart 1\): ", text)) == 2
    resumed = {int(s) for s in re.findall(r"worker \d+ resumed from step (\d+)", text)}
    assert len(resumed) == 1, text[-2000:]  # both workers, from the same snapshot
    step = resumed.pop()
    assert 10 <= step < steps
    logs = worker_logs(out)  # the second run's
    assert len(logs) == 2
    for worker in logs.values():
        assert committed(worker) == list(range(step, steps))


@pytest.mark.timeout(300)  # ~45 s: Slurm takes ~11 s to set a silent node DOWN here
def test_a_failed_node_is_set_down_and_the_no_kill_job_trains_on(
        slurm: slurmlab.SlurmLab, job_env: dict[str, str], tmp_path: Path) -> None:
    """The reason for --no-kill: a node whose link is cut is set DOWN by Slurm, which would
    end (and requeue) the whole job without it; with it the job trains on, the spare node in
    the lost rank, and ends 0."""
    log, trails, end_file = tmp_path / "job.out", tmp_path / "trails", tmp_path / "end_at"
    trails.mkdir()
    job = slurm.sbatch(EXAMPLES / "slurm" / "train.sbatch", [f"--output={log}"],
                       ["--nnodes", "2", str(FIXTURES / "ft_train.py"), "--steps", "100000",
                        "--step-time", "0.04", "--trail", str(trails), "--end-file",
                        str(end_file)], env=job_env)
    waits = re.compile(r"\((node\d)\) waits: the job is full")
    slurm.wait_for(lambda: waits.search(output(log)) and reached(trails) >= 20, JOB_S,
                   "the spare node waiting and the job at step 20")
    spare = re.findall(waits, output(log))[0]
    victim = next(i for i in (1, 2) if f"node{i}" != spare)
    slurm.net.cut(victim)
    try:
        slurm.wait_for(lambda: slurm.node_states().get(f"node{victim}") == "down*", JOB_S,
                       f"Slurm setting node{victim} DOWN")
        assert slurm.job(job)["JobState"] == "RUNNING"
        at_down = reached(trails)
        slurm.wait_for(lambda: reached(trails) >= at_down + 20, JOB_S, "20 more steps")
        end_file.write_text(str(reached(trails) + 20))
        state = ended(slurm, job)
    finally:
        slurm.net.restore(victim)
    text = output(log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-2000:]
    assert f"srun: error: Node failure on node{victim}" in text
    assert f"({spare}) enters the running job" in text and "survived 1/1 faults" in text
    slurm.wait_for(lambda: slurm.idle_nodes() == 3, JOB_S, "the node back in service")


def reached(trails: Path) -> int:
    """The highest step any worker committed, from ft_train.py's trails (written at once)."""
    steps = [-1]
    for path in trails.glob("trail_*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                entry = json.loads(line)
                steps += [entry["step"]] if entry["ok"] else []
    return max(steps)


@pytest.mark.timeout(300)  # ~40 s
def test_a_notice_to_one_node_hands_its_rank_to_a_spare_on_the_other(
        slurm: slurmlab.SlurmLab, job_env: dict[str, str], tmp_path: Path) -> None:
    """A notice handed to one node's ftrun alone (as requeue.sbatch's relay hands Slurm's
    --signal to each): its rank goes to the other node's hot spare at a step boundary,
    nothing is repeated, no fault is counted, and every ftrun of the step exits 0."""
    log, out = tmp_path / "job.out", tmp_path / "res"
    steps = 200
    job = slurm.sbatch(EXAMPLES / "slurm" / "train.sbatch", ["--nodes=2", f"--output={log}"],
                       ["--nnodes", "1:2", "--spares", "1", TRAIN, "--steps", str(steps),
                        "--step-time", "0.05", "--out", str(out)], env=job_env)
    slurm.wait_for(lambda: "step 40 " in output(log), JOB_S, "the job at step 40")
    tasks = slurm.step_pids(f"{job}.0", 1, tasks_only=True)  # node0 serves the store
    assert len(tasks) == 1, tasks
    os.kill(tasks[0], signal.SIGTERM)
    state = ended(slurm, job)
    text = output(log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-2000:]
    assert "(node1) drained; it leaves the job" in text
    assert "survived" not in text  # no fault
    logs = worker_logs(out)
    first = next(w for w in logs.values() if committed(w)[0] == 0)
    assert committed(first) == list(range(steps))  # nothing repeated
    assert {e["world"] for e in first} == {2}  # never short-handed
