"""What a planned leave costs the members: `ftrun drain --rank 1` against a SIGKILL of rank 1.

    python scripts/bench/bench_drain.py [--nproc 4] [--step-s 0.05 0.5] [--reps 3]

4 workers and 1 hot spare train an MLP (a ~1 MB state; the step padded to --step-s with a
sleep, as a GPU step leaves the CPU idle). Per step time, one fault-free run (the reference),
then per repetition a drain run (`ftrun drain --rank 1` once every rank passed --at-step) and a
kill run (rank 1 SIGKILLs itself at --at-step: the unplanned leave with a spare). Per run:
  stall     the members' step gap at the swap (or the fault) minus their median step gap,
            each member's, then the median over members
  ftrun     the drain's own figure: the members' boundary at the swap (rebuilt + healed)
  lost      committed steps missing on a member (0 expected), repeated: committed twice
  bitwise   the final replicas equal the reference's, tensor for tensor
and the medians over repetitions with the ratio drain/kill. The goal (#48): a drain's stall
<= 20 ms on CPU/gloo, 0 lost, 0 repeated, bitwise. This file is the worker too (--worker).
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
from typing import Any

WIDTH, DEPTH, BATCH = 192, 4, 256


def worker(a: argparse.Namespace) -> None:
    import torch

    import ftrun

    wid = int(os.environ.get("FTRUN_WORKER_ID", "0"))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, WIDTH), torch.nn.Tanh()]
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
    ft = ftrun.init()
    model = ft.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ft.register(model=model, optimizer=opt)
    log = open(os.path.join(a.out, f"passes_{wid}.jsonl"), "a")  # noqa: SIM115
    for step in ft.steps(a.steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        if a.kill_at == step and wid == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        sl = ft.batch_slice(BATCH)
        torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        time.sleep(a.step_s)
        ok = ft.commit(opt)
        log.write(json.dumps({"t": time.time(), "step": step, "ok": ok,
                              "gen": ft.generation}) + "\n")
        log.flush()
    torch.save(model.state_dict(), os.path.join(a.out, f"params_{wid}.pt"))
    ft.close()


def launch(a: argparse.Namespace, out: str, step_s: float, kill_at: int = -1
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), "--spares", "1",
           "--rdzv-id", f"bench-drain-{os.getpid()}", "--log-dir", os.path.join(out, "logs"),
           __file__, "--worker", "--out", out, "--steps", str(a.steps), "--step-s",
           str(step_s), "--kill-at", str(kill_at)]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def passes(out: str) -> dict[int, list[dict[str, Any]]]:
    got: dict[int, list[dict[str, Any]]] = {}
    for name in os.listdir(out):
        if name.startswith("passes_"):
            with open(os.path.join(out, name)) as f:
                got[int(name[7:-6])] = [json.loads(line) for line in f if line.strip()]
    return got


def wait(proc: subprocess.Popen[str], what: str) -> None:
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{err[-3000:]}")


def run(a: argparse.Namespace, step_s: float, how: str) -> dict[str, Any]:
    import torch

    with tempfile.TemporaryDirectory() as out:
        proc = launch(a, out, step_s, kill_at=a.at_step if how == "kill" else -1)
        drain: dict[str, Any] = {}
        if how == "drain":
            _await_swap_point(a, out)
            r = subprocess.run([sys.executable, "-m", "ftrun", "drain", "--rank", "1",
                                "--run-id", f"bench-drain-{os.getpid()}"],
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                proc.kill()
                raise SystemExit(f"ftrun drain failed:\n{r.stdout}{r.stderr}")
            drain = _drain_event(out)
        wait(proc, how)
        logs = passes(out)
        params = {int(n[7:-3]): torch.load(os.path.join(out, n)) for n in os.listdir(out)
                  if n.startswith("params_")}
    return {"logs": logs, "params": params, "drain": drain}


def _await_swap_point(a: argparse.Namespace, out: str) -> None:
    """Every member past --at-step and the spare ready (as an operator would wait for it)."""
    run_id = f"bench-drain-{os.getpid()}"
    deadline, ready = time.time() + 300, False
    while time.time() < deadline:
        if not ready:
            r = subprocess.run([sys.executable, "-m", "ftrun", "status", "--run-id", run_id,
                                "--json"], capture_output=True, text=True, timeout=60)
            ready = r.returncode == 0 and any(
                w["role"] == "spare" for w in json.loads(r.stdout)["workers"])
        got = [v for v in passes(out).values() if v]  # a spare's log is empty
        if ready and len(got) >= a.nproc and min(len(v) for v in got) > a.at_step:
            return
        time.sleep(0.01)
    raise SystemExit("the job never reached --at-step with its spare ready")


def _drain_event(out: str) -> dict[str, Any]:
    logs = os.path.join(out, "logs")
    for run_dir in os.listdir(logs):
        with open(os.path.join(logs, run_dir, "events.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        done = [e for e in rows if e["event"] == "drain" and e["state"] == "done"]
        if done:
            return done[-1]
    return {}


def figures(got: dict[str, Any], ref: dict[str, Any], steps: int) -> dict[str, Any]:
    """The members' stall at the generation change, lost and repeated steps, bitwise."""
    stalls, repeated, committed = [], 0, set()
    for wid, log in got["logs"].items():
        done = [p for p in log if p["ok"]]
        seen = [p["step"] for p in done]
        repeated += len(seen) - len(set(seen))
        committed.update(seen)
        if seen and seen[0] == 0 and wid in got["params"]:  # a member from start to end
            gaps = [(b["t"] - a_["t"], b["gen"] != a_["gen"]) for a_, b in zip(done, done[1:],
                                                                               strict=False)]
            at = [g for g, changed in gaps if changed]
            if at:
                stalls.append(max(at) - statistics.median(g for g, _ in gaps))
    ref_params = ref["params"][0]
    bitwise = all(all(p[k].equal(ref_params[k]) for k in ref_params)
                  for p in got["params"].values())
    lost = steps - len(committed)  # committed by no one
    return {"stall_s": statistics.median(stalls) if stalls else float("nan"), "lost": lost,
            "repeated": repeated, "bitwise": bitwise,
            "ftrun_ms": got["drain"].get("stall_ms")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--at-step", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--step-s", type=float, nargs="+", default=[0.05, 0.5])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.worker:
        a.step_s = a.step_s[0]
        worker(a)
        return
    for step_s in a.step_s:
        if step_s >= 0.3:  # long steps: fewer of them, the swap still in the middle
            a.steps, a.at_step = 40, 20
        ref = run(a, step_s, "reference")
        rows: dict[str, list[dict[str, Any]]] = {"drain": [], "kill": []}
        for rep in range(a.reps):
            for how in rows:
                row = figures(run(a, step_s, how), ref, a.steps)
                rows[how].append(row)
                ftrun_ms = f", ftrun's boundary {row['ftrun_ms']:.1f} ms" \
                    if row["ftrun_ms"] is not None else ""
                print(f"step {step_s:g} s, rep {rep}, {how:5}: members' stall "
                      f"{row['stall_s'] * 1000:7.1f} ms{ftrun_ms}; lost {row['lost']}, "
                      f"repeated {row['repeated']}, bitwise {row['bitwise']}", flush=True)
        med = {how: statistics.median(r["stall_s"] for r in rs) for how, rs in rows.items()}
        print(f"step {step_s:g} s: median stall drain {med['drain'] * 1000:.1f} ms, kill "
              f"{med['kill'] * 1000:.1f} ms, drain/kill {med['drain'] / med['kill']:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
