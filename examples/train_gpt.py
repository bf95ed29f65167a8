"""A small GPT trained the way people train large ones, fault tolerant with ftrun.

    ftrun --nproc 4 --spares 1 examples/train_gpt.py --steps 200
    python examples/train_gpt.py --steps 20                   # alone, no fault tolerance
    torchrun --nproc-per-node 2 examples/train_gpt.py         # under torchrun too
    ftrun --nproc 4 --shard-size 2 examples/train_gpt.py --fsdp   # HSDP: 2 groups of 2

The loop: AdamW with decay / no-decay parameter groups, linear warmup then cosine decay,
gradient clipping at 1.0, bf16 autocast (CPU and CUDA; fp16 with a GradScaler on CUDA),
gradient accumulation over micro-batches, and `ft.loader` over byte tokens of a text that
ships in examples/data. Gradients are all-reduced in buckets while backward runs; `ft.sync()`
waits for them, then the user's own clipping, scaler and optimizer see the global average.

With --fsdp (under `ftrun --shard-size N`) each block and the whole model are sharded with
FSDP2 over `ft.shard_mesh`, inside a replica group of N ranks; ftrun averages each shard
across the groups in `ft.sync()`, and a fault takes only its group out until a fresh one heals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_data import VOCAB_SIZE, TokenDataset  # noqa: E402

import ftrun  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.drop = nn.Dropout(dropout)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, block_size: int, dim: int, layers: int, heads: int, tie: bool,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB_SIZE, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB_SIZE, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def shard(gpt: nn.Module, mesh: object, tie: bool) -> None:
    """FSDP2 per block, then the rest at the root, over this replica group's mesh."""
    from torch.distributed.fsdp import fully_shard

    if tie:
        raise SystemExit("train_gpt.py: --fsdp with --tie is not supported (tied weights "
                         "span two FSDP units); drop --tie")
    for block in gpt.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(gpt, mesh=mesh)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Matrices decay; biases, norms and embeddings do not (nanoGPT's rule)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        big = p.dim() >= 2 and "tok" not in name and "pos" not in name
        (decay if big else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):  # noqa: ANN201
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return factor


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tie", action="store_true", help="tie the embedding and output weights")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--workers", type=int, default=2, help="loader reader processes")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--fsdp", action="store_true",
                    help="shard with FSDP2 over ft.shard_mesh (run under ftrun --shard-size N)")
    ap.add_argument("--out", help="final parameters and the loss log of every worker")
    return ap.parse_args()


def main() -> None:
    args = parse()
    ft = ftrun.init()
    torch.manual_seed(0)
    gpt = GPT(args.block, args.dim, args.layers, args.heads, args.tie, args.dropout)
    if args.fsdp:
        shard(gpt.to(ft.device), ft.shard_mesh, args.tie)
    model = ft.wrap(gpt.to(ft.device), bucket_mb=args.bucket_mb)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    fp16 = args.dtype == "fp16" and ft.device.type == "cuda"
    scaler = torch.amp.GradScaler(ft.device.type, enabled=fp16)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    data = TokenDataset.from_text(block_size=args.block, stride=args.block // 2)
    loader = ft.loader(data, global_batch_size=args.batch, shuffle=True, seed=0,
                       num_workers=args.workers)
    ft.register(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    log = []
    for step in ft.steps(args.steps):
        t0, total = time.time(), 0.0
        for micro in range(args.accum):
            x, y = (t.to(ft.device) for t in loader.batch(step, micro, args.accum))
            last = micro == args.accum - 1
            quiet = contextlib.nullcontext() if last else ft.no_sync()
            if args.fsdp:  # FSDP's own reduce-scatter: only after the last micro-batch
                model.set_requires_gradient_sync(last)
            with quiet:  # the backward too: that is where buckets start
                with torch.autocast(ft.device.type, dtype=amp_dtype,
                                    enabled=amp_dtype is not None):
                    logits = model(x)
                    loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), y.view(-1))
                scaler.scale(loss / args.accum).backward()
            total += loss.item() / args.accum
        if not ft.sync():  # the step broke (a peer failed): do not step, it will repeat
            continue
        scaler.unscale_(opt)  # the gradients are the global average on every rank now
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        ft.commit()
        log.append({"step": step, "loss": total, "norm": float(norm), "rank": ft.rank,
                    "world": ft.world_size, "gen": ft.generation,
                    "lr": sched.get_last_lr()[0], "ms": round((time.time() - t0) * 1000, 1),
                    "t": time.time()})
        if ft.rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {total:.4f} grad-norm {float(norm):.3f} "
                  f"world {ft.world_size}", flush=True)
    loader.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        wid = os.environ.get("FTRUN_WORKER_ID", str(max(ft.rank, 0)))
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in model.state_dict().items()}  # a sharded model: gathered
        torch.save(state, os.path.join(args.out, f"params_{wid}.pt"))
        with open(os.path.join(args.out, f"log_{wid}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "log": log}, f)
    ft.close()


if __name__ == "__main__":
    main()
