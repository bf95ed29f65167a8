"""Snapshots (issue #14): what one costs the training thread, what snapshotting costs a run, how
it compares with torchrun + torch.distributed.checkpoint, and what a total loss costs. Same
model as bench_recovery.py (bench_recovery_worker's ~8.7 M-parameter MLP), same machine, one
invocation; every ratio comes from runs of this invocation.

    python scripts/bench/bench_snapshot.py [--nproc 2] [--steps 250] [--every 50] [--kill-step 130]
                                     [--shard-size 2]

With --shard-size S the model is sharded with FSDP2 (bench_snapshot_worker.py): ftrun runs
with --shard-size S (every rank of the snapshotting group copies its own shards), and the
comparison is a torchrun FSDP2 job (HSDP with more ranks than S) whose every rank calls
dcp.save of the same sharded state. The host is shared: each figure is printed with the
1-minute load average (`uptime`) read as its runs ended.

  blocking   median of the snapshot events' blocking_ms (the copy into the shared-memory slot)
             beside the same state copied once in memory by the worker: into fresh tensors
             (clone: the ratio's baseline) and into buffers allocated beforehand
  overhead   step time (commit to commit on rank 0, the first --skip steps left out) of an
             ftrun run with --snapshot-every EVERY against the same run without snapshots,
             --repeats alternating pairs; median and mean (only the mean sees the snapshot
             steps, one in EVERY, and the agent's disk writes competing for the CPUs).
             Run-to-run noise on a small machine exceeds 1 %, so also the in-run estimate
             1 + stall / (EVERY x median step), stall: a snapshot step's time over the run's
             median step. The agent's disk write (torch DCP, its own thread): its write_ms.
  dcp        torchrun + DDP where every rank calls dcp.save every EVERY steps: the blocking
             time of a save (slowest rank), and ftrun's blocking time over it
  total loss every worker SIGKILLed at --kill-step: kill -> the first commit after the
             restart, and the steps computed again (kill step - the step resumed from)

Prints a table, then one line of JSON. torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
as in bench_recovery.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bench_snapshot_worker.py")
ENV = {"OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

Events = list[dict[str, Any]]


class RunFailed(RuntimeError):
    pass


LOADS: dict[str, list[float]] = {}  # what the host's load average was as each kind of run ended


def launch(cmd: list[str], work: str, timeout: float, kind: str = "") -> None:
    """Run `cmd` in its own session so that a timeout ends the launcher and its workers."""
    with open(os.path.join(work, "stdout.log"), "w") as out, \
            open(os.path.join(work, "stderr.log"), "w") as err:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            raise RunFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    LOADS.setdefault(kind, []).append(os.getloadavg()[0])
    if rc != 0:
        with open(os.path.join(work, "stderr.log")) as f:
            tail = f.read()[-3000:]
        raise RunFailed(f"exit {rc}: {' '.join(cmd)}\n{tail}")


def _end(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def read_jsonl(path: str) -> Events:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def worker_args(out: str, steps: int, *extra: str) -> list[str]:
    return [WORKER, "--out", out, "--steps", str(steps), *extra]


def run_ftrun(a: argparse.Namespace, steps: int, every: int, *extra: str,
              kind: str = "overhead") -> tuple[Events, Events]:
    """(worker events, agent events) of one ftrun run; `every` 0: no snapshots."""
    with tempfile.TemporaryDirectory(prefix="bench_snapshot_") as work:
        out, logs = os.path.join(work, "out"), os.path.join(work, "logs")
        os.makedirs(out)
        flags = ["--log-dir", logs]
        if every:
            flags += ["--snapshot-every", str(every), "--snapshot-dir",
                      os.path.join(work, "snapshots")]
        if a.shard_size > 1:
            flags += ["--shard-size", str(a.shard_size)]
        launch([sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), *flags,
                *worker_args(out, steps, "--mode", "ftrun", "--shard-size", str(a.shard_size),
                             *extra)], work, a.timeout, kind)
        agent = [e for p in glob.glob(os.path.join(logs, "*", "events.jsonl"))
                 for e in read_jsonl(p)]
        return read_jsonl(os.path.join(out, "events.jsonl")), agent


def run_ddp(a: argparse.Namespace) -> Events:
    with tempfile.TemporaryDirectory(prefix="bench_snapshot_") as work:
        out, ckpt = os.path.join(work, "out"), os.path.join(work, "dcp")
        os.makedirs(out)
        args = worker_args(out, a.steps, "--mode", "ddp", "--dcp-every", str(a.every),
                           "--ckpt-dir", ckpt, "--shard-size", str(a.shard_size))
        launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(a.nproc), "--log-dir", os.path.join(work, "logs"), *args], work, a.timeout,
               "dcp")
        return read_jsonl(os.path.join(out, "events.jsonl"))


def step_gaps(events: Events, skip: int, every: int = 0) -> tuple[list[float], list[float]]:
    """Rank 0's commit-to-commit times in seconds from step `skip` on: (every step, the steps
    that began with a snapshot: the gap ending at step s, s a multiple of `every`)."""
    commits = sorted((e for e in events if e["ev"] == "step" and e["rank"] == 0),
                     key=lambda e: e["t"])
    gaps = [(b["step"], b["t"] - a["t"]) for a, b in zip(commits, commits[1:], strict=False)
            if b["step"] == a["step"] + 1 and b["step"] >= skip]
    marked = [g for s, g in gaps if every and s % every == 0]
    return [g for _, g in gaps], marked


def overhead(a: argparse.Namespace) -> dict[str, Any]:
    """Alternating pairs of runs, without and with snapshots, pooled per kind."""
    base: list[float] = []
    snap: list[float] = []
    marked: list[float] = []
    blocking: list[float] = []
    write: list[float] = []
    snap_bytes: list[int] = []
    memcpy: Events = []
    for _ in range(a.repeats):
        ev, _agent = run_ftrun(a, a.steps, 0)
        base += step_gaps(ev, a.skip)[0]
        ev, agent = run_ftrun(a, a.steps, a.every, "--memcpy")
        gaps, at_snapshot = step_gaps(ev, a.skip, a.every)
        snap += gaps
        marked += at_snapshot
        snaps = [e for e in agent if e["event"] == "snapshot"]
        blocking += [float(e["blocking_ms"]) for e in snaps]
        write += [float(e["write_ms"]) for e in snaps]
        snap_bytes += [int(e["bytes"]) for e in snaps]
        memcpy += [e for e in ev if e["ev"] == "memcpy"]
    return {"base": base, "snap": snap, "marked": marked, "blocking_ms": blocking,
            "write_ms": write, "bytes": snap_bytes, "memcpy": memcpy}


def dcp_blocking(events: Events) -> list[float]:
    """Each save's blocking time in ms, its slowest rank's: the next all-reduce waits for it."""
    per: dict[int, float] = {}
    for e in events:
        if e["ev"] == "dcp":
            per[e["step"]] = max(per.get(e["step"], 0.0), float(e["ms"]))
    return [per[s] for s in sorted(per)]


def total_loss(a: argparse.Namespace) -> dict[str, Any]:
    steps = a.kill_step + a.every
    ev, agent = run_ftrun(a, steps, a.every, "--die-all-at", str(a.kill_step),
                          kind="total_loss")
    kills = [e for e in ev if e["ev"] == "kill"]
    after = [e for e in ev if e["ev"] == "step" and e["attempt"] > 0]
    resumed = sorted((e for e in agent if e["event"] == "resumed"), key=lambda e: e["t"])
    if not kills or not after or not resumed:
        raise RunFailed(f"total loss: {len(kills)} kills, {len(after)} commits after the "
                        f"restart, {len(resumed)} resumed events")
    killed_at = max(e["t"] for e in kills)  # the loss is total once the last worker died
    first = min(after, key=lambda e: e["t"])
    r = resumed[0]
    return {"kill_step": a.kill_step, "resumed_step": int(r["step"]), "source": r["source"],
            "load_ms": float(r["load_ms"]), "to_loaded_s": float(r["loaded_at"]) - killed_at,
            "recovery_s": first["t"] - killed_at, "first_step": first["step"],
            "recomputed": a.kill_step - int(r["step"])}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms / 1000) / 1e9 if ms > 0 else float("nan")


def summarize(a: argparse.Namespace, ov: dict[str, Any], dcp: list[float],
              loss: dict[str, Any]) -> dict[str, Any]:
    # sharded: a snapshot's bytes are every shard's; each rank copies its own share at once
    nbytes = med([float(b) for b in ov["bytes"]]) / a.shard_size
    clone = med([e["clone_ms"] for e in ov["memcpy"]])
    prealloc = med([e["prealloc_ms"] for e in ov["memcpy"]])
    blocking = med(ov["blocking_ms"])
    base_med, snap_med = med(ov["base"]) * 1000, med(ov["snap"]) * 1000
    base_mean, snap_mean = mean(ov["base"]) * 1000, mean(ov["snap"]) * 1000
    stall = med(ov["marked"]) * 1000 - snap_med
    return {
        "nproc": a.nproc, "shard_size": a.shard_size, "steps": a.steps, "every": a.every,
        "repeats": a.repeats,
        "load_1min": {k: [round(x, 2) for x in v] for k, v in LOADS.items()},
        "snapshot_mb": round(nbytes / 1e6, 2), "snapshots": len(ov["blocking_ms"]),
        "snapshot_mb_all_shards": round(nbytes * a.shard_size / 1e6, 2),
        "blocking_ms": round(blocking, 2), "blocking_gbps": round(gbps(nbytes, blocking), 2),
        "clone_ms": round(clone, 2), "clone_gbps": round(gbps(nbytes, clone), 2),
        "prealloc_copy_ms": round(prealloc, 2),
        "prealloc_copy_gbps": round(gbps(nbytes, prealloc), 2),
        "blocking_over_clone": round(blocking / clone, 3),
        "blocking_over_prealloc_copy": round(blocking / prealloc, 3),
        "stall_at_snapshot_ms": round(stall, 1),
        "agent_write_ms": round(med(ov["write_ms"]), 1),
        "step_ms_median": [round(base_med, 2), round(snap_med, 2)],
        "step_ms_mean": [round(base_mean, 2), round(snap_mean, 2)],
        "overhead_median": round(snap_med / base_med, 4),
        "overhead_mean": round(snap_mean / base_mean, 4),
        "overhead_stall": round(1 + stall / (a.every * snap_med), 4),
        "dcp_saves": len(dcp), "dcp_blocking_ms": round(med(dcp), 2),
        "blocking_over_dcp": round(blocking / med(dcp), 4),
        "total_loss_recovery_s": round(loss["recovery_s"], 3),
        "total_loss_to_loaded_s": round(loss["to_loaded_s"], 3),
        "total_loss_load_ms": loss["load_ms"], "total_loss_source": loss["source"],
        "kill_step": loss["kill_step"], "resumed_step": loss["resumed_step"],
        "first_step_after": loss["first_step"],
        "recomputed_steps": loss["recomputed"],
    }


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report(s: dict[str, Any], ov: dict[str, Any], dcp: list[float]) -> None:
    mb = s["snapshot_mb"]
    sharding = f", FSDP2 in groups of {s['shard_size']}" if s["shard_size"] > 1 else ""
    other = "FSDP2" if s["shard_size"] > 1 else "DDP"
    loads = s["load_1min"]
    print(f"{s['nproc']} workers, gloo on CPU, recovery benchmark model{sharding}, "
          f"{s['steps']} steps, snapshot every {s['every']} steps, {s['repeats']} run pair(s)")
    print(f"  load average (1 min, as each run ended): overhead runs {loads.get('overhead')}, "
          f"torchrun {loads.get('dcp')}, total loss {loads.get('total_loss')}")
    print(f"  snapshot blocking_ms, every one: {[round(x, 1) for x in ov['blocking_ms']]}")
    print(f"  dcp.save blocking ms (slowest rank), every one: {[round(x, 1) for x in dcp]}")
    rows = [
        ("1 blocking / snapshot (median)" if s["shard_size"] == 1 else
         "1 blocking / snapshot, per rank", f"{mb:.1f} MB  {s['blocking_ms']:8.2f} ms  "
         f"{s['blocking_gbps']:6.2f} GB/s"),
        ("  copy into fresh tensors (clone)", f"{mb:.1f} MB  {s['clone_ms']:8.2f} ms  "
         f"{s['clone_gbps']:6.2f} GB/s"),
        ("  copy into preallocated buffers", f"{mb:.1f} MB  {s['prealloc_copy_ms']:8.2f} ms  "
         f"{s['prealloc_copy_gbps']:6.2f} GB/s"),
        ("  blocking / clone (goal <= 1)", f"{s['blocking_over_clone']:.3f}  "
         f"{verdict(s['blocking_over_clone'] <= 1)}   (/ preallocated copy: "
         f"{s['blocking_over_prealloc_copy']:.1f})"),
        ("  step stall at a snapshot step", f"{s['stall_at_snapshot_ms']:.1f} ms over the "
         f"median step"),
        ("  agent's disk write (DCP, thread)", f"{s['agent_write_ms']:.1f} ms median"),
        ("2 step ms, no snapshots", f"median {s['step_ms_median'][0]:7.2f}  "
         f"mean {s['step_ms_mean'][0]:7.2f}"),
        (f"  step ms, --snapshot-every {s['every']}", f"median {s['step_ms_median'][1]:7.2f}  "
         f"mean {s['step_ms_mean'][1]:7.2f}"),
        ("  ratio (goal <= 1.01)", f"median {s['overhead_median']:.4f} "
         f"{verdict(s['overhead_median'] <= 1.01)}  mean {s['overhead_mean']:.4f} "
         f"{verdict(s['overhead_mean'] <= 1.01)}"),
        ("  in-run: 1 + stall / (every x step)", f"{s['overhead_stall']:.4f}  "
         f"{verdict(s['overhead_stall'] <= 1.01)}"),
        (f"3 torchrun + {other} + dcp.save, blocking", f"{s['dcp_blocking_ms']:.2f} ms median of "
         f"{s['dcp_saves']} saves"),
        ("  ftrun / dcp (goal <= 0.1)", f"{s['blocking_over_dcp']:.4f}  "
         f"{verdict(s['blocking_over_dcp'] <= 0.1)}"),
        (f"4 total loss at step {s['kill_step']}", f"first commit (step "
         f"{s['first_step_after']}) {s['total_loss_recovery_s']:.3f} s after the kill "
         f"(loaded at {s['total_loss_to_loaded_s']:.3f} s, load {s['total_loss_load_ms']:.1f}"
         f" ms from {s['total_loss_source']})"),
        ("  steps recomputed (goal <= every)", f"{s['recomputed_steps']} (resumed at step "
         f"{s['resumed_step']})  {verdict(0 <= s['recomputed_steps'] <= s['every'])}"),
    ]
    for name, value in rows:
        print(f"{name:36s} {value}")
    print(f"{s['wall_s']} s; other processes took {s['others_cpu_share']:.0%} of the machine's "
          f"CPUs meanwhile (above a few %: the step times are disturbed)")
    print(json.dumps(s))


def machine_busy_s() -> float:
    """CPU seconds every process of the machine used so far (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system = (int(x) for x in fields[:3])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def others_share(busy0: float, wall: float) -> float:
    """The share of this machine's CPUs other processes took meanwhile: step times are only
    as good as that."""
    times = os.times()
    ours = times.user + times.system + times.children_user + times.children_system
    others = max(0.0, machine_busy_s() - busy0 - ours)
    return others / wall / (os.cpu_count() or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--every", type=int, default=50, help="--snapshot-every, and dcp.save's")
    ap.add_argument("--kill-step", type=int, default=130)
    ap.add_argument("--repeats", type=int, default=2, help="pairs of overhead runs")
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps left out of step times")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launched run")
    ap.add_argument("--shard-size", type=int, default=1,
                    help="FSDP2 in replica groups of this size (ftrun --shard-size)")
    a = ap.parse_args()
    started, busy0 = time.time(), machine_busy_s()
    ov = overhead(a)
    dcp = dcp_blocking(run_ddp(a))
    loss = total_loss(a)
    wall = time.time() - started
    summary = {**summarize(a, ov, dcp, loss), "wall_s": round(wall),
               "others_cpu_share": round(others_share(busy0, wall), 3)}
    report(summary, ov, dcp)


if __name__ == "__main__":
    main()
