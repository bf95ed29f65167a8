"""A small real training job with the ftrun worker API (CPU by default, CUDA when present).

    ftrun --nproc 4 examples/train_ddp.py --steps 200
    python examples/train_ddp.py --steps 20        # runs alone, no fault tolerance
    torchrun --nproc-per-node 2 examples/train_ddp.py   # runs under torchrun too

The four ftrun lines are marked. The data is a fixed synthetic regression problem whose
global batch for step s depends on s only, so every committed step consumes its batch once,
whatever faults, shrinks and grows happen.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import ftrun


def make_model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def global_batch(step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size, 32, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x.to(device), y.to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--out", help="write final parameters (rank 0) and a JSON log here")
    args = ap.parse_args()

    ft = ftrun.init()                                            # ftrun line 1
    torch.manual_seed(0)
    model = ft.wrap(make_model(args.width, args.depth).to(ft.device))  # ftrun line 2
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ft.register(model=model, optimizer=opt)                      # ftrun line 3
    loss_fn = torch.nn.MSELoss()
    log = []
    for step in ft.steps(args.steps):                            # ftrun line 4
        x, y = global_batch(step, args.batch, ft.device)
        sl = ft.batch_slice(args.batch)
        loss = loss_fn(model(x[sl]), y[sl])
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time)
        committed = ft.commit(opt)
        log.append({"step": step, "committed": committed, "t": time.time(), "loss": loss.item(),
                    "world": ft.world_size, "gen": ft.generation})
        if ft.rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} world {ft.world_size}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        wid = os.environ.get("FTRUN_WORKER_ID", str(ft.rank))
        torch.save(model.state_dict(), os.path.join(args.out, f"params_{wid}.pt"))
        with open(os.path.join(args.out, f"log_{wid}.json"), "w") as f:
            json.dump({"rank": ft.rank, "pid": os.getpid(), "log": log}, f)
    ft.close()


if __name__ == "__main__":
    main()
