"""HSDP under ftrun (`--shard-size 2`) versus torchrun (FSDP2 HSDP over a (replicate, shard)
mesh), 4 ranks as 2 replica groups of 2, gloo on CPU, the same model, one invocation.

    python scripts/bench/bench_hsdp.py [--steps 60] [--kill-step 30] [--width 256] [--blocks 4]
                                 [--reps 3]

  step       median steady-state step time, fault-free (rank 0; the first quarter is warm-up),
             the median over --reps runs of each launcher, alternated
  recovery   ftrun, global rank 2 SIGKILLed at --kill-step: the fault -> the live group's next
             committed step (goal: <= one step time + 100 ms)
  rejoin     the fault -> the first commit with both groups again (a fresh group forked,
             healed shard by shard from the live one)
  spare      with --spares 1 (a hot spare group, its model already sharded): the same two
Prints the ftrun/torchrun step-time ratio (goal <= 1.05).
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
WORKER = os.path.join(HERE, "bench_hsdp_worker.py")


def run(kind: str, out: str, a: argparse.Namespace, kill: int = -1, log_dir: str = "",
        spares: int = 0) -> None:
    if kind == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--nproc", "4", "--shard-size", "2",
               "--spares", str(spares)]
        cmd += ["--log-dir", log_dir] if log_dir else []
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += [WORKER, "--mode", "ftrun" if kind == "ftrun" else "plain", "--out", out,
            "--steps", str(a.steps), "--kill-step", str(kill), "--width", str(a.width),
            "--blocks", str(a.blocks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run(cmd, env=env, timeout=900, check=True, capture_output=True)


def commits(out: str) -> list[dict[str, float]]:
    with open(os.path.join(out, "steps.jsonl")) as f:
        return sorted((json.loads(line) for line in f), key=lambda e: e["t"])


def _events(log_dir: str) -> list[dict[str, object]]:
    return [json.loads(line) for d in os.listdir(log_dir)
            for line in _lines(os.path.join(log_dir, d, "events.jsonl"))]


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def step_time(out: str) -> float:
    times = [e["t"] for e in commits(out) if e["rank"] == 0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps[len(gaps) // 4:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-step", type=int, default=30)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="fault-free runs of each launcher")
    a = ap.parse_args()
    runs: dict[str, list[float]] = {"torchrun": [], "ftrun": []}
    for _ in range(a.reps):  # alternated: load on the 2 cores drifts
        for kind in runs:
            with tempfile.TemporaryDirectory() as out:
                run(kind, out, a)
                runs[kind].append(step_time(out))
    steps = {kind: statistics.median(times) for kind, times in runs.items()}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as logs:
        run("ftrun", out, a, kill=a.kill_step, log_dir=logs, spares=1)
        events = _events(logs)
        fault = next(e for e in events if e["event"] == "fault")
        back = next(e for e in events if e["event"] == "recovered")
        spare_live = float(str(back["first_commit"])) - float(str(fault["detected_at"]))
        spare_full = next((str(e["text"]) for e in events if e["event"] == "notice" and
                           "back in service" in str(e["text"])), "no back-in-service notice")
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as logs:
        run("ftrun", out, a, kill=a.kill_step, log_dir=logs)
        events = _events(logs)
        fault_at = float(str(next(e for e in events if e["event"] == "fault")["detected_at"]))
        done = commits(out)
        live = next(e["t"] for e in done if e["t"] > fault_at and e["rank"] < 2)
        full = [e for e in events if e["event"] == "notice" and "back in service" in
                str(e["text"])]
        both = next((e["t"] for e in done if e["t"] > fault_at and e["rank"] >= 2), None)
    print(f"model: {a.blocks} transformer blocks of width {a.width}, 4 ranks as 2 x 2, "
          f"gloo on CPU")
    print(f"step time   torchrun HSDP {steps['torchrun'] * 1000:.1f} ms   ftrun --shard-size 2 "
          f"{steps['ftrun'] * 1000:.1f} ms   ratio {steps['ftrun'] / steps['torchrun']:.3f} "
          f"(goal <= 1.05; median of {a.reps} runs each: "
          f"{' '.join(f'{t * 1000:.0f}' for t in runs['torchrun'])} vs "
          f"{' '.join(f'{t * 1000:.0f}' for t in runs['ftrun'])} ms)")
    budget = steps["ftrun"] + 0.1
    print(f"recovery    the live group's next commit {(live - fault_at) * 1000:.0f} ms after the "
          f"fault (goal <= step + 100 ms = {budget * 1000:.0f} ms: "
          f"{'ok' if live - fault_at <= budget else 'missed'})")
    if both is not None:
        print(f"rejoin      {full[0]['text'] if full else 'no back-in-service notice'}; a fresh "
              f"rank's own first commit {(both - fault_at) * 1000:.0f} ms after the fault")
    print(f"spare group --spares 1: the live group's next commit {spare_live * 1000:.0f} ms "
          f"after the fault; {spare_full}")


if __name__ == "__main__":
    main()
