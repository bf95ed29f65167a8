"""One rank of bench_hsdp.py: a small transformer sharded with FSDP2 per block, AdamW,
clip_grad_norm_, 2 replica groups of 2.

--mode plain   torchrun's HSDP: a (replicate, shard) mesh, FSDP2 averages across groups
--mode ftrun   ftrun's: `fully_shard` over ft.shard_mesh, ftrun averages across groups
Each rank appends {"rank", "step", "t"} per committed step to OUT/steps.jsonl; with
--kill-step K, global rank 2 SIGKILLs itself at step K, before its backward.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from torch.distributed.fsdp import fully_shard

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=["plain", "ftrun"], required=True)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--blocks", type=int, default=4)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--kill-step", type=int, default=-1)
ap.add_argument("--out", required=True)
a = ap.parse_args()


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(a.blocks):
        layers.append(torch.nn.TransformerEncoderLayer(a.width, 4, 4 * a.width, dropout=0.0,
                                                       batch_first=True))
    return torch.nn.Sequential(*layers, torch.nn.Linear(a.width, a.width))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(a.batch, 16, a.width, generator=g)
    per = a.batch // world
    return x[rank * per:(rank + 1) * per]


log = open(os.path.join(a.out, "steps.jsonl"), "a", buffering=1)  # noqa: SIM115 (to the end)
model = make_model()
if a.mode == "plain":
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(a.steps):
        x = batch(step, rank, world)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        log.write(json.dumps({"rank": rank, "step": step, "t": time.time()}) + "\n")
    dist.destroy_process_group()
else:
    import time

    import ftrun

    ft = ftrun.init()
    for block in model:
        fully_shard(block, mesh=ft.shard_mesh)
    fully_shard(model, mesh=ft.shard_mesh)
    model = ft.wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ft.register(model=model, optimizer=opt)
    for step in ft.steps(a.steps):
        x = batch(step, ft.rank, ft.world_size)
        if ft.rank == 2 and step == a.kill_step and os.environ.get("FTRUN_WORKER_ID") == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        model(x).pow(2).mean().backward()
        if not ft.sync():
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if ft.commit():
            log.write(json.dumps({"rank": ft.rank, "step": step, "t": time.time()}) + "\n")
    ft.close()
