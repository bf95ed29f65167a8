"""The launcher side's CPU while the workers train: ftrun's agent and zygote versus torchrun's
agent, over a long window of steady steps (after start-up), per process and per interval.

    python scripts/bench/bench_steady_launcher.py [--launcher ftrun|torchrun|both] [--nproc 2]
                                            [--warmup 20] [--window 60] [--every 10]

Starts the GPT example of `bench_steady.py` (fp32, many steps) under the launcher, waits
`--warmup` seconds after every worker is up, then reads each process's CPU seconds every
`--every` seconds for `--window` seconds and prints the share of a core each non-worker
process used in each interval and over the window, then stops the run (SIGINT, then SIGKILL
of what is left). A worker is a process running the training script; everything else in the
launcher's tree (agent, zygote, torchrun's agent) is the launcher side. A steady cost shows
in every interval; a start-up burst only in the first.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STOP_S = 30.0  # the launcher ending after SIGINT, before SIGKILL
START_S = 300.0  # every worker started


def command(launcher: str, a: argparse.Namespace, out: str) -> list[str]:
    model = ["--steps", "100000", "--dim", str(a.dim), "--layers", str(a.layers),
             "--bucket-mb", "1.0", "--batch", "32", "--dtype", "fp32", "--out", out]
    if launcher == "ftrun":
        return [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc),
                os.path.join(ROOT, "examples", "train_gpt.py"), *model, "--workers", "0"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
            os.path.join(HERE, "bench_steady_ddp.py"), *model]


def tree(root: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [root, *root.children(recursive=True)]
    return []


def names(root: psutil.Process) -> dict[int, str]:
    """pid -> "agent" (the launcher itself), "zygote" (the first process running ftrun's
    zygote: the workers it forks keep its command line) or "worker" (the rest)."""
    procs = tree(root)
    zygotes = []
    for p in procs[1:]:
        with contextlib.suppress(psutil.Error):
            if "worker.zygote" in " ".join(p.cmdline()):
                zygotes.append((p.create_time(), p.pid))
    out = {p.pid: "worker" for p in procs[1:]}
    if zygotes:
        out[min(zygotes)[1]] = "zygote"
    return {**out, root.pid: "agent"}


def cpu_of(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system  # its own threads, not its children
    return out


def wait_for_workers(root: psutil.Process, n: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if sum(1 for name in names(root).values() if name == "worker") >= n:
            return
        time.sleep(0.5)
    raise SystemExit("the workers did not start")


def measure(launcher: str, a: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(command(launcher, a, os.path.join(tmp, "out")), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        root = psutil.Process(proc.pid)
        try:
            wait_for_workers(root, a.nproc)
            time.sleep(a.warmup)
            named = names(root)
            procs = [p for p in tree(root) if named.get(p.pid, "worker") != "worker"]
            t0, c0 = time.monotonic(), cpu_of(procs)
            first_t, first_c = t0, c0
            load0 = os.getloadavg()[0]
            while time.monotonic() - first_t < a.window:
                time.sleep(a.every)
                t1, c1 = time.monotonic(), cpu_of(procs)
                row = "  ".join(f"{named[p]} {100 * (c1[p] - c0.get(p, c1[p])) / (t1 - t0):5.2f}%"
                                for p in c1)
                print(f"  {launcher} [{t1 - first_t:5.1f} s] {row}", flush=True)
                t0, c0 = t1, c1
            whole = "  ".join(
                f"{named[p]} {100 * (c0[p] - first_c.get(p, c0[p])) / (t0 - first_t):5.2f}%"
                for p in c0)
            total = sum(c0[p] - first_c.get(p, c0[p]) for p in c0) / (t0 - first_t)
            print(f"{launcher}: over {t0 - first_t:.0f} s (load {load0:.2f}->"
                  f"{os.getloadavg()[0]:.2f}): {whole}; launcher side {100 * total:.2f}% "
                  "of a core", flush=True)
        finally:
            stop(proc, tree(root))


def stop(proc: subprocess.Popen[bytes], procs: list[psutil.Process]) -> None:
    """SIGINT the launcher, then SIGKILL whatever of its tree is left (ftrun's workers lead
    process groups of their own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_S)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", choices=["ftrun", "torchrun", "both"], default="both")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds after start-up")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=10.0)
    a = ap.parse_args()
    for launcher in (["ftrun", "torchrun"] if a.launcher == "both" else [a.launcher]):
        measure(launcher, a)


if __name__ == "__main__":
    main()
