"""Detection latency per fault kind: fault -> the agent knows (and recovery -> first commit).

    python scripts/bench_detection.py [--reps 3] [--hang-timeout 1.0]

One ftrun job (3 workers, gloo, simulated GPUs) is drilled through `ftrun inject-fault`,
kind by kind, `--reps` times each; the medians of the `detected` phase and of the whole
recovery come from `ftrun status --json`. Detection of a hang is bounded below by
--hang-timeout by design. torchrun has no counterpart for most rows: it sees process exits
only (by polling every --monitor-interval, 0.1 s), a SIGSTOPped or stuck worker only when the
collective times out (gloo's default: 30 min), and no GPU fault at all.
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

FT_TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                        "ft_train.py")
DRILLS = [("kill", ["--rank", "1", "--kind", "kill"]),
          ("segv", ["--rank", "1", "--kind", "segv"]),
          ("hang (SIGSTOP)", ["--rank", "1", "--kind", "hang"]),
          ("stuck outside the all-reduce", ["--rank", "1", "--kind", "slow", "--delay", "1000"]),
          ("comm failure", ["--rank", "1", "--kind", "comm"]),
          ("GPU XID 79", ["--gpu", "GPU", "--kind", "xid", "--xid", "79"])]


def ftrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ftrun", *args], capture_output=True,
                          text=True, timeout=180)


def status() -> dict:
    return json.loads(ftrun("status", "--json").stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hang-timeout", type=float, default=1.0)
    a = ap.parse_args()
    os.environ["FTRUN_RUN_DIR"] = tempfile.mkdtemp(prefix="ftrun_bench_")
    gpus = 3 + len(DRILLS) * a.reps
    job = subprocess.Popen(
        [sys.executable, "-m", "ftrun", "--nproc", "3", "--gpu-backend", "sim",
         "--spares", "0", "--hang-timeout", str(a.hang_timeout), FT_TRAIN,
         "--steps", "10000000", "--step-time", "0.01"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_SIM_GPUS": str(gpus)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = ftrun("status", "--json")
            if r.returncode == 0 and all((w["step"] or 0) > 5 for w in json.loads(r.stdout)
                                         ["workers"]):
                break
            time.sleep(0.2)
        for _ in range(a.reps):
            for name, args in DRILLS:
                if "GPU" in args:  # the GPU rank 1 uses now
                    rank1 = next(w for w in status()["workers"] if w["rank"] == 1)
                    args = [x if x != "GPU" else str(int(rank1["gpu"][-12:])) for x in args]
                before = len(status()["faults"])
                ftrun("inject-fault", *args)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    faults = status()["faults"]
                    if len(faults) > before and faults[-1]["recovered"]:
                        break
                    time.sleep(0.1)
                f = status()["faults"][-1]
                rows.setdefault(name, []).append((f["phases_ms"].get("detected", float("nan")),
                                                  f["recovery_ms"] or float("nan")))
    finally:
        job.terminate()
        job.wait(timeout=60)
    print(f"ftrun detection latency, 3 workers, gloo on CPU, --hang-timeout {a.hang_timeout}s, "
          f"{a.reps} runs each (median ms)")
    for name, vals in rows.items():
        det = statistics.median(v[0] for v in vals)
        rec = statistics.median(v[1] for v in vals)
        print(f"  {name:30s} detected {det:8.1f}   recovered (first commit) {rec:8.1f}   "
              f"all detected {[round(v[0]) for v in vals]}")
    print("(a replacement without a spare pays python + torch start-up, which dominates "
          "'recovered')")


if __name__ == "__main__":
    main()
