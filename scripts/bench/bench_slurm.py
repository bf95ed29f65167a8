"""A lost node under a real Slurm (tests/slurmlab.py; root): ftrun started by sbatch and srun
(examples/slurm/train.sbatch, no rendezvous flags), the same ftrun job started by hand on the
same lab hosts, and torchrun under the same srun, whose step Slurm ends at its first failed
task (srun --kill-on-bad-exit=1, as a node failure ends it without --no-kill) and a retry loop
in the batch script starts again: a whole-step restart, resuming from a checkpoint.

    python scripts/bench/bench_slurm.py [--rounds 3] [--kill-after 20]

Each run trains on 2 nodes x 1 worker (scripts/bench/bench_recovery_worker.py: ~10 M-parameter MLP,
gloo; torchrun's DDP checkpoints every 10 steps); ftrun's runs have a third node as a spare
node (--nnodes 2). After every rank committed --kill-after steps, every process of one
training node that does not serve the store (launcher and workers; its slurmd lives on) is
SIGKILLed: a host failure. Recovery = the kill to the first step committed by the smaller job
or by a new process; lost = committed steps done again. Rounds interleave the three; medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from tests import slurmlab  # noqa: E402

WORKER = HERE / "bench_recovery_worker.py"
TRAIN_SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
NODES = 3  # 2 train, 1 spare node (ftrun's runs)
WORLD = 2
WAIT_S = 300.0  # to reach the kill step, then again to recover
END_S = 60.0  # a cancelled job ended
TORCHRUN_SBATCH = """#!/bin/bash
for attempt in 1 2 3; do  # a whole-step restart: Slurm ends the step, the script starts it
    srun --kill-on-bad-exit=1 --ntasks-per-node=1 {python} -m torch.distributed.run \\
        --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint node0:{port} \\
        --rdzv-id "$SLURM_JOB_ID" {worker} && break
done
"""

Result = dict[str, float]


def worker(mode: str, out: Path, a: argparse.Namespace) -> list[str]:
    return [str(WORKER), "--mode", mode, "--out", str(out), "--steps", str(a.steps),
            "--batch", "32"]


def events(out: Path) -> list[dict[str, float]]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return [e for e in found if e.get("ev") == "step"]


def node_of(lab: slurmlab.SlurmLab, pid: float) -> int | None:
    return next((i for i in range(NODES) if int(pid) in lab.pids(i)), None)


def observe(lab: slurmlab.SlurmLab, out: Path, a: argparse.Namespace,
            kill: Callable[[int], None]) -> Result:
    """Wait for the kill step, kill a training node (not node0: it serves the store), and
    time the first step committed after it by the smaller job or a new process."""
    lab.wait_for(lambda: len({e["rank"] for e in events(out) if e["step"] >= a.kill_after})
                 == WORLD, WAIT_S, f"every rank past step {a.kill_after}")
    steps = events(out)
    before = {e["pid"] for e in steps}
    victim = next(n for p in before if (n := node_of(lab, p)) not in (None, 0))
    killed_at = time.time()
    kill(victim)

    def recovered() -> list[dict[str, float]]:
        return [e for e in events(out) if e["world"] < WORLD or e["pid"] not in before]
    after = lab.wait_for(recovered, WAIT_S, "a step committed after the kill")
    assert isinstance(after, list)
    first = min(after, key=lambda e: e["t"])
    reached = max(e["step"] for e in events(out) if e["pid"] in before and e["t"] < first["t"])
    return {"recovery_s": first["t"] - killed_at,
            "lost_steps": float(max(0, reached - first["step"] + 1))}


def kill_step(lab: slurmlab.SlurmLab, step: str) -> Callable[[int], None]:
    def kill(i: int) -> None:
        for pid in lab.step_pids(step, i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return kill


def end_job(lab: slurmlab.SlurmLab, job: str) -> None:
    lab.run("scancel", job, check=False)
    with contextlib.suppress(slurmlab.LabError):
        lab.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED"], END_S)


def ftrun_sbatch(lab: slurmlab.SlurmLab, a: argparse.Namespace, out: Path,
                 env: dict[str, str]) -> Result:
    env = {**env, "FTRUN": f"{sys.executable} -m ftrun"}
    job = lab.sbatch(TRAIN_SBATCH, [f"--output={out / 'job.out'}"],
                     ["--nnodes", "2", "--nproc", "1", *worker("ftrun", out, a)], env=env)
    try:
        return observe(lab, out, a, kill_step(lab, f"{job}.0"))
    finally:
        end_job(lab, job)


def ftrun_by_hand(lab: slurmlab.SlurmLab, a: argparse.Namespace, out: Path,
                  env: dict[str, str]) -> Result:
    """The flags Slurm's allocation gave, given by hand; one ftrun per lab host."""
    flags = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"node0:{29400 + os.getpid() % 1000}", "--rdzv-id", f"hand-{out.name}"]
    procs = []
    for i in range(NODES):
        with open(out / f"node{i}.out", "w") as log:
            argv = lab.host_argv(i, [sys.executable, "-m", "ftrun", *flags,
                                     *worker("ftrun", out, a)])
            procs.append(subprocess.Popen(argv, env={**lab.env, **env}, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        return observe(lab, out, a, lambda i: kill_tree(procs[i]))
    finally:
        for p in procs:
            kill_tree(p)


def kill_tree(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(p.pid)
        for v in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.kill()
    p.wait(END_S)


def torchrun_srun(lab: slurmlab.SlurmLab, a: argparse.Namespace, out: Path,
                  env: dict[str, str]) -> Result:
    script = out / "torchrun.sbatch"
    script.write_text(TORCHRUN_SBATCH.format(
        python=sys.executable, port=29400 + os.getpid() % 1000 + 1,
        worker=" ".join(worker("ddp", out, a))))
    job = lab.sbatch(script, ["--nodes=2", f"--output={out / 'job.out'}"], env=env)
    try:
        return observe(lab, out, a, kill_step(lab, f"{job}.0"))
    finally:
        end_job(lab, job)


CASES: dict[str, Callable[..., Result]] = {
    "ftrun, sbatch + srun": ftrun_sbatch,
    "ftrun, by hand": ftrun_by_hand,
    "torchrun, srun -K1": torchrun_srun,
}


def report(a: argparse.Namespace, runs: dict[str, list[Result]], version: str) -> None:
    print(f"{version}, {NODES} lab hosts (namespaces on one 2-core machine), 2 training nodes "
          f"x 1 worker, ~10 M-param MLP, gloo; ftrun: + 1 spare node; one training node's "
          f"launcher and workers SIGKILLed after step {a.kill_after}; {a.rounds} rounds")
    print(f"{'':24}{'recovery (median)':>19}{'lost steps':>12}   recovery of each run")
    medians = {}
    for name, results in runs.items():
        rec = [r["recovery_s"] for r in results]
        medians[name] = statistics.median(rec)
        lost = statistics.median(r["lost_steps"] for r in results)
        print(f"{name:24}{medians[name]:>17.3f} s{lost:>12.0f}   "
              + " ".join(f"{x:.3f}" for x in rec))
    names = list(CASES)
    print(f"ftrun under Slurm / by hand: {medians[names[0]] / medians[names[1]]:.2f}; "
          f"torchrun's whole-step restart / ftrun under Slurm: "
          f"{medians[names[2]] / medians[names[0]]:.1f}x (plus its lost steps, redone)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100000, help="steps each run may train")
    a = ap.parse_args()
    why = slurmlab.unavailable()
    if why is not None:
        sys.exit(f"bench_slurm: no Slurm lab here: {why}")
    runs: dict[str, list[Result]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-slurm-", dir="/tmp") as root, \
            slurmlab.running(NODES, Path(root)) as lab:
        version = lab.run("sinfo", "--version").strip()
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
        for rnd in range(a.rounds):
            for k, (name, case) in enumerate(CASES.items()):
                out = lab.root / f"r{rnd}c{k}"
                out.mkdir()
                env["FTRUN_RUN_DIR"] = str(out / "run")
                runs[name].append(case(lab, a, out, env))
                print(f"round {rnd + 1}, {name}: {runs[name][-1]}", flush=True)
    report(a, runs, version)


if __name__ == "__main__":
    main()
