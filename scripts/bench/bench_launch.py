"""Launch and whole-group-restart latency: ftrun versus torchrun, same script, same run.

    python scripts/bench/bench_launch.py [--nproc 2] [--reps 3] [--timeout 60]

launch:  launcher started -> every rank finished its first all-reduce
restart: rank 1 crashes after its first all-reduce -> every rank's first all-reduce in the
         restarted attempt (a torchrun restart that hangs past --timeout counts as a hang)
ftrun runs twice: forking its workers from the zygote (the default) and with --no-zygote.
Prints medians per launcher and the ftrun/torchrun ratio (below 1 is better for ftrun).
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

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_worker.py")
LAUNCHERS = {
    "ftrun": [sys.executable, "-m", "ftrun"],
    "ftrun-exec": [sys.executable, "-m", "ftrun", "--no-zygote"],  # workers not forked
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def one(launcher: str, nproc: int, crash: bool, timeout: float) -> float | None:
    with tempfile.TemporaryDirectory() as out:
        cmd = [*LAUNCHERS[launcher], "--nproc-per-node", str(nproc),
               "--max-restarts", "1" if crash else "0", WORKER, out, "0" if crash else "-1"]
        # torchrun's restarts hang on gloo with its shared store (pytorch#135712)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        start = time.time()
        try:
            subprocess.run(cmd, env=env, timeout=timeout, capture_output=True)
        except subprocess.TimeoutExpired:
            return None  # a hung restart (see pytorch#135712); the launcher was killed
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    attempt = 1 if crash else 0
    firsts = [e["t"] for e in events if e["ev"] == "first_step" and e["attempt"] == attempt]
    if len(firsts) < nproc:
        return None
    origin = start if not crash else next(e["t"] for e in events if e["ev"] == "crash")
    return max(firsts) - origin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    results: dict[tuple[str, str], list[float | None]] = {}
    for _ in range(a.reps):
        for kind in ("launch", "restart"):
            for launcher in LAUNCHERS:  # interleaved, so both see the same machine load
                v = one(launcher, a.nproc, kind == "restart", a.timeout)
                results.setdefault((kind, launcher), []).append(v)
    print(f"nproc={a.nproc} reps={a.reps} (seconds, median of completed runs)")
    for kind in ("launch", "restart"):
        meds = {}
        for launcher in LAUNCHERS:
            vals = results[(kind, launcher)]
            done = [v for v in vals if v is not None]
            meds[launcher] = statistics.median(done) if done else float("nan")
            shown = [round(v, 3) if v else v for v in vals]
            print(f"  {kind:8s} {launcher:9s} median {meds[launcher]:7.3f}  "
                  f"completed {len(done)}/{len(vals)}  all {shown}")
        for ours in ("ftrun", "ftrun-exec"):
            if meds["torchrun"] == meds["torchrun"]:  # not NaN
                print(f"  {kind:8s} ratio {ours}/torchrun = "
                      f"{meds[ours] / meds['torchrun']:.2f}")
            else:  # every torchrun run hung: its latency is at least the timeout
                print(f"  {kind:8s} ratio {ours}/torchrun < {meds[ours] / a.timeout:.3f} "
                      f"(torchrun hung past {a.timeout:.0f}s in every run)")


if __name__ == "__main__":
    main()
