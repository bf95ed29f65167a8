"""Recovery latency, lost work and steady-state step time: ftrun versus torchrun, same model,
same machine, one invocation.

    python scripts/bench/bench_recovery.py [--nproc 4] [--steps 60] [--kill-step 35]

Per ftrun policy (replace with a hot spare, shrink, replace with no spare: a worker forked
from the zygote, and the same with --no-zygote: a new process importing torch) and for
torchrun (DDP, checkpoint every 10 steps, --max-restarts 1, restart from the checkpoint):
  recovery  kill -> the first commit of the killed step or a later one (any rank)
  lost      committed steps computed twice by a rank (torchrun: kill step - last checkpoint)
  step      median steady-state step time of a fault-free run (ftrun API vs DDP)
and each as an ftrun/torchrun ratio. torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
with its default shared store its restarts hang on gloo (pytorch#135712), see bench_launch.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bench_recovery_worker.py")


OMP_THREADS = ["1"]  # --omp-threads: each worker's OMP_NUM_THREADS


def launch(kind: str, nproc: int, flags: list[str], steps: int, kill: int, out: str) -> None:
    if kind == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(nproc), *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--max-restarts", "1"]
    cmd += [WORKER, "--mode", "ftrun" if kind == "ftrun" else "ddp", "--out", out,
            "--steps", str(steps), "--kill-step", str(kill)]
    env = {**os.environ, "OMP_NUM_THREADS": OMP_THREADS[0], "LOGLEVEL": "ERROR",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run(cmd, env=env, timeout=900, check=True, capture_output=True)


def measure(kind: str, nproc: int, flags: list[str], steps: int, kill: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        launch(kind, nproc, flags, steps, kill, out)
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    commits = sorted((e for e in events if e["ev"] == "step"), key=lambda e: e["t"])
    first_rank = [e for e in commits if e["rank"] == 0]
    gaps = [b["t"] - a["t"] for a, b in zip(first_rank, first_rank[1:], strict=False)]
    result = {"step_s": statistics.median(gaps[len(gaps) // 4:])}
    kills = [e for e in events if e["ev"] == "kill"]
    if kills:
        k = kills[0]
        after = [e for e in commits if e["t"] > k["t"] and e["step"] >= k["step"]]
        result["recovery_s"] = after[0]["t"] - k["t"]
        # committed work done twice: a (rank, step) committed more than once
        seen: dict[int, list[int]] = {}
        for e in commits:
            seen.setdefault(e["rank"], []).append(e["step"])
        result["lost_steps"] = float(max(len(v) - len(set(v)) for v in seen.values()))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-step", type=int, default=35)
    ap.add_argument("--omp-threads", type=int, default=1,
                    help="each worker's OMP_NUM_THREADS (the zygote imports with 1 whatever it is)")
    a = ap.parse_args()
    OMP_THREADS[0] = str(a.omp_threads)
    n, s, k = a.nproc, a.steps, a.kill_step
    steady_ft = measure("ftrun", n, [], s, -1)["step_s"]
    steady_tr = measure("torchrun", n, [], s, -1)["step_s"]
    torchrun = measure("torchrun", n, [], s, k)
    rows = {
        "replace + hot spare": measure("ftrun", n, ["--spares", "1"], s, k),
        "shrink": measure("ftrun", n, ["--on-fault", "shrink"], s, k),
        "replace, no spare": measure("ftrun", n, [], s, k),
        "ditto, --no-zygote": measure("ftrun", n, ["--no-zygote"], s, k),
    }
    print(f"{n} workers (OMP_NUM_THREADS={a.omp_threads}), gloo on CPU, {s} steps, SIGKILL of "
          f"rank 1 at step {k}; "
          f"torchrun: DDP, checkpoint every 10 steps, whole-group restart")
    print(f"steady-state step: ftrun {steady_ft * 1000:.1f} ms, torchrun+DDP "
          f"{steady_tr * 1000:.1f} ms, ratio {steady_ft / steady_tr:.3f}")
    print(f"torchrun: recovery {torchrun['recovery_s']:.3f} s, "
          f"lost {torchrun['lost_steps']:.0f} steps")
    for name, r in rows.items():
        print(f"ftrun {name:20s}: recovery {r['recovery_s']:.3f} s "
              f"(ftrun/torchrun {r['recovery_s'] / torchrun['recovery_s']:.4f}, "
              f"{torchrun['recovery_s'] / r['recovery_s']:.0f}x faster), "
              f"lost {r['lost_steps']:.0f} steps")


if __name__ == "__main__":
    main()
