"""One etcd member lost under a running job: training must not notice.

    python scripts/bench/bench_etcd_member.py [--nodes 2] [--reps 2] [--kill-after 100]
        [--window 80]

A real 3-member etcd on loopback (tests/etcdlab.py); `--nodes` ftrun agents with
`--rdzv-backend etcd`, one worker each (scripts/bench/bench_recovery_worker.py: ~10 M-parameter
MLP, gloo). Runs alternate: a run whose etcd raft leader is SIGKILLed once every rank has
committed `--kill-after` steps, and a run without a kill, `--reps` of each. Within each run,
the mean step time of rank 0 over the `--window` steps after that point (the kill, or the
same step without one) against its own over as many steps before it (after the first
`WARM_STEPS`): `in_run` = after / before, a ratio a busy host moves on both sides (issue #52:
measured within one run, not across runs). Printed: every run; the median `in_run` of the
killed runs and of the calm ones (the host's own drift over a run) and their quotient (the
goal: within 2% of 1); the medians of the step times across runs, as before; and the
generations after the first that the killed runs published (a fault makes one; goal: none).
etcd's own election after the kill happens inside the window.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from bench_procs import WORKER, kill_session, kill_strays, read_events  # noqa: E402


def job(a: argparse.Namespace, endpoints: str, run_id: str, out: str) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--nnodes", str(a.nodes), "--nproc-per-node", "1",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", run_id,
            "--local-addr", "127.0.0.1", WORKER, "--mode", "ftrun", "--out", out,
            "--steps", str(a.kill_after + a.window + 10), "--batch", str(16 * a.nodes)]


WARM_STEPS = 20  # the first steps (imports, allocator, the first rebuild) are not steady


def step_times(out: str, rank: int, first: int, count: int) -> float:
    """Mean seconds per step of `rank` from step `first` over `count` steps."""
    t = {int(e["step"]): float(e["t"]) for e in read_events(out)
         if e["ev"] == "step" and int(e["rank"]) == rank}
    return (t[first + count] - t[first]) / count


def one_run(a: argparse.Namespace, lab: object, run_id: str, kill: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = []
        for i in range(a.nodes):
            log = open(os.path.join(out, f"launcher{i}.log"), "w")  # noqa: SIM115
            procs.append(subprocess.Popen(
                job(a, lab.endpoints, run_id, out),  # type: ignore[attr-defined]
                env={**env, "FTRUN_RUN_DIR": os.path.join(out, f"run{i}")}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
            if i == 0:
                time.sleep(1.0)  # first in line: elected
        try:
            return _observe(a, lab, out, procs, kill)
        finally:
            for p in procs:
                kill_session(p)
            kill_strays(out)


def _observe(a: argparse.Namespace, lab: object, out: str,
             procs: list[subprocess.Popen[bytes]], kill: bool) -> dict[str, object]:
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        ranks = {int(e["rank"]) for e in read_events(out)
                 if e["ev"] == "step" and e["step"] >= a.kill_after}
        if len(ranks) == a.nodes:
            break
        time.sleep(0.05)
    else:
        return {"error": "never reached the kill step"}
    victim = None
    if kill:
        victim = lab.raft_leader()  # type: ignore[attr-defined]
        lab.kill(victim)  # type: ignore[attr-defined]
    for p in procs:
        p.wait(a.timeout)
    if victim is not None:
        lab.restart(victim)  # type: ignore[attr-defined]
    logs = "".join(Path(out, f"launcher{i}.log").read_text() for i in range(a.nodes))
    worlds = {int(e["world"]) for e in read_events(out) if e["ev"] == "step"}
    first = max(WARM_STEPS, a.kill_after - a.window)
    after, before = (step_times(out, 0, a.kill_after, a.window),
                     step_times(out, 0, first, a.kill_after - first))
    return {"step_s": after, "before_s": before, "in_run": round(after / before, 4),
            "codes": [p.returncode for p in procs], "worlds": sorted(worlds),
            "new_generations": logs.count("ftrun: generation ")}  # each fault makes one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kill-after", type=int, default=100)
    ap.add_argument("--window", type=int, default=80)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    from etcdlab import EtcdLab

    rows: dict[bool, list[float]] = {False: [], True: []}
    in_run: dict[bool, list[float]] = {False: [], True: []}
    with EtcdLab() as lab:
        for rep in range(a.reps):
            for kill in (True, False):
                r = one_run(a, lab, f"member{rep}{int(kill)}", kill)
                print(json.dumps({"kill": kill, **r}), flush=True)
                if "error" not in r and r["codes"] == [0] * a.nodes:
                    rows[kill].append(float(r["step_s"]))  # type: ignore[arg-type]
                    in_run[kill].append(float(r["in_run"]))  # type: ignore[arg-type]
    if rows[True] and rows[False]:
        killed, calm = statistics.median(rows[True]), statistics.median(rows[False])
        print(f"{a.nodes} agents x 1 worker, etcd raft leader SIGKILLed after step "
              f"{a.kill_after}: step time over the next {a.window} steps {killed * 1e3:.1f} ms "
              f"vs {calm * 1e3:.1f} ms without a kill (ratio across runs {killed / calm:.3f})")
        k_in, c_in = statistics.median(in_run[True]), statistics.median(in_run[False])
        print(f"within each run, after / before the point: {k_in:.3f} killed (runs: "
              f"{', '.join(f'{x:.3f}' for x in in_run[True])}), {c_in:.3f} calm (runs: "
              f"{', '.join(f'{x:.3f}' for x in in_run[False])}); killed / calm "
              f"{k_in / c_in:.3f}")


if __name__ == "__main__":
    main()
