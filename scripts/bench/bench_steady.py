"""Steady-state step time of the GPT example: ftrun (buckets all-reduced during backward)
versus torchrun + DDP (same model, loop and bucket size), same machine.

    python scripts/bench/bench_steady.py [--nproc 2] [--steps 40] [--dim 256] [--layers 4]
                                   [--repeat 3] [--dtype bf16|fp32]

Each repeat runs ftrun and DDP back to back, in turns (ftrun first in odd pairs, DDP first in
even ones: a drift in the host's speed along the run favours neither), and prints each pair's
median step time (steps after the first quarter, rank 0) and ratio ftrun/DDP, then the median
ratio over the repeats. Both read their batches in-process (no reader processes), so the
ratio is about gradient sync, not data loading. Also printed: the peak resident memory of a
worker (the kernel's VmHWM, sampled while it runs), the share of a core that everything but
the workers used in the middle half of the workers' life (ftrun's agent and zygote;
torchrun's agent; the start and the end, where launchers are busy by design, left out), and
the load average around each pair: on this 2-core host a figure taken at a load above ~2.5
is noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SAMPLE_S = 0.25  # how often a running launcher's process tree is sampled
RUN_TIMEOUT_S = 1800  # one launcher invocation


def peak_rss_mb(pid: int) -> float:
    """The kernel's high-water mark of a process's resident size (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Watch:
    """Samples a launcher's process tree while it runs: each process's peak resident size
    and CPU seconds (a process's last moments are missed: at most SAMPLE_S of them)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.peak: dict[int, float] = {}  # pid -> MB
        self.samples: list[tuple[float, dict[int, float]]] = []  # (time, pid -> CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                root = psutil.Process(self.root_pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            cpu: dict[int, float] = {}
            for p in procs:
                try:
                    times = p.cpu_times()
                    # a zombie has no peak left: keep the highest seen
                    self.peak[p.pid] = max(peak_rss_mb(p.pid), self.peak.get(p.pid, 0.0))
                except (psutil.Error, OSError):
                    continue
                cpu[p.pid] = times.user + times.system
            self.samples.append((time.monotonic(), cpu))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * SAMPLE_S)

    def split(self, workers: set[int]) -> tuple[float, float]:
        """(the largest worker peak in MB, the share of a core that every process but the
        workers used in the middle half of the time all the workers were alive)."""
        peak = max((mb for pid, mb in self.peak.items() if pid in workers), default=0.0)
        alive = [(t, cpu) for t, cpu in self.samples if workers <= cpu.keys()]
        alive = alive[len(alive) // 4:len(alive) - len(alive) // 4]
        if len(alive) < 2:
            return peak, float("nan")
        (t1, cpu1), (t2, cpu2) = alive[0], alive[-1]
        rest = sum(v - cpu1.get(pid, 0.0) for pid, v in cpu2.items() if pid not in workers)
        return peak, rest / (t2 - t1)


def run_watched(cmd: list[str], env: dict[str, str]) -> Watch:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watch = Watch(proc.pid)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        watch.stop()
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        sys.stdout.write(out.decode(errors="replace")[-4000:])
        raise SystemExit(f"{cmd[:4]} failed with exit code {proc.returncode}")
    return watch


def read_logs(out: str) -> tuple[float, set[int]]:
    """Rank 0's median step time (ms, after the first quarter) and every worker's pid."""
    pids: set[int] = set()
    ms: list[float] = []
    for name in sorted(os.listdir(out)):
        if name.startswith("log_") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                doc = json.load(f)
            pids.add(int(doc["pid"]))
            if name == "log_0.json":
                ms = [e["ms"] for e in doc["log"]]
    return statistics.median(ms[len(ms) // 4:]), pids


def commands(a: argparse.Namespace) -> dict[str, list[str]]:
    model = ["--steps", str(a.steps), "--dim", str(a.dim), "--layers", str(a.layers),
             "--bucket-mb", str(a.bucket_mb), "--batch", str(a.batch), "--dtype", a.dtype]
    return {
        "ftrun": [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc),
                  os.path.join(ROOT, "examples", "train_gpt.py"), *model, "--workers", "0"],
        "ddp": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(a.nproc), os.path.join(HERE, "bench_steady_ddp.py"), *model],
    }


def one_pair(a: argparse.Namespace, ddp_first: bool) -> dict[str, tuple[float, float, float]]:
    """name -> (median step ms, worker peak MB, share of a core used outside the workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    results = {}
    runs = list(commands(a).items())
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd in reversed(runs) if ddp_first else runs:
            out = os.path.join(tmp, name)
            watch = run_watched([*cmd, "--out", out], env)
            ms, pids = read_logs(out)
            results[name] = (ms, *watch.split(pids))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    ap.add_argument("--repeat", type=int, default=1, help="ftrun/DDP pairs, alternating")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="autocast dtype (bf16 matmuls are slow on a CPU without bf16 units)")
    a = ap.parse_args()
    print(f"GPT dim {a.dim} x {a.layers} layers, {a.nproc} workers, bucket {a.bucket_mb} MB,"
          f" {a.dtype}, {a.steps} steps:", flush=True)
    ratios = []
    for i in range(a.repeat):
        load = os.getloadavg()[0]
        r = one_pair(a, ddp_first=i % 2 == 1)
        (ft_ms, ft_mb, ft_cpu), (ddp_ms, ddp_mb, ddp_cpu) = r["ftrun"], r["ddp"]
        ratios.append(ft_ms / ddp_ms)
        first = "DDP" if i % 2 else "ftrun"
        print(f"  [{i + 1}] {first} first, load {load:.2f}->{os.getloadavg()[0]:.2f}"
              f"  ftrun step {ft_ms:.1f} ms   torchrun+DDP step {ddp_ms:.1f} ms"
              f"   ratio ftrun/DDP {ratios[-1]:.3f}\n"
              f"      worker peak RSS: ftrun {ft_mb:.0f} MB, DDP {ddp_mb:.0f} MB;"
              f"  CPU outside the workers mid-run: ftrun {100 * ft_cpu:.1f}%,"
              f" torchrun {100 * ddp_cpu:.1f}% of a core",
              flush=True)
    if a.repeat > 1:
        print(f"  median ratio ftrun/DDP over {a.repeat} pairs: {statistics.median(ratios):.3f}"
              f"  (each: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
