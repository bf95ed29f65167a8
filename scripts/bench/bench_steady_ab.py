"""Steady-state step time, ftrun's loop against DDP's, step by step in the same processes.

    python scripts/bench/bench_steady_ab.py [--nproc 2] [--steps 60] [--dim 256] [--layers 4]
                                      [--dtype bf16|fp32]

scripts/bench/bench_steady.py compares two launchers' runs one after the other; on a shared 2-core
host their step times drift by ±10 % from one run to the next, more than the difference it
looks for. Here one ftrun job runs both loops in the same worker processes, alternating step
by step: a step of the GPT example's loop (ft.wrap buckets all-reduced from backward hooks,
ft.no_sync() for every micro-batch but the last, ft.sync(), clip, AdamW, ft.commit(), the
steps() generator included), then a step of the same loop on a second copy of the model under
torch's DDP (DDP's no_sync, its reducer, its buckets of the same size; on ftrun's default
group), the order swapped every step. A drift in the host's speed hits both sides of a pair
alike. Printed per rank, then for the job (each pair's mean over the ranks: the figure to
quote): the median step time of each (steps after the first quarter), their ratio, and the
median of the per-pair ratios ftrun/DDP with its interquartile range. Launchers are not part
of this comparison (bench_steady.py has them; the agent uses ~0.4 % of a core).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from profile_step import (  # the same loop, the same model, the same flags
    Phases,
    add_model_args,
    build,
    micro_batches,
    model_args,
    optimize,
)

RUN_TIMEOUT_S = 1800  # one ftrun invocation


def child(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ftrun
    from ftrun.worker.loader import Loader

    ft = ftrun.init()
    if not dist.is_initialized():
        raise SystemExit("needs torch's reconfigurable default group (torch >= 2.15, gloo)")
    untimed = Phases()  # profile_step's loop times its phases; a few microseconds a step
    ft_model, ft_opt, ft_sched, data = build(a, ft.device, lambda m: ft.wrap(m, a.bucket_mb))
    ft_loader = ft.loader(data, global_batch_size=a.batch, shuffle=True, seed=0,
                          num_workers=0)
    ft.register(model=ft_model, optimizer=ft_opt, scheduler=ft_sched)
    rank, world = ft.rank, ft.world_size
    ddp_loader = Loader(data, global_batch_size=a.batch, seed=0,
                        membership=lambda: (rank, world, 0))
    ddp: list[Any] = []  # built once ftrun has formed its group (its first step does)

    def ftrun_step(steps: Any) -> bool:
        step = next(steps, None)
        if step is None:
            return False
        micro_batches(a, untimed, ft_model, ft_loader, step, ft.device, ft.no_sync, "backward")
        if ft.sync():
            optimize(untimed, ft_model, ft_opt, ft_sched)
            ft.commit()
        untimed.take()
        return True

    def ddp_step(step: int) -> bool:
        if not ddp:
            ddp.extend(build(a, ft.device, lambda m: DDP(m, bucket_cap_mb=a.bucket_mb))[:3])
        model, opt, sched = ddp
        micro_batches(a, untimed, model, ddp_loader, step, ft.device, model.no_sync, "backward")
        optimize(untimed, model, opt, sched)
        opt.zero_grad()
        untimed.take()
        return True

    steps, log = ft.steps(a.steps), []
    ftrun_step(steps)  # step 0: ftrun forms its group; not timed
    for step in range(1, a.steps + 1):
        times: dict[str, float] = {}
        order = ("ftrun", "ddp") if step % 2 == 0 else ("ddp", "ftrun")
        for side in order:
            t0 = time.perf_counter()
            more = ftrun_step(steps) if side == "ftrun" else ddp_step(step)
            times[side] = time.perf_counter() - t0
            if not more:
                break
        if len(times) == 2 and step < a.steps:
            log.append(times)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"log_{ft.rank}.json"), "w") as f:
        json.dump(log, f)
    ft.close()


def summary(who: str, log: list[dict[str, float]]) -> str:
    steady = log[len(log) // 4:]
    ft = statistics.median(e["ftrun"] for e in steady) * 1000
    ddp = statistics.median(e["ddp"] for e in steady) * 1000
    ratios = sorted(e["ftrun"] / e["ddp"] for e in steady)
    q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
    return (f"  {who}: ftrun step {ft:.1f} ms, DDP step {ddp:.1f} ms, ratio of medians "
            f"{ft / ddp:.3f}; per-pair ratio median {statistics.median(ratios):.3f} "
            f"(IQR {q1:.3f}-{q3:.3f}, {len(ratios)} pairs)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    add_model_args(ap, steps=60)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    print(f"GPT dim {a.dim} x {a.layers} layers, {a.nproc} workers, bucket {a.bucket_mb} MB, "
          f"{a.accum} micro-batches, {a.dtype}, {a.steps} steps of each, alternating:",
          flush=True)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        args = [os.path.abspath(__file__), "--child", "--out", tmp,
                *(f"--{k}={v}" for k, v in model_args(a))]
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, timeout=RUN_TIMEOUT_S, capture_output=True,
                              text=True)
        if done.returncode != 0:
            sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"ftrun failed ({done.returncode})")
        logs = []
        for rank in range(a.nproc):
            with open(os.path.join(tmp, f"log_{rank}.json")) as f:
                logs.append(json.load(f))
            print(summary(f"rank {rank}", logs[-1]))
    # ranks meet in every all-reduce, so their steps differ only in where each one waits:
    # the job's figure is each pair's mean over the ranks
    pairs = [{side: statistics.mean(log[i][side] for log in logs) for side in ("ftrun", "ddp")}
             for i in range(min(map(len, logs)))]
    print(summary("job (mean over ranks)", pairs))
    print(f"  load average (1 min): {load:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
