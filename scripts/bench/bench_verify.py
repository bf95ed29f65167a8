"""What verifying the replicas costs a steady step (#53), on the GPT example.

    python scripts/bench/bench_verify.py [--nprocs 2 4] [--every 1 10 100] [--grads 1 4]
                                   [--e2e-steps 200]

Two measures:

1. Its parts, in one process (precise: no launch, no scheduler noise): a training step of
   one rank of the GPT example (dim 256 x 4 layers, AdamW, 2 micro-batches of 32/nproc
   sequences, fp32, CPU), and what --verify-every adds to it: every N committed steps the
   fingerprint of the registered state (model and optimizer: two integer sums per tensor)
   and the host copy of a verified state (what a rollback returns to); every K steps
   (--verify-grads-every) the local gradient's squared norm (the gradient check). The cost
   at N and K is (fingerprint + copy) / N + norm / K, as a share of the step. The
   comparison's collective (one all-reduce of 2 x 8 bytes per tensor) is not in it: the
   end-to-end runs carry it.
2. End to end: one ftrun job per N (0: off) on the same example, in turns, twice; the mean
   gap between rank 0's commits after the first 10 steps, and its ratio to N = 0. On a
   shared 2-core host this moves by more than the 0.5 % goal from run to run: read it as a
   check that nothing is far off, and measure 1 for the budget.
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

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
GPT_SCRIPT = os.path.join(EXAMPLES, "train_gpt.py")
DIM, LAYERS, BLOCK, BATCH, ACCUM = 256, 4, 64, 32, 2


def timed(fn: object, reps: int) -> float:
    """The median of `reps` timings of fn(), in seconds."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def parts(nproc: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, EXAMPLES)
    from train_gpt import GPT, VOCAB_SIZE

    from ftrun.worker.verify import Verifier, fingerprint, leaves_of

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one rank's share of a 2-core host, as under ftrun
    model = GPT(BLOCK, DIM, LAYERS, 4, False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    micro = max(1, BATCH // nproc // ACCUM)

    def step() -> None:
        for _ in range(ACCUM):
            x = torch.randint(0, VOCAB_SIZE, (micro, BLOCK))
            loss = F.cross_entropy(model(x).view(-1, VOCAB_SIZE), x.view(-1))
            (loss / ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(3):
        step()  # the optimizer's state exists
    objects = {"model": model, "optimizer": opt}
    tensors = [t for _, t in leaves_of(objects)]
    verifier = Verifier(1)

    kept = iter(range(1, 1 << 30))

    def keep() -> None:  # a new step each time: the copy into the buffers of the last one
        verifier.keep(next(kept), objects)

    def norms() -> None:  # what the buckets add per step: the squared norm, on the device
        sum(torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
            for p in model.parameters() if p.grad is not None)

    step()  # gradients to take the norm of
    return {"step": timed(step, 15), "fingerprint": timed(lambda: fingerprint(tensors, "cpu"), 15),
            "keep": timed(keep, 15), "norm": timed(norms, 15),
            "state_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6}


def e2e(nproc: int, every: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(nproc), "--verify-every",
               str(every), GPT_SCRIPT, "--steps", str(steps), "--dim", str(DIM), "--layers",
               str(LAYERS), "--dtype", "fp32", "--bucket-mb", "1", "--workers", "0",
               "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[3:])} failed:\n{r.stderr[-3000:]}")
        with open(os.path.join(out, "log_0.json")) as f:
            log = json.load(f)["log"]
    times = [e["t"] for e in log[10:]]  # commit to commit: a comparison is in one gap
    return statistics.mean(b - a for a, b in zip(times, times[1:], strict=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--grads", type=int, nargs="+", default=[1, 4],
                    help="--verify-grads-every values for the parts")
    ap.add_argument("--e2e-steps", type=int, default=200, help="0: the parts only")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    for nproc in a.nprocs:
        p = parts(nproc)
        print(f"{nproc} workers, one rank's parts: step {p['step'] * 1000:.1f} ms; state "
              f"{p['state_mb']:.1f} MB: fingerprint {p['fingerprint'] * 1000:.2f} ms, host "
              f"copy {p['keep'] * 1000:.2f} ms; gradient norm {p['norm'] * 1000:.3f} ms a step",
              flush=True)
        for every in a.every:
            for grads in a.grads:
                cost = ((p["fingerprint"] + p["keep"]) / every + p["norm"] / grads) / p["step"]
                print(f"{nproc} workers, --verify-every {every:3} --verify-grads-every "
                      f"{grads}: {cost * 100:.3f} % of a step", flush=True)
    if a.e2e_steps <= 0:
        return
    for nproc in a.nprocs:
        got: dict[int, list[float]] = {n: [] for n in (0, *a.every)}
        for rep in range(a.reps):
            order = list(got) if rep % 2 == 0 else list(reversed(got))  # in turns
            for every in order:
                got[every].append(e2e(nproc, every, a.e2e_steps))
        base = statistics.median(got[0])
        for every, times in got.items():
            med = statistics.median(times)
            print(f"{nproc} workers, end to end, --verify-every {every:3}: step "
                  f"{med * 1000:.1f} ms, {med / base:.4f}x of off", flush=True)


if __name__ == "__main__":
    main()
