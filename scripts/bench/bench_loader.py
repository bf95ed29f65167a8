"""Time per `loader.batch()` with and without read-ahead, for a dataset whose items take 1 ms.

    python scripts/bench/bench_loader.py [--steps 40] [--compute-ms 50]

"idle" calls batch() back to back (read throughput); "with compute" sleeps compute-ms between
calls, as a training step would, and times only the wait inside batch().
"""

from __future__ import annotations

import argparse
import time

import torch

from ftrun.worker.loader import Loader


class SlowItems:
    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return torch.full((64,), float(i)), torch.tensor(i)


def per_batch_ms(workers: int, world: int, accum: int, steps: int, compute_s: float) -> float:
    started = time.perf_counter()
    loader = Loader(SlowItems(64 * (steps + 2), 0.001), 64, num_workers=workers,
                    membership=lambda: (0, world, 0))
    setup = time.perf_counter() - started
    waited = 0.0
    with loader:
        for step in range(steps):
            for micro in range(accum):
                t0 = time.perf_counter()
                loader.batch(step, micro, accum)
                waited += time.perf_counter() - t0
                time.sleep(compute_s / accum)
    if workers and compute_s == 0:
        print(f"    (start-up of {workers} readers: {setup * 1000:.1f} ms)")
    return waited / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    args = ap.parse_args()
    print("global batch 64, 1 ms per item; ms waited in batch() per step (all micro-batches)")
    for world, accum in ((1, 1), (4, 1), (1, 4)):
        for compute in (0.0, args.compute_ms / 1000):
            label = f"world {world}, accum {accum}, " + (
                f"{compute * 1000:.0f} ms compute" if compute else "idle")
            times = [per_batch_ms(w, world, accum, args.steps, compute) for w in (0, 2)]
            print(f"  {label:34s} num_workers=0: {times[0]:6.1f}   num_workers=2: {times[1]:6.1f}")


if __name__ == "__main__":
    main()
