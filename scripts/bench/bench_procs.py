"""What the node-loss benchmarks share (bench_node_loss, bench_partition, bench_etcd_member):
the worker they run, a launcher tree killed as a host failure would kill it, and the workers'
event log. Imports no other benchmark, so none imports another in a circle (#49).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bench_recovery_worker.py")


def read_events(out: str) -> list[dict[str, float]]:
    """The workers' events (bench_recovery_worker's events.jsonl in `out`); [] before any."""
    try:
        with open(os.path.join(out, "events.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def kill_strays(out: str) -> None:
    """Workers a launcher started in sessions of their own (torchrun does) go too: every
    process whose command line names `out`."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(out in arg for arg in proc.info["cmdline"] or ()):
                proc.kill()


def kill_session(p: subprocess.Popen[bytes]) -> None:
    """The launcher and every process under it (torchrun's workers run in sessions of their
    own and would outlive it), at once, as a host failure would."""
    import psutil

    try:
        victims = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        victims = []
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)
