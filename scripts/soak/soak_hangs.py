"""No false hang: a long run with a rank whose step time varies 5x at random and a 60 s long
phase, on the default (derived) hang timeout.

    python scripts/soak/soak_hangs.py [--minutes 10] [--step-time 0.03] [--long-at 600]
                                 [--long-s 60]

One ftrun job, 3 workers, gloo, tests/fixtures/hang_train.py without --hang-timeout: rank 1
sleeps step-time x U(1, 5) per step (`--vary 1:5`), and rank 0 spends --long-s seconds in
`ft.long_phase("eval")` after step --long-at while its peers wait for it in the next step's
all-reduce. `ftrun status` is sampled every second (with /proc/loadavg, since other work on
the machine stretches step times too); after --minutes the job is stopped (SIGTERM) and the
script prints the detections (hang notices and hang kills or rebuilds: must be 0), the fault
records, the steps committed and the hang timeout `ftrun status` showed over time. Exit 0 when
nothing was detected, no fault was recorded, the job ran throughout and the long phase was
seen in full.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from ftrun.adapters import control  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "fixtures", "hang_train.py")
NPROC = 3
SAMPLE_S = 1.0
STOP_S = 60.0  # the job's own --shutdown-timeout applies; this bounds the wait for it


@dataclass
class Samples:
    timeouts: list[tuple[float, float]] = field(default_factory=list)  # (t, hang_timeout_s)
    load: list[float] = field(default_factory=list)  # 1-minute load average
    step_ms: list[float] = field(default_factory=list)  # members' step time (EMA)
    long_seen: list[float] = field(default_factory=list)  # t while rank 0 was in 'eval'
    waited_s: float = 0.0  # the longest a peer was seen waiting in a collective
    last: dict[str, Any] = field(default_factory=dict)  # the last status document


def status() -> dict[str, Any] | None:
    try:
        return control.request(control.find_run(None), {"op": "status"})
    except Exception:  # not up yet, or between two answers: the next sample tells
        return None


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def sample(s: Samples, t: float) -> None:
    s.load.append(load1())
    doc = status()
    if doc is None:
        return
    s.last = doc
    if doc.get("hang_timeout_s"):
        s.timeouts.append((t, float(doc["hang_timeout_s"])))
    members = [w for w in doc.get("workers", []) if w["role"] == "member"]
    s.step_ms += [w["step_time_ms"] for w in members if w["step_time_ms"]]
    if any((w["phase"] or "").startswith("in long phase") for w in members):
        s.long_seen.append(t)
    for w in members:
        if (w["phase"] or "").startswith("in collective") and w["since_progress_s"]:
            s.waited_s = max(s.waited_s, float(w["since_progress_s"]))


def soak(a: argparse.Namespace, err_path: str) -> tuple[Samples, int | None, float]:
    """Run the job for a.minutes, sampling; (samples, its exit code if it ended early, the
    seconds it ran)."""
    job = subprocess.Popen(
        [sys.executable, "-m", "ftrun", "--nproc", str(NPROC), SCRIPT, "--steps", "100000000",
         "--step-time", str(a.step_time), "--vary", "1:5",
         "--long", f"0:{a.long_at}:{a.long_s:g}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(err_path, "w"))  # noqa: SIM115
    s, start = Samples(), time.monotonic()
    try:
        while time.monotonic() - start < a.minutes * 60 and job.poll() is None:
            sample(s, time.monotonic() - start)
            time.sleep(SAMPLE_S)
        early = job.poll()
        ran = time.monotonic() - start
    finally:
        if job.poll() is None:
            job.terminate()
        job.wait(STOP_S)
    return s, early, ran


def report(a: argparse.Namespace, s: Samples, early: int | None, ran: float,
           err: str) -> bool:
    faults = s.last.get("faults", [])
    notices = [ln for ln in err.splitlines() if ln.startswith("ftrun: hang:")]
    rebuilds = sum(f["decision"] == "rebuild" for f in faults)  # these print no notice
    detections = len(notices) + rebuilds
    steps = max((w["committed_step"] or 0 for w in s.last.get("workers", [])), default=0)
    derived = [v for t, v in s.timeouts if v < 300]
    warm = max((t for t, v in s.timeouts if v >= 300), default=0.0)
    long_s = (s.long_seen[-1] - s.long_seen[0] + SAMPLE_S) if s.long_seen else 0.0
    print(f"ftrun hang soak: {NPROC} workers, gloo on CPU, default hang timeout, {ran:.0f} s "
          f"({a.minutes:g} min asked)")
    ms = sorted(s.step_ms) or [0.0]
    print(f"  rank 1: step time x U(1, 5) on {a.step_time * 1000:.0f} ms; members' step time "
          f"(EMA, the long phase's wait included) median {ms[len(ms) // 2]:.0f} ms, "
          f"{ms[0]:.0f}..{ms[-1]:.0f} ms")
    print(f"  rank 0: ft.long_phase('eval') of {a.long_s:g} s after step {a.long_at}: seen in "
          f"status for ~{long_s:.0f} s; peers waited up to {s.waited_s:.1f} s in a collective")
    print(f"  hang timeout shown: 300 s (warm-up) until t={warm:.0f} s, then "
          + (f"min {min(derived):.2f} s, max {max(derived):.2f} s over {len(derived)} samples"
             if derived else "never derived"))
    print(f"  load average (1 min) during the run: min {min(s.load):.2f}, mean "
          f"{sum(s.load) / len(s.load):.2f}, max {max(s.load):.2f} on {os.cpu_count()} CPUs")
    print(f"  detections: {detections} (hang notices {len(notices)}, rebuilds {rebuilds})")
    print(f"  faults recorded: {len(faults)}")
    print(f"  steps committed: {steps}")
    for line in notices:
        print(f"    {line}")
    if early is not None:
        print(f"  the job ENDED early with exit code {early}; its stderr ends:\n"
              + "\n".join(err.splitlines()[-15:]))
    ok = (detections == 0 and not faults and early is None and steps > a.long_at
          and long_s >= a.long_s - 2 * SAMPLE_S)
    print("  verdict: " + ("no false positive" if ok else "FAILED"))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--step-time", type=float, default=0.03, help="rank 1's base extra "
                    "seconds per step (the others sleep this long)")
    ap.add_argument("--long-at", type=int, default=600, help="rank 0's long phase: after step")
    ap.add_argument("--long-s", type=float, default=60.0, help="rank 0's long phase: seconds")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ftrun_soak_")
    os.environ["FTRUN_RUN_DIR"] = os.path.join(work, "run")  # `status` finds this job only
    err_path = os.path.join(work, "ftrun.err")
    s, early, ran = soak(a, err_path)
    with open(err_path, errors="replace") as f:
        err = f.read()
    sys.exit(0 if report(a, s, early, ran, err) else 1)


if __name__ == "__main__":
    main()
