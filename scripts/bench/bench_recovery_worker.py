"""Worker for bench_recovery.py: one MLP (~10 M parameters), either with the ftrun API
(--mode ftrun) or as a plain torchrun + DDP script that checkpoints to disk every
--ckpt-every steps and resumes from the last checkpoint after a restart (--mode ddp).

Appends JSON lines to OUT/events.jsonl: {"ev": "step", "step", "t", "rank", "world", "pid"}
for every committed step, and {"ev": "kill", "t"} just before the victim SIGKILLs itself.
With --dump, each rank that finishes as a member saves its final parameters to
OUT/params_<rank>.pt (bench_storm.py compares them bitwise; a spare never called in saves none).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

WIDTH, DEPTH, IN = 1024, 9, 256  # 256*1024 + 8*1024*1024 + 1024 ≈ 8.7 M weights + biases


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, WIDTH), torch.nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, IN, generator=g)
    return x, x[:, :1].sin()


def log(out: str, **ev: object) -> None:
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(ev) + "\n")


def dump(out: str, rank: int, m: torch.nn.Module) -> None:
    path = os.path.join(out, f"params_{rank}.pt")
    torch.save(m.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)


VICTIM = os.environ.get("RANK") == os.environ.get("BENCH_KILL_RANK", "1")  # rank at start


def maybe_die(a: argparse.Namespace, step: int, first_life: bool) -> None:
    if first_life and VICTIM and step == a.kill_step:
        log(a.out, ev="kill", t=time.time(), step=step)
        os.kill(os.getpid(), signal.SIGKILL)


def run_ftrun(a: argparse.Namespace) -> None:
    import ftrun

    ft = ftrun.init()
    m = ft.wrap(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ft.register(model=m, optimizer=opt)
    first_life = int(os.environ["FTRUN_WORKER_ID"]) < int(os.environ["LOCAL_WORLD_SIZE"])
    for step in ft.steps(a.steps):
        x, y = batch(step, a.batch)
        sl = ft.batch_slice(a.batch)
        torch.nn.functional.mse_loss(m(x[sl]), y[sl]).backward()
        maybe_die(a, step, first_life)
        if ft.commit(opt):
            log(a.out, ev="step", step=step, t=time.time(), rank=ft.rank, world=ft.world_size,
                pid=os.getpid())
    if a.dump and ft.rank >= 0:
        dump(a.out, ft.rank, m)
    ft.close()


def run_ddp(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ckpt = os.path.join(a.out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        m.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    per = a.batch // world
    for step in range(start, a.steps):
        x, y = batch(step, a.batch)
        sl = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        maybe_die(a, step, first_life)
        torch.nn.functional.mse_loss(m(x[sl]), y[sl]).backward()
        opt.step()
        log(a.out, ev="step", step=step, t=time.time(), rank=rank, world=world, pid=os.getpid())
        if rank == 0 and (step + 1) % a.ckpt_every == 0:
            torch.save({"model": m.module.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    if a.dump:
        dump(a.out, rank, m.module)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ftrun", "ddp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--dump", action="store_true", help="save final parameters (see above)")
    a = ap.parse_args()
    (run_ftrun if a.mode == "ftrun" else run_ddp)(a)


if __name__ == "__main__":
    main()
