"""`--redo step` versus `--redo lost`: what a fault costs when only the lost work is redone.

    python scripts/bench/bench_redo.py [--nproc 4] [--spares 0] [--reps 3] [--steps 12]
        [--kill-step 6]

Each repetition runs the same job twice, `--redo step` then `--redo lost` (4 gloo workers, an
MLP whose step is >= 0.5 s of compute here, the loader's global batch). Worker 1 SIGKILLs
itself in the middle of a backward of step --kill-step (a hook on the first layer: the later
layers' buckets are all-reducing by then). Per run:
  recovery   kill -> the first commit of the killed step (any rank)
  redone     samples of the killed step computed a second time, over every rank
  step       median fault-free step time (rank 0, before the kill)
and per mode the median, with the ratio lost/step. --steady N: N fault-free runs per mode
instead (alternating), the median step time of each and the ratio (what keeping a copy of
the local gradients costs). This file is the worker too (--worker).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def worker(a: argparse.Namespace) -> None:
    import torch

    import ftrun

    wid = int(os.environ.get("FTRUN_WORKER_ID", "0"))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(a.depth):
        layers += [torch.nn.Linear(a.width if i else 64, a.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 8))
    ft = ftrun.init()
    model = ft.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ft.register(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(7)
    data = list(zip(torch.randn(4096, 64, generator=gen), torch.randn(4096, 8, generator=gen),
                    strict=True))
    loader = ft.loader(data, global_batch_size=a.batch, seed=0)
    log = open(os.path.join(a.out, f"events_{wid}.jsonl"), "a")  # noqa: SIM115
    now = {"step": -1}

    def kill_mid_backward(grad: torch.Tensor) -> torch.Tensor:
        if wid == 1 and now["step"] == a.kill_step:
            log.write(json.dumps({"ev": "kill", "t": time.time(), "step": now["step"]}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(kill_mid_backward)
    for step in ft.steps(a.steps):
        now["step"] = step
        x, y = loader.batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ok = ft.commit(opt)
        log.write(json.dumps({"ev": "pass", "t": time.time(), "step": step, "ok": ok,
                              "wid": wid, "samples": len(x),
                              "makeup": ft.makeup is not None or None}) + "\n")
        log.flush()
    ft.close()


def run_once(a: argparse.Namespace, redo: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), "--redo", redo,
               "--spares", str(a.spares), __file__, "--worker", "--out", out,
               "--steps", str(a.steps), "--kill-step", str(a.kill_step), "--batch", str(a.batch),
               "--width", str(a.width), "--depth", str(a.depth)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"ftrun --redo {redo} failed:\n{r.stderr[-3000:]}")
        events = [json.loads(line) for name in os.listdir(out) if name.startswith("events_")
                  for line in _lines(os.path.join(out, name))]
    passes = sorted((e for e in events if e["ev"] == "pass"), key=lambda e: e["t"])
    if a.kill_step < 0:  # fault-free: the steady state
        rank0 = [e["t"] for e in passes if e["wid"] == 0]
        return {"step_s": statistics.median(b - a for a, b in zip(rank0[1:], rank0[2:],
                                                                   strict=False))}
    (kill,) = [e for e in events if e["ev"] == "kill"]
    first = min(e["t"] for e in passes if e["ok"] and e["step"] >= kill["step"])
    again = [e for e in passes if e["step"] == kill["step"] and e["t"] > kill["t"] and
             not (e["ok"] is False and e["makeup"] is None and _first_pass(e, passes))]
    rank0 = [e["t"] for e in passes if e["wid"] == 0 and e["ok"] and e["step"] < kill["step"]]
    gaps = [b - a for a, b in zip(rank0, rank0[1:], strict=False)]
    return {"recovery_s": first - kill["t"], "redone": sum(e["samples"] for e in again),
            "step_s": statistics.median(gaps[1:]) if len(gaps) > 1 else float("nan")}


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def _first_pass(e: dict, passes: list[dict]) -> bool:
    """`e` is a worker's first, broken pass of its step (finished after the kill): not redone
    work."""
    same = [p for p in passes if p["wid"] == e["wid"] and p["step"] == e["step"]]
    return same[0] is e


def steady(a: argparse.Namespace) -> None:
    a.kill_step = -1
    times: dict[str, list[float]] = {"step": [], "lost": []}
    for rep in range(a.steady):
        for redo, got in times.items():
            got.append(run_once(a, redo)["step_s"])
            print(f"rep {rep} --redo {redo:4}: fault-free step {got[-1]:.4f} s", flush=True)
    med = {redo: statistics.median(got) for redo, got in times.items()}
    print(f"median step: --redo step {med['step']:.4f} s, --redo lost {med['lost']:.4f} s, "
          f"lost/step {med['lost'] / med['step']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spares", type=int, default=0,
                    help="hot spares (not awaited: one still starting is called in too)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2560)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--steady", type=int, default=0)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.steady:
        steady(a)
        return
    results: dict[str, list[dict[str, float]]] = {"step": [], "lost": []}
    for rep in range(a.reps):
        for redo in results:
            got = run_once(a, redo)
            results[redo].append(got)
            print(f"rep {rep} --redo {redo:4}: step {got['step_s']:.3f} s, fault -> next "
                  f"committed step {got['recovery_s']:.3f} s, redone samples "
                  f"{got['redone']:.0f} of {a.batch}", flush=True)
    med = {redo: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for redo, rs in results.items()}
    for redo, m in med.items():
        print(f"median --redo {redo:4}: step {m['step_s']:.3f} s, recovery "
              f"{m['recovery_s']:.3f} s, redone {m['redone']:.0f} samples")
    print(f"lost/step: recovery {med['lost']['recovery_s'] / med['step']['recovery_s']:.2f}x, "
          f"redone samples {med['lost']['redone'] / max(med['step']['redone'], 1):.2f}x "
          f"(the lost share is 1/{a.nproc} of the batch)")


if __name__ == "__main__":
    main()
