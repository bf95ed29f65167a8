"""A node cut off by its network, ftrun against torchrun: `bench_node_loss.py --partition`.

Each node is one launcher in a network namespace of its own on a private bridge
(tests/netlab.py; needs root). After every rank has committed --kill-after steps, the last
node's cable is pulled (its link on the bridge set down: its processes live on, cut off),
and put back --outage seconds later. Measured for ftrun (--nnodes N-1:N, nothing else set,
so a warm zygote serves the rejoining node):
  detection  the cut -> the coordinator publishing the generation without the node
  recovery   the cut -> the first step committed by the smaller job
  fenced     the cut -> every worker of the cut node gone (stopped by its own agent)
  rejoin     the link back -> the first step committed at full size again
torchrun (DDP, checkpoints every 10 steps, its default timeouts): the cut -> the first step
committed again by anyone, within --torchrun-cap seconds (its survivors wait in a gloo
collective; their agents see no worker fail). Every process is gone at the end.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from bench_procs import WORKER, kill_session  # noqa: E402

from tests import netlab  # noqa: E402

PORT = 29400


def launcher(kind: str, a: argparse.Namespace, lab: netlab.NetLab, out: str, i: int
             ) -> list[str]:
    rdzv = ["--nnodes", f"{a.nodes - 1}:{a.nodes}", "--nproc-per-node", str(a.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lab.addr(0)}:{PORT}",
            "--rdzv-id", "bench"]
    if kind == "torchrun":  # it knows a node by its host name, which is the host's here
        rdzv += ["--rdzv-conf", f"is_host={str(i == 0).lower()}", "--local-addr", lab.addr(i)]
    head = [sys.executable, "-m", "ftrun"] if kind == "ftrun" else [
        sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3"]
    log_dir = ["--log-dir", os.path.join(out, "logs")] if kind == "ftrun" else []
    return [*head, *rdzv, *log_dir, WORKER, "--mode", "ftrun" if kind == "ftrun" else "ddp",
            "--out", out, "--steps", "100000", "--batch", str(16 * a.nodes * a.nproc)]


def events(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def published_after(out: str, t: float) -> float | None:
    """When the coordinator published the first generation after `t` (its journal)."""
    for path in glob.glob(os.path.join(out, "logs", "**", "events.jsonl"), recursive=True):
        with open(path) as f:
            for line in f:
                ev = json.loads(line)
                if ev.get("event") == "generation" and float(ev.get("published_at", 0)) > t:
                    return float(ev["published_at"])
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    return None


def measure(kind: str, a: argparse.Namespace) -> dict[str, float | str]:
    with netlab.NetLab(a.nodes) as lab, tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
               "LOGLEVEL": "ERROR"}
        procs = []
        try:
            for i in range(a.nodes):
                log = open(os.path.join(out, f"launcher{i}.log"), "w")  # noqa: SIM115
                procs.append(subprocess.Popen(
                    lab.wrap(i, launcher(kind, a, lab, out, i)),
                    env={**env, "FTRUN_RUN_DIR": os.path.join(out, f"run{i}")},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                if i == 0:
                    time.sleep(1.0)  # the first node serves the store
            return observe(kind, a, lab, out, procs)
        finally:
            for p in procs:
                kill_session(p)


def observe(kind: str, a: argparse.Namespace, lab: netlab.NetLab, out: str,
            procs: list[subprocess.Popen]) -> dict[str, float | str]:
    world = a.nodes * a.nproc
    ready = wait_until(lambda: len({e["rank"] for e in events(out) if e["ev"] == "step"
                                    and e["step"] >= a.kill_after}) == world, a.timeout)
    if not ready:
        return {"error": "never reached the cut step"}
    inside = set(subprocess.run(["ip", "netns", "pids", lab.ns(a.nodes - 1)], text=True,
                                capture_output=True, timeout=10).stdout.split())
    victims = {e["pid"] for e in events(out) if e["ev"] == "step" and str(e["pid"]) in inside}
    cut_at = time.time()
    lab.cut(a.nodes - 1)
    if kind == "torchrun":
        again = wait_until(lambda: [e for e in events(out) if e["ev"] == "step"
                                    and e["t"] > cut_at + 1.0], a.torchrun_cap)
        lab.restore(a.nodes - 1)
        if not again:
            return {"stalled_s": a.torchrun_cap}
        return {"recovery_s": min(e["t"] for e in again) - cut_at}
    smaller = wait_until(lambda: [e for e in events(out) if e["ev"] == "step"
                                  and e["world"] < world and e["t"] > cut_at], a.timeout)
    fenced = wait_until(lambda: not any(alive(p) for p in victims), a.timeout)
    fenced_s = time.time() - cut_at if fenced else float("nan")
    time.sleep(max(0.0, cut_at + a.outage - time.time()))
    back_at = time.time()
    lab.restore(a.nodes - 1)
    full = wait_until(lambda: [e for e in events(out) if e["ev"] == "step"
                               and e["world"] == world and e["t"] > back_at], a.timeout)
    if not smaller or not full:
        return {"error": "the job did not shrink" if not smaller else "the node never rejoined"}
    published = published_after(out, cut_at)
    return {"detection_s": (published - cut_at) if published else float("nan"),
            "recovery_s": min(e["t"] for e in smaller) - cut_at, "fenced_s": fenced_s,
            "rejoin_s": min(e["t"] for e in full) - back_at}


def report(a: argparse.Namespace) -> None:
    # SIGTERM (a timeout, a Ctrl-C of a wrapper) unwinds: the namespaces and processes go
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    why = netlab.unavailable()
    if why is not None:
        sys.exit(f"bench_node_loss.py --partition: cannot make network namespaces ({why})")
    ft = measure("ftrun", a) if a.only != "torchrun" else {"error": "not measured (--only)"}
    tr = measure("torchrun", a) if a.only != "ftrun" else {"error": "not measured (--only)"}
    print(f"{a.nodes} nodes x {a.nproc} workers, each in its own network namespace (c10d), "
          f"gloo, ~10 M-param MLP; the last node's link cut after step {a.kill_after}, "
          f"back {a.outage:g} s later")
    if "error" in ft:
        print(f"ftrun   : {ft['error']}")
    else:
        print(f"ftrun   : detection {ft['detection_s']:.2f} s (goal <= 1.5), recovery "
              f"{ft['recovery_s']:.2f} s, cut node's workers stopped {ft['fenced_s']:.2f} s "
              f"(goal <= 12), rejoin to a full-size commit {ft['rejoin_s']:.2f} s (goal <= 5)")
    if "error" in tr:
        print(f"torchrun: {tr['error']}")
    elif "stalled_s" in tr:
        print(f"torchrun: no step committed within {tr['stalled_s']:.0f} s of the cut "
              f"(--torchrun-cap)")
    else:
        print(f"torchrun: first step committed again {tr['recovery_s']:.2f} s after the cut")
    if "error" not in ft and "error" not in tr:
        theirs = float(tr.get("stalled_s", tr.get("recovery_s", 0.0)))
        bound = ">= " if "stalled_s" in tr else ""
        print(f"ratio ftrun/torchrun recovery {float(ft['recovery_s']) / theirs:.4f} "
              f"(ftrun {bound}{theirs / float(ft['recovery_s']):.0f}x faster)")
