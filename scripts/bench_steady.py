"""Steady-state step time of the GPT example: ftrun (buckets all-reduced during backward)
versus torchrun + DDP (same model, loop and bucket size), one invocation, same machine.

    python scripts/bench_steady.py [--nproc 2] [--steps 40] [--dim 256] [--layers 4]

Prints the median step time of each (steps after the first quarter, rank 0) and the ratio
ftrun/DDP. Both read their batches in-process (no reader processes), so the ratio is about
gradient sync, not data loading.
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
ROOT = os.path.dirname(HERE)


def median_ms(out: str) -> float:
    with open(os.path.join(out, "log_0.json")) as f:
        ms = [e["ms"] for e in json.load(f)["log"]]
    return statistics.median(ms[len(ms) // 4:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    a = ap.parse_args()
    model = ["--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers),
             "--bucket-mb", str(a.bucket_mb), "--batch", str(a.batch)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "ftrun": [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc),
                      os.path.join(ROOT, "examples", "train_gpt.py"), *model, "--workers", "0"],
            "ddp": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(a.nproc), os.path.join(HERE, "bench_steady_ddp.py"), *model],
        }
        for name, cmd in runs.items():
            out = os.path.join(tmp, name)
            subprocess.run([*cmd, "--out", out], env=env, check=True, timeout=1800,
                           capture_output=True)
            results[name] = median_ms(out)
    print(f"GPT dim {a.dim} x {a.layers} layers, {a.nproc} workers, bucket {a.bucket_mb} MB:")
    print(f"  ftrun step {results['ftrun']:.1f} ms   torchrun+DDP step {results['ddp']:.1f} ms"
          f"   ratio ftrun/DDP {results['ftrun'] / results['ddp']:.3f}")


if __name__ == "__main__":
    main()
