"""Worker for soak_chaos.py: bench_recovery_worker.py's model (~10 M parameters, SGD) with
the ftrun API, trained until --steps or until the step named in --end-file.

Appends {"step", "t", "rank"} to OUT/steps.jsonl for every committed step (the wall a run
takes is read from these), and each rank that finishes as a member saves its final
parameters to OUT/params_<rank>.pt (the soak compares them bitwise with the fault-free run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_recovery_worker import batch, dump, model  # noqa: E402  (the benchmarks' model)

import ftrun  # noqa: E402


def end_step(path: str | None) -> int | None:
    """The step every rank stops before, once the soak has written it (None: not yet)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1_000_000_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--end-file")
    a = ap.parse_args()
    ft = ftrun.init()
    m = ft.wrap(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ft.register(model=m, optimizer=opt)
    log = os.path.join(a.out, "steps.jsonl")
    for step in ft.steps(a.steps):
        end = end_step(a.end_file)
        if end is not None and step >= end:
            break
        x, y = batch(step, a.batch)
        sl = ft.batch_slice(a.batch)
        torch.nn.functional.mse_loss(m(x[sl]), y[sl]).backward()
        if ft.commit(opt):
            with open(log, "a") as f:  # one short line: appends from the ranks do not mix
                f.write(json.dumps({"step": step, "t": time.time(), "rank": ft.rank}) + "\n")
    if ft.rank >= 0:
        dump(a.out, ft.rank, m)
    ft.close()


if __name__ == "__main__":
    main()
