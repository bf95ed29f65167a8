"""Fault storm: repeated SIGKILLs of live members, ftrun versus torchrun, one invocation.

    python scripts/bench/bench_storm.py [--nproc 4] [--spares 1] [--steps 300] [--kills 6]
                                  [--every 3.0] [--seed 0] [--json]

Four runs of bench_recovery_worker.py (its ~9 M parameter MLP, gloo on CPU): ftrun --spares K
with the ftrun API, and torchrun --max-restarts <kills> with DDP and a checkpoint every 10
steps (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see bench_recovery.py), each fault-free and in a
storm. The storm runs from step WARMUP_STEPS to TAIL_STEPS before the end: a SIGKILL every
--every s of a random rank of the newest step that every rank committed (spares never commit,
so are never chosen; the seed fixes the victim ranks), once the previous fault has recovered.
Per run:
  recovery  SIGKILL -> the first commit (any rank) of a step >= the step in progress at the
            kill (one past the highest step committed before it), as in bench_recovery.py;
            p50/p95 are nearest-rank (p95 is the max below 20 faults)
  step      median commit-to-commit time of consecutive steps of one process
  goodput   (ff loop_s / ff step) / (loop_s / step), ff: the same launcher's fault-free run;
            loop_s: the first commit of step 0 -> the last commit of the last step. Each loop
            is measured in its own run's median step, which cancels load that differs between
            runs (other jobs on a shared machine move step times 10-20%); what remains is what
            faults cost: detection, recovery, restarts, recomputed steps, steps slowed by
            replacements starting on the same cores. Blind spot: a slowdown over most of the
            run moves the median too and is not counted.
  lost      committed steps computed twice (the most any rank recomputed)
  bitwise   every final replica equals rank 0 of the same launcher's fault-free run
and the ftrun/torchrun ratios of the storms.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bench_recovery_worker.py")
WARMUP_STEPS = 5  # committed steps before the first kill: start-up is not part of the storm
TAIL_STEPS = 5  # the last steps are not stormed: every fault recovers before the run ends
POLL_S = 0.02  # how often the killer reads the events file
RUN_TIMEOUT_S = 1800.0  # one run, start to exit; a storm that hangs is a failed benchmark
STOP_S = 30.0  # a failed run's launcher, after SIGTERM, to stop its workers
Event = dict[str, Any]


def zygote_memory(proc: subprocess.Popen[bytes], ev: Events, a: argparse.Namespace
                  ) -> dict[str, float] | None:
    """Half-way through a fault-free ftrun run, from `ftrun status --json`: the zygote's
    resident size and, per forked worker (mean), resident, shared (copy-on-write pages it
    still shares) and proportional sizes, in MB. None without a zygote."""
    while proc.poll() is None and max((e["step"] for e in ev.steps), default=-1) < a.steps // 2:
        time.sleep(POLL_S)
        ev.read()
    r = subprocess.run([sys.executable, "-m", "ftrun", "status", "--json"], capture_output=True,
                       text=True, timeout=STOP_S)
    z = json.loads(r.stdout).get("zygote", {}) if r.returncode == 0 else {}
    workers = z.get("workers") or []
    if "rss_kb" not in z or not workers:
        return None
    mean = {k: statistics.mean(w.get(k, 0) for w in workers) / 1024
            for k in ("rss_kb", "shared_kb", "pss_kb")}
    return {"zygote_rss_mb": round(z["rss_kb"] / 1024, 1), "workers": len(workers),
            **{f"worker_{k[:-3]}_mb": round(v, 1) for k, v in mean.items()}}


class Events:
    """The worker's events.jsonl, read incrementally while the run goes on."""

    def __init__(self, path: str, world: int) -> None:
        self.path, self.world, self.offset, self.steps = path, world, 0, list[Event]()

    def read(self) -> None:
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]  # a line being written waits for next time
            self.offset += len(whole)
            self.steps += [e for e in map(json.loads, whole.splitlines()) if e["ev"] == "step"]

    def members(self, after: float) -> dict[int, int]:
        """rank -> pid of the newest step that every rank committed after time `after`."""
        by_step: dict[int, dict[int, int]] = {}
        for e in (e for e in self.steps if e["t"] > after):
            by_step.setdefault(e["step"], {})[e["rank"]] = e["pid"]
        full = [s for s, r in by_step.items() if len(r) == self.world]
        return by_step[max(full)] if full else {}


def in_progress(steps: list[Event], t: float) -> int:
    return 1 + max((e["step"] for e in steps if e["t"] < t), default=-1)


def recovered_at(steps: list[Event], kill: Event) -> float | None:
    return min((e["t"] for e in steps if e["t"] > kill["t"] and e["step"] >= kill["step"]),
               default=None)


def storm(proc: subprocess.Popen[bytes], ev: Events, a: argparse.Namespace) -> list[Event]:
    """Kill a random live member every a.every seconds, a.kills times, while `proc` runs."""
    rng, kills = random.Random(a.seed), list[Event]()
    while proc.poll() is None and len(kills) < a.kills:
        time.sleep(POLL_S)
        ev.read()
        last = kills[-1] if kills else None
        newest = max((e["step"] for e in ev.steps), default=-1)
        if newest < WARMUP_STEPS or newest >= a.steps - TAIL_STEPS:
            continue
        if last is not None and (time.time() < last["t"] + a.every
                                 or recovered_at(ev.steps, last) is None):
            continue
        if not (members := ev.members(last["t"] if last else 0.0)):
            continue
        rank = rng.choice(sorted(members))
        t = time.time()
        try:
            os.kill(members[rank], signal.SIGKILL)
        except ProcessLookupError:
            continue  # it died of something else; the run will show it
        kills.append({"t": t, "rank": rank, "pid": members[rank],
                      "step": in_progress(ev.steps, t)})
    return kills


def command(kind: str, a: argparse.Namespace, out: str) -> list[str]:
    if kind == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), "--spares", str(a.spares),
               "--log-dir", os.path.join(out, "logs")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
               "--max-restarts", str(a.kills)]
    return cmd + [WORKER, "--mode", "ftrun" if kind == "ftrun" else "ddp", "--out", out,
                  "--steps", str(a.steps), "--dump"]


def launch(kind: str, a: argparse.Namespace, out: str, faults: bool
           ) -> tuple[list[Event], list[Event], dict[str, float] | None]:
    """Run one launcher to the end (storming it if `faults`): its kills, its commits, and
    (fault-free ftrun) the zygote's memory."""
    memory = None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    ev = Events(os.path.join(out, "events.jsonl"), a.nproc)
    with open(os.path.join(out, "launcher.log"), "wb") as log:
        proc = subprocess.Popen(command(kind, a, out), env=env, stdout=log, stderr=log,
                                start_new_session=True)
        try:
            kills = storm(proc, ev, a) if faults else []
            if kind == "ftrun" and not faults:
                memory = zygote_memory(proc, ev, a)
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:  # the benchmark failed: the launcher stops its workers
                proc.terminate()
                try:
                    proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    if rc != 0:
        with open(os.path.join(out, "launcher.log"), errors="replace") as f:
            sys.exit(f"{kind} run failed (exit {rc}):\n{f.read()[-3000:]}")
    ev.read()
    for k in kills:  # the killer may not have read the last commits before its kill yet
        k["step"] = in_progress(ev.steps, k["t"])
    return kills, sorted(ev.steps, key=lambda e: e["t"]), memory


def nearest_rank(xs: list[float], q: float) -> float | None:
    return sorted(xs)[max(0, math.ceil(q * len(xs)) - 1)] if xs else None


def params(out: str) -> dict[int, dict[str, torch.Tensor]]:
    found = (n for n in os.listdir(out) if n.startswith("params_") and n.endswith(".pt"))
    return {int(n[7:-3]): torch.load(os.path.join(out, n)) for n in found}


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a)


def median_step(steps: list[Event]) -> float:
    by_pid: dict[int, list[Event]] = {}
    for e in steps:
        by_pid.setdefault(e["pid"], []).append(e)
    return statistics.median(b["t"] - p["t"] for es in by_pid.values()
                             for p, b in zip(es, es[1:], strict=False)
                             if b["step"] == p["step"] + 1)


def summarize(kills: list[Event], steps: list[Event], out: str) -> dict[str, Any]:
    last = max(e["step"] for e in steps)
    loop = max(e["t"] for e in steps if e["step"] == last) - min(
        e["t"] for e in steps if e["step"] == 0)
    recs = [r - k["t"] for k in kills if (r := recovered_at(steps, k)) is not None]
    seen: dict[int, list[int]] = {}
    for e in steps:  # a replacement takes its victim's rank: a rank's repeats are lost work
        seen.setdefault(e["rank"], []).append(e["step"])
    return {"faults": len(kills), "recovered": len(recs), "recovery_s": recs,
            "p50_s": nearest_rank(recs, 0.5), "p95_s": nearest_rank(recs, 0.95),
            "max_s": max(recs, default=None), "loop_s": loop, "step_s": median_step(steps),
            "lost_steps": max(len(v) - len(set(v)) for v in seen.values()),
            "victims": [k["rank"] for k in kills], "params": params(out)}


def run_pair(kind: str, a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fault-free run and the storm of one launcher, with goodput and bitwise filled in."""
    rows = []
    for faults in (False, True):
        with tempfile.TemporaryDirectory(prefix=f"storm_{kind}_") as out:
            kills, steps, memory = launch(kind, a, out, faults)
            row = summarize(kills, steps, out)
            row["memory"] = memory
            rows.append(row)
    ref = rows[0]["params"].get(0)
    for row in rows:
        reps = row.pop("params")
        row["goodput"] = rows[0]["loop_s"] / rows[0]["step_s"] / (row["loop_s"] / row["step_s"])
        row["bitwise"] = (ref is not None and len(reps) == a.nproc
                          and all(bitwise(p, ref) for p in reps.values()))
    return rows[0], rows[1]


COLUMNS = (("p50 s", "p50_s", 1.0, ".3f"), ("p95 s", "p95_s", 1.0, ".3f"),
           ("max s", "max_s", 1.0, ".3f"), ("step ms", "step_s", 1000.0, ".1f"),
           ("loop s", "loop_s", 1.0, ".2f"), ("goodput", "goodput", 1.0, ".3f"),
           ("lost", "lost_steps", 1.0, ".0f"))


def cell(x: float | None, scale: float, spec: str) -> str:
    return "-" if x is None else format(x * scale, spec)


def report(a: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    ft, tr = runs["ftrun storm"], runs["torchrun storm"]
    ratios = {k: None if ft[k] is None or not tr[k] else ft[k] / tr[k] for _, k, _, _ in COLUMNS}
    if a.json:
        print(json.dumps({"config": vars(a), "runs": runs, "ftrun_over_torchrun": ratios},
                         indent=2))
        return
    print(f"{a.nproc} workers (ftrun --spares {a.spares}), gloo on CPU, {a.steps} steps, "
          f"{a.kills} SIGKILLs of live members {a.every:g} s apart (seed {a.seed})")
    print(f"{'run':20s} {'faults':>6s} " + " ".join(f"{h:>7s}" for h, _, _, _ in COLUMNS)
          + " bitwise")
    for name, r in runs.items():
        print(f"{name:20s} {r['recovered']:>2d}/{r['faults']:<3d} "
              + " ".join(f"{cell(r[k], m, f):>7s}" for _, k, m, f in COLUMNS)
              + f" {r['bitwise']}")
    print("ftrun/torchrun: " + ", ".join(f"{k} {cell(v, 1.0, '.3f')}" for k, v in ratios.items()))
    print(f"victim ranks: ftrun {ft['victims']}, torchrun {tr['victims']}")
    for name, r in runs.items():
        if r["memory"] is not None:
            print(f"{name} zygote memory: {r['memory']}")
        if name.endswith("storm") and r["faults"] < a.kills:
            print(f"{name}: {r['faults']} of {a.kills} kills before the end; add --steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--nproc", 4), ("--spares", 1), ("--steps", 300), ("--kills", 6)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--every", type=float, default=3.0, help="seconds between kills")
    ap.add_argument("--seed", type=int, default=0, help="picks the victim ranks")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    runs: dict[str, dict[str, Any]] = {}
    for kind in ("ftrun", "torchrun"):
        runs[f"{kind} fault-free"], runs[f"{kind} storm"] = run_pair(kind, a)
    report(a, runs)


if __name__ == "__main__":
    main()
