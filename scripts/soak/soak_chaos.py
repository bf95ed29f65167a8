"""Chaos soak: a training job under `ftrun inject-fault --chaos` for --minutes, against a
fault-free run of the same steps.

    python scripts/soak/soak_chaos.py [--minutes 30] [--every 20] [--seed 1] [--kinds a,b]
                                 [--hang-timeout 2] [--nproc 4] [--spares 1] [--json]

1. The chaos run: soak_chaos_worker.py (bench_recovery_worker.py's ~10 M parameter model)
   under `ftrun --nproc 4 --spares 1 --hang-timeout 2` (replace mode). Once it trains,
   `ftrun inject-fault --chaos --every E --duration 60*minutes --seed S` runs to its end;
   then the job is told to stop at a step a little ahead of all ranks.
2. The fault-free run: the same job with --steps set to that step, no fault.

Prints: goodput (fault-free wall / chaos wall, each from the commit of step 0 to that of the
last step), the chaos summary per kind (recovery p50/p95/max, time lost), committed steps
lost (`ftrun report`'s count), whether every final replica of the chaos run is bitwise equal
to the fault-free run's rank 0, and the agent's and the zygote's memory (RSS), open fds and
threads when the chaos starts and when it ends (psutil). Exit 0 when every fault recovered,
no committed step was lost and the replicas are bitwise equal.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from ftrun.adapters import control  # noqa: E402
from ftrun.cli import runreport  # noqa: E402

WORKER = os.path.join(ROOT, "scripts", "soak", "soak_chaos_worker.py")
START_S = 300.0  # the job imports torch and forms its group (minutes on a loaded host)
END_AHEAD = 20  # the chaos run stops this many steps past the furthest rank
STOP_S = 300.0  # a run finishes its last steps and the members save their parameters


def launch(a: argparse.Namespace, out: str, steps: int | None, end_file: str
           ) -> subprocess.Popen[bytes]:
    extra = ["--steps", str(steps)] if steps else ["--end-file", end_file]
    return subprocess.Popen(
        [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), "--spares", str(a.spares),
         "--hang-timeout", str(a.hang_timeout), "--log-dir", os.path.join(out, "logs"),
         WORKER, "--out", out, *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(out, "ftrun.err"), "w"))  # noqa: SIM115


def status() -> dict[str, Any] | None:
    try:
        return control.request(control.find_run(None), {"op": "status"})
    except Exception:  # not up yet, or ended: the caller's deadline decides
        return None


def wait_training(a: argparse.Namespace, job: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and job.poll() is None:
        doc = status()
        members = [w for w in (doc or {}).get("workers", []) if w["role"] == "member"]
        if doc and len(members) == a.nproc and all((w["step"] or 0) > 3 for w in members):
            return doc
        time.sleep(1.0)
    raise SystemExit(f"the chaos job did not start training within {START_S:g} s")


def resources(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The agent's and the zygote's RSS (MB), open fds and threads."""
    pids = {"agent": doc["pid"], "zygote": (doc.get("zygote") or {}).get("pid")}
    out = {}
    for name, pid in pids.items():
        if pid is None:
            continue
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                out[name] = {"rss_mb": round(p.memory_info().rss / 2**20, 1),
                             "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.Error:
            continue
    return out


def chaos_run(a: argparse.Namespace, out: str) -> dict[str, Any]:
    end_file = os.path.join(out, "end")
    job = launch(a, out, None, end_file)
    try:
        before = resources(wait_training(a, job))
        cmd = [sys.executable, "-m", "ftrun", "inject-fault", "--chaos", "--every",
               str(a.every), "--duration", str(a.minutes * 60), "--seed", str(a.seed)]
        chaos = subprocess.run(cmd + (["--kinds", a.kinds] if a.kinds else []),
                               capture_output=True, text=True, timeout=a.minutes * 60 + 600)
        doc = status() or {}
        after = resources(doc) if doc else {}
        furthest = max((w["step"] or 0 for w in doc.get("workers", [])), default=0)
        with open(end_file, "w") as f:
            f.write(str(furthest + END_AHEAD))
        code = job.wait(STOP_S)
    finally:
        if job.poll() is None:
            job.terminate()
            job.wait(60)
    run_dir = runreport.find_run_dir(os.path.join(out, "logs"))
    return {"chaos_rc": chaos.returncode, "chaos_out": chaos.stdout + chaos.stderr,
            "job_rc": code, "steps": furthest + END_AHEAD, "before": before, "after": after,
            "report": runreport.build_report(runreport.load_run(run_dir))}


def wall_s(out: str, last_step: int) -> float:
    """From the first commit of step 0 to the last commit of the last step."""
    with open(os.path.join(out, "steps.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    t0 = min(x["t"] for x in lines if x["step"] == 0)
    t1 = max(x["t"] for x in lines if x["step"] == last_step)
    return t1 - t0


def replicas_equal(chaos_out: str, calm_out: str) -> tuple[bool, int]:
    """Every final replica of the chaos run equals the fault-free run's rank 0, bit for bit."""
    ref = torch.load(os.path.join(calm_out, "params_0.pt"))
    names = [n for n in os.listdir(chaos_out) if n.startswith("params_") and n.endswith(".pt")]
    equal = all(_bitwise(ref, torch.load(os.path.join(chaos_out, n))) for n in names)
    return equal and bool(names), len(names)


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default="", help="default: every kind the job supports")
    ap.add_argument("--hang-timeout", type=float, default=2.0)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ftrun_chaos_soak_")
    os.environ["FTRUN_RUN_DIR"] = os.path.join(work, "run")  # `status` finds these jobs only
    chaos_out, calm_out = os.path.join(work, "chaos"), os.path.join(work, "calm")
    os.makedirs(chaos_out)
    os.makedirs(calm_out)
    load = [os.getloadavg()[0]]  # the walls compare only on a machine equally busy in both
    res = chaos_run(a, chaos_out)
    load.append(os.getloadavg()[0])
    calm = launch(a, calm_out, res["steps"], "")
    calm_rc = calm.wait(a.minutes * 60 * 2 + STOP_S)
    res["load"] = [*load, os.getloadavg()[0]]
    print_figures(a, res, calm_rc, chaos_out, calm_out, work)


def print_figures(a: argparse.Namespace, res: dict[str, Any], calm_rc: int, chaos_out: str,
                  calm_out: str, work: str) -> None:
    last = res["steps"] - 1
    chaos_wall, calm_wall = wall_s(chaos_out, last), wall_s(calm_out, last)
    equal, replicas = replicas_equal(chaos_out, calm_out)
    s = res["report"]["summary"]
    print(f"ftrun chaos soak: {a.nproc} workers + {a.spares} spare, --hang-timeout "
          f"{a.hang_timeout:g}, chaos for {a.minutes:g} min (--every {a.every:g}, seed "
          f"{a.seed}), {res['steps']} steps on {os.cpu_count()} CPUs; files in {work}")
    print(res["chaos_out"].rstrip())
    print(f"  goodput (fault-free wall / chaos wall): {calm_wall:.1f} s / {chaos_wall:.1f} s "
          f"= {calm_wall / chaos_wall:.4f} (1-minute load average at the chaos run's start, "
          f"its end, the fault-free run's end: {', '.join(f'{x:.1f}' for x in res['load'])})")
    print(f"  faults {s['faults']}, recovered {s['recovered']}; committed steps lost "
          f"{s['lost_steps']} (ftrun report, whole run: goodput {s['goodput']})")
    print(f"  final replicas bitwise equal to the fault-free run: {equal} ({replicas} "
          f"replicas); exit codes: chaos job {res['job_rc']}, fault-free job {calm_rc}")
    for name in ("agent", "zygote"):
        b, e = res["before"].get(name), res["after"].get(name)
        print(f"  {name}: start {b}, end {e}")
    if a.json:
        print(json.dumps({"goodput": calm_wall / chaos_wall, "chaos_wall_s": chaos_wall,
                          "calm_wall_s": calm_wall, "bitwise_equal": equal,
                          "summary": s, "before": res["before"], "after": res["after"],
                          "phases_ms": res["report"]["phases_ms"]}, indent=2))
    ok = (s["recovered"] == s["faults"] and s["lost_steps"] == 0 and equal
          and res["chaos_rc"] == 0 and res["job_rc"] == 0 and calm_rc == 0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
