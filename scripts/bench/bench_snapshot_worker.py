"""Worker for bench_snapshot.py: the recovery benchmark's model (bench_recovery_worker's
`model()` and `batch()`, one model for both benchmarks), trained either with the ftrun API
(--mode ftrun: snapshots are whatever the ftrun flags say) or as plain torchrun + DDP that
calls `torch.distributed.checkpoint.save` on every rank every --dcp-every steps (--mode ddp).
With --shard-size S > 1 the model is sharded with FSDP2 (`fully_shard` per Linear, then the
root): under ftrun over `ft.shard_mesh` (ftrun's replica groups of S), under torchrun over a
mesh of S (HSDP's (replicate, shard) mesh when there are more ranks than S), the state saved
by dcp.save being the FSDP2 state dicts (DTensors) in both.

Appends JSON lines to OUT/events.jsonl:
  {"ev": "step", "step", "t", "rank", "attempt"}   every committed step
  {"ev": "kill", "step", "t", "rank"}              just before a worker SIGKILLs itself
                                                   (--die-all-at: every worker of attempt 0)
  {"ev": "dcp", "step", "rank", "ms"}              one dcp.save call, as its caller saw it
  {"ev": "memcpy", "bytes", "tensors", "prealloc_ms", "clone_ms"}
                                                   --memcpy: rank 0, after training, copying
                                                   the registered state once in memory
Owns nothing of ftrun; must not import ftrun outside --mode ftrun (torchrun runs it too).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_recovery_worker import batch, model  # noqa: E402

LR = 0.01  # bench_recovery_worker's optimizer: plain SGD, no momentum
MEMCPY_REPEATS = 5


def log(out: str, **ev: object) -> None:
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(ev) + "\n")


def maybe_die(a: argparse.Namespace, step: int, attempt: str, rank: int) -> None:
    """Every worker of the first attempt dies at --die-all-at, before its backward: a total
    loss with the step uncommitted everywhere."""
    if step == a.die_all_at and attempt == "0":
        log(a.out, ev="kill", step=step, t=time.time(), rank=rank)
        os.kill(os.getpid(), signal.SIGKILL)


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_of(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_of(v)


def measure_memcpy(out: str, objects: Mapping[str, Any]) -> None:
    """The state copied once in memory, the way a snapshot's blocking part would at best:
    into buffers allocated beforehand, and into fresh tensors (clone). Every clone is kept
    until the end so that each repeat gets fresh pages (page faults included), as the first
    copy of a state into new memory does."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t.detach()
               for t in tensors_of({k: o.state_dict() for k, o in objects.items()})]
    size = sum(t.numel() * t.element_size() for t in tensors)
    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors, strict=True):
        b.copy_(t)  # touch every page of the buffers once: they are "allocated beforehand"
    prealloc, clone, kept = [], [], []
    for _ in range(MEMCPY_REPEATS):
        started = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t)
        prealloc.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        kept.append([t.clone() for t in tensors])
        clone.append((time.perf_counter() - started) * 1000)
    log(out, ev="memcpy", bytes=size, tensors=len(tensors),
        prealloc_ms=round(statistics.median(prealloc), 3),
        clone_ms=round(statistics.median(clone), 3))


def sharded(m: Any, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def run_ftrun(a: argparse.Namespace) -> None:
    import ftrun

    ft = ftrun.init()
    m = ft.wrap(sharded(model(), ft.shard_mesh) if a.shard_size > 1 else model())
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    ft.register(model=m, optimizer=opt)
    attempt = os.environ.get("FTRUN_ATTEMPT", "0")
    for step in ft.steps(a.steps):
        x, y = batch(step, a.batch)
        sl = ft.batch_slice(a.batch)
        loss = torch.nn.functional.mse_loss(m(x[sl]), y[sl])
        maybe_die(a, step, attempt, ft.rank)
        loss.backward()
        if a.shard_size > 1:  # the sharded loop (docs/sharded.md): sync, step, commit
            if not ft.sync():
                continue
            opt.step()
        if ft.commit() if a.shard_size > 1 else ft.commit(opt):
            log(a.out, ev="step", step=step, t=time.time(), rank=ft.rank, attempt=int(attempt))
    if a.memcpy and ft.rank == 0:
        measure_memcpy(a.out, {"model": m, "optimizer": opt})
    ft.close()


def run_ddp(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.shard_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (a.shard_size,) if world == a.shard_size else (world // a.shard_size,
                                                                a.shard_size)
        m: Any = sharded(model(), init_device_mesh("cpu", shape))
    else:
        m = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    per = a.batch // world
    for step in range(a.steps):
        x, y = batch(step, a.batch)
        sl = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x[sl]), y[sl]).backward()
        opt.step()
        log(a.out, ev="step", step=step, t=time.time(), rank=rank, attempt=0)
        if a.dcp_every > 0 and (step + 1) % a.dcp_every == 0:
            module = m if a.shard_size > 1 else m.module
            state = {"model": module.state_dict(), "optimizer": opt.state_dict()}
            started = time.perf_counter()
            dcp.save(state, checkpoint_id=os.path.join(a.ckpt_dir, f"step-{step + 1:09d}"))
            log(a.out, ev="dcp", step=step + 1, rank=rank,
                ms=round((time.perf_counter() - started) * 1000, 2))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ftrun", "ddp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--die-all-at", type=int, default=-1)
    ap.add_argument("--memcpy", action="store_true", help="rank 0 measures a copy in memory")
    ap.add_argument("--dcp-every", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="")
    ap.add_argument("--shard-size", type=int, default=1, help="FSDP2 over groups of this size")
    a = ap.parse_args()
    (run_ftrun if a.mode == "ftrun" else run_ddp)(a)


if __name__ == "__main__":
    main()
